"""Rows on their way from a vLLM step to their saves' files in shared memory (_saves.SavesStore's folder).

A step's rows of a location arrive as one host block for every saving request (on a GPU, copied without
waiting: the block is ready once the step's CUDA event is). They go to `_C.RowSink`, which reserves each
request's room in its file, keeps the block and pwrites the rows on a thread of its own, outside Python: the
stepping thread's work per block is one call, whatever the number of requests (on the H100's host the
per-request reserving and writing in Python had cost 0.9 ms of a 2.6 ms decode step, run33).
  on a GPU   blocks are put unreleased; `seal` notes the step's CUDA event, and the next step's `flush`
             releases the blocks of every step whose event is done (the sink never waits for the device)
  the CPU    a block may be a view of the layer's value: put released, and written before `put` returns
A save whose write is refused (shared memory full) goes on in memory inside the sink (`spilled`); its file's
rows and those are read back at the take (_rowfile.RowFile.read).
`SaveBatch`: one location's saving requests, prepared once while a decode batch repeats (_worker._Prepared),
so that a step's block costs one put.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable, Dict, Optional

import torch

from .. import _C
from ._rowfile import RowFile

log = logging.getLogger("fragments.vllm")

READY = True  # a block whose rows can be read now (no copy in flight)


class SaveBatch:
    """Where one location's block of rows goes, for a fixed set of requests: the files of save `name` of
    `keys` (their store records), rows [lo, hi) each, `row_bytes` a row; `order`: which of the parts it was made
    from they are (None: all). Valid while its store's `generation` is unchanged (a request opened, taken, dropped or truncated)."""
    __slots__ = ("name", "keys", "records", "order", "files", "lo", "hi", "bytes", "total", "largest", "generation",
                 "_layouts")

    def __init__(self, name, keys, records, order, files, lo, hi, row_bytes, generation):
        self.name, self.keys, self.records, self.order = name, keys, records, order
        self.files, self.lo, self.hi = files, lo, hi
        self.bytes = [(h - l) * row_bytes for l, h in zip(lo, hi)]
        self.total, self.largest = sum(self.bytes), max(self.bytes, default=0)
        self.generation = generation
        self._layouts: Dict[tuple, tuple] = {}

    def layout(self, n: int, count: int) -> tuple:
        """(files, lo, hi) of a block holding `n` steps of `count` rows each, one after the other: each file's
        parts in step order. Made once per shape: a drain puts blocks of the same shape step after step."""
        got = self._layouts.get((n, count))
        if got is None:
            got = self._layouts[(n, count)] = (self.files * n, [a + j * count for j in range(n) for a in self.lo],
                                               [b + j * count for j in range(n) for b in self.hi])
        return got


class RowQueue:
    """The rows of a store's saves on their way to its folder (module docstring). `records`: the store's key ->
    record (`files`, `saves`, `error`), read and changed under the store's lock, which its callers hold; `wait`:
    waits for the device's copies."""

    def __init__(self, folder: str, records: Dict[str, object], wait: Optional[Callable[[], None]]):
        self.folder, self._records, self._wait = folder, records, wait
        self.sink = _C.RowSink()
        self._sealed: "deque[tuple]" = deque()  # (a step's CUDA event, the last block put before it)
        self._released = 0  # blocks up to this one may be written

    def __len__(self) -> int:
        return self.sink.pending

    def file(self, record, key: str, name: str, host) -> Optional[RowFile]:
        """The file of `key`'s save `name` (made with its first rows, `host`'s), or None: its rows wait in memory
        (shared memory full, or rows of another shape: the request's error). The lock held."""
        f = record.files.get(name)
        if f is None and name not in record.saves:
            try:
                f = record.files[name] = RowFile(self.sink, self.folder, key, name, tuple(host.shape[1:]), host.dtype)
            except OSError as e:
                log.warning("fragments: %s: the rows of %s wait in memory: %s (%s)", key, name, self.folder, e)
                record.saves[name] = []
                return None
        if f is not None:
            try:
                f.fits(host)
            except ValueError as e:
                record.error = record.error or f"fragments plan of request {key}: {e}"
                return None
        return f

    def put(self, name: str, host, parts, ready) -> None:
        """A block (the lock held): `parts` [(key, first row, row past the last, step)] of `host`; `ready`: READY,
        or None until a sealed step's event is done. Rows of a save kept in memory are appended there."""
        files, lo, hi, steps = [], [], [], []
        for key, a, b, step in parts:
            record = self._records.get(key)
            if record is None:
                continue
            f = self.file(record, key, name, host)
            if f is None:
                memory = record.saves.get(name)
                if memory is not None:
                    memory.append((step, host[a:b], None, None))
                continue
            files.append(f.fid)
            lo.append(a)
            hi.append(b)
            steps.append(step)
        if files:
            self.put_files(host, files, lo, hi, steps, ready)

    def put_files(self, host, files, lo, hi, steps, ready) -> None:
        """A block whose files are known (SaveBatch's): one call; on the CPU written before it returns."""
        if not host.is_contiguous():  # a view of the layer's value (the CPU's: q of q|k|v, say)
            host = host.contiguous()
        self.sink.put(host, files, lo, hi, steps, ready is READY)
        if ready is READY:  # the CPU's block can be a view of the layer's value, which the model goes on to change
            self.sink.drain()

    def seal(self, event) -> None:
        """The blocks put so far are ready once `event` (recorded after their copies on the stream) is."""
        if self.sink.last > self._released:
            self._sealed.append((event, self.sink.last))

    def flush(self, wait: bool = False) -> None:
        """Blocks whose step's copies are done are handed to the sink's thread (`wait`: all of them, after waiting
        for the device, and written before this returns)."""
        while self._sealed and (wait or self._sealed[0][0].query()):
            event, self._released = self._sealed.popleft()
            if wait:
                event.synchronize()  # the sink reads the blocks once released: their copies must be done
            self.sink.release(self._released)
        if wait:
            if self.sink.last > self._released:  # copies of a step not sealed yet: wait for the device
                if self._wait is not None:
                    self._wait()
                self._released = self.sink.last
                self.sink.release(self._released)
            self.sink.drain()


class HostCopies:
    """A worker's saves copied from its device to the host: from a GPU into pinned memory without waiting (the
    copy is ordered on the stream after the value is made and before anything overwrites it), an event after
    each step's copies (`seal`: the queue writes their rows once it is done), one wait before saves leave."""

    def __init__(self, device):
        self.device = device
        self.pending = False  # copies made without waiting since the last wait
        self.stream = None  # the stream of this step's copies, sealed at the step's end

    @staticmethod
    def asynchronous(part) -> bool:
        """Whether `part`'s copy runs without waiting (a GPU's): its rows are ready only once the step's event is."""
        return part.device.type == "cuda"

    def copy(self, part):
        if part.device.type != "cuda":
            return part.detach().to("cpu", copy=True)
        return self.into(torch.empty(part.shape, dtype=part.dtype, pin_memory=True), part)  # torch's pinned cache

    def host_block(self, nbytes: int):
        """A host block for into(): pinned where the device is a GPU (its copies then run without waiting)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def into(self, host, part):
        """`part` copied into `host` (a block of the same shape and dtype; the caller's to keep or reuse)."""
        if part.device.type != "cuda":
            return host.copy_(part.detach())
        host.copy_(part.detach(), non_blocking=True)
        self.pending = True
        self.stream = torch.cuda.current_stream(part.device)
        return host

    def seal(self, store) -> None:
        """At a step's end: its copies are done when an event recorded after them is (store.seal_step)."""
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            store.seal_step(event)
            self.stream = None

    def wait(self) -> None:
        """Before saves leave the store: every copy made without waiting is done."""
        if self.pending:
            torch.cuda.synchronize(self.device)
            self.pending = False


class DoneEvent:
    """A step's event whose copies are done: SimulatedDeviceCopies' (the CPU's copies are done when made)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class SimulatedDeviceCopies(HostCopies):
    """HostCopies as on a GPU, on the CPU, for probes and tests of the GPU's way without one
    (tools/probes/vllm_step_cost.py --as-gpu, tests/python/vllm_plugin/test_drain.py): every copy asynchronous, a
    block of its own (`copy`) or into a kept one (`into`), sealed at the step's end with `event()` (DoneEvent; a
    test may give one that is never done). `blocks`, `intos`: copies made, those into kept blocks."""

    def __init__(self, device=None):
        super().__init__(torch.device("cpu") if device is None else device)
        self.blocks = self.intos = 0
        self.event = DoneEvent

    @staticmethod
    def asynchronous(part) -> bool:
        return True

    def copy(self, part):
        self.stream = True
        self.blocks += 1
        return part.detach().clone()

    def into(self, host, part):
        self.stream = True
        self.blocks += 1
        self.intos += 1
        return host.copy_(part.detach())

    def seal(self, store) -> None:
        if self.stream is not None:
            store.seal_step(self.event())
            self.stream = None

    def wait(self) -> None:
        pass

    def attach(self, state) -> None:
        """These copies made a worker state's (_worker.WorkerState's): its store copies and waits through them."""
        state.copies = self
        state.saves._copy, state.saves._wait = self.copy, self.wait
        if state.saves.rows is not None:
            state.saves.rows._wait = self.wait
