"""Rows on their way from a vLLM step to their saves' files in shared memory (_saves.SavesStore's folder).

A step's rows of a location arrive as one host block for every saving request (on a GPU, copied without
waiting: the block is ready once the step's CUDA event is, `seal`). They are written in the order they came:
room is reserved in each request's file (_rowfile.RowFile.reserve) under the store's lock, then the bytes go in
with _C.write_rows, the GIL released once per batch. Who writes:
  threaded   a writer thread of the queue's own waits for each block's copy and writes it with every later
             block already copied, the lock not held while it writes (a take waits for the batch in flight;
             a drop that removes a file under it is harmless: files are opened by path per write)
  otherwise  `flush` at the worker's next step writes the blocks whose copy is done (the CPU: at once)
A write refused (shared memory full) sends that save on in memory, its file's earlier rows read back.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Callable, Dict, List, Optional

import torch

from .. import _C
from ._rowfile import RowFile, as_bytes

log = logging.getLogger("fragments.vllm")

READY = True  # a queued block whose rows can be read now (no copy in flight)


class _Queued:
    """Rows copied to the host whose copy may still run: (key, first row, row past the last, step) of `host`."""
    __slots__ = ("name", "host", "parts", "ready")

    def __init__(self, name, host, parts, ready):
        self.name, self.host, self.parts, self.ready = name, host, parts, ready


class _Write:
    """One request's rows [lo, hi) of one block `host`, bound for `offset` in its save's file (a batch's)."""
    __slots__ = ("file", "offset", "data", "record", "key", "name", "step", "host", "lo", "hi")

    def __init__(self, file, offset, data, record, key, name, step, host, lo, hi):
        self.file, self.offset, self.data, self.record = file, offset, data, record
        self.key, self.name, self.step, self.host, self.lo, self.hi = key, name, step, host, lo, hi

    @property
    def rows(self):
        """The rows as a tensor (a view of the block), wanted only where the write failed."""
        return self.host[self.lo:self.hi]


class RowQueue:
    """The rows of a store's saves on their way to its folder (module docstring). `records`: the store's key ->
    record (`files`, `saves`, `error`), guarded by `lock`, the store's; `wait`: waits for the device's copies."""

    def __init__(self, folder: str, records: Dict[str, object], lock: threading.Lock,
                 wait: Optional[Callable[[], None]], threaded: bool):
        self.folder, self._records, self._lock, self._wait, self.threaded = folder, records, lock, wait, threaded
        self._queue: "deque[_Queued]" = deque()
        self._queued = threading.Condition(lock)  # the writer thread waits on it for rows to write
        self._writer: Optional[threading.Thread] = None  # started with the first queued rows (threaded)
        self._in_flight = False  # the writer thread is writing a batch (without the lock)

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, name: str, host, parts, ready) -> None:
        """A block (the lock held): `parts` [(key, first row, row past the last, step)] of `host`; `ready`: READY,
        or None until `seal` gives it its copy's event."""
        self._queue.append(_Queued(name, host, parts, ready))
        if self.threaded:
            if self._writer is None:
                self._writer = threading.Thread(target=self._run, name="fragments-saves-writer", daemon=True)
                self._writer.start()
            self._queued.notify_all()

    def seal(self, event) -> None:
        """The blocks queued so far are ready when `event` (recorded after their copies on the stream) is."""
        with self._lock:
            for q in reversed(self._queue):
                if q.ready is not None:
                    break
                q.ready = event
            self._queued.notify_all()

    def flush(self, wait: bool = False) -> None:
        """Queued rows whose copy is done go into their files, in order (`wait`: all of them, after waiting
        for the copies; without it, a store with a writer thread leaves them to it)."""
        if self._writer is not None and not wait:
            return
        with self._lock:
            while self._in_flight:  # the writer thread's batch: its rows come before the queue's
                self._queued.wait()
            synced = False
            ready = []  # written in one batch: one call, the GIL released once
            while self._queue:
                q = self._queue[0]
                if not synced and q.ready is not READY and (q.ready is None or not q.ready.query()):
                    if not wait:
                        break
                    if q.ready is None:  # copies of a step not sealed yet: wait for the device
                        if self._wait is not None:
                            self._wait()
                        synced = True
                    else:
                        q.ready.synchronize()
                ready.append(self._queue.popleft())
            if ready:
                writes = self._reserve(ready)
                self._settle(writes, _write(writes))

    def _run(self) -> None:
        """The writer thread: once the queue's first rows are copied (waited for without the lock, so the steps
        go on queueing), they and every later block already copied are written in one batch: room reserved in
        their files under the lock, the bytes written without it and with the GIL released once
        (_C.write_rows). A take waits for a batch in flight; a drop removing a file under it is harmless."""
        while True:
            with self._lock:
                while not self._queue or self._queue[0].ready is None:
                    self._queued.wait()
                head = self._queue[0]
            if head.ready is not READY:
                head.ready.synchronize()  # the GIL is released while it waits
            with self._lock:
                writes = self._reserve(self._copied(head))
                self._in_flight = bool(writes)
            if not writes:
                continue
            errors = _write(writes)
            with self._lock:
                self._settle(writes, errors)
                self._in_flight = False
                self._queued.notify_all()

    def _copied(self, head: _Queued) -> List[_Queued]:
        """The queue's first blocks whose copy is done, taken off it (none if a take wrote `head` meanwhile)."""
        out = []
        if not self._queue or self._queue[0] is not head:
            return out
        while self._queue and (self._queue[0] is head or self._queue[0].ready is READY or
                               (self._queue[0].ready is not None and self._queue[0].ready.query())):
            out.append(self._queue.popleft())
        return out

    def _reserve(self, blocks: List[_Queued]) -> List[_Write]:
        """The writes of the blocks' rows, room reserved in each file (the lock held); rows of a save gone to
        memory (shared memory full) are appended there at once."""
        writes = []
        for q in blocks:
            data = None
            for key, lo, hi, step in q.parts:
                record = self._records.get(key)
                if record is None:
                    continue
                memory = record.saves.get(q.name)
                f = record.files.get(q.name)
                if memory is None and f is None:
                    try:
                        f = record.files[q.name] = RowFile(self.folder, key, q.name, tuple(q.host.shape[1:]),
                                                           q.host.dtype)
                    except OSError as e:
                        log.warning("fragments: %s: the rows of %s wait in memory: %s (%s)", key, q.name,
                                    self.folder, e)
                        memory = record.saves[q.name] = []
                if memory is not None:
                    memory.append((step, q.host[lo:hi], None, None))
                    continue
                try:
                    f.fits(q.host)
                except ValueError as e:
                    record.error = record.error or f"fragments plan of request {key}: {e}"
                    continue
                if data is None:
                    data = as_bytes(q.host)
                writes.append(_Write(f, f.reserve(hi - lo, step), data[lo:hi], record, key, q.name, step,
                                     q.host, lo, hi))
        return writes

    def _settle(self, writes: List[_Write], errors: list) -> None:
        """After a batch (the lock held): a save whose write was refused (shared memory full) goes on in memory
        from that write on, its file's earlier rows read back."""
        failed: Dict[int, list] = {}  # id(file) -> [why, its writes from the first refused one on, in order]
        for w, error in zip(writes, errors):
            if id(w.file) in failed:
                failed[id(w.file)][1].append(w)
            elif error:
                failed[id(w.file)] = [os.strerror(error) if isinstance(error, int) else error, [w]]
        for why, rest in failed.values():
            first = rest[0]
            if self._records.get(first.key) is not first.record or first.record.files.get(first.name) is not first.file:
                continue  # taken or dropped meanwhile
            log.warning("fragments: %s: the rows of %s wait in memory: writing %s failed (%s)", first.key,
                        first.name, first.file.path, why)
            first.file.cut(first.offset)
            blocks = first.file.blocks() if first.file.rows else []
            first.file.discard()
            del first.record.files[first.name]
            first.record.saves[first.name] = [(s, t, None, None) for s, t in blocks] + \
                [(w.step, w.rows, None, None) for w in rest]


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
        host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)  # torch's pinned cache: reused
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


def _write(writes: List[_Write]) -> list:
    """The batch's bytes into their files (_C.write_rows, the GIL released once): an errno or message per write."""
    if not writes:
        return []
    try:
        return _C.write_rows([w.file.path for w in writes], [w.offset for w in writes], [w.data for w in writes])
    except Exception as e:  # never lose the writer: the rows' saves go on in memory
        return [str(e)] * len(writes)
