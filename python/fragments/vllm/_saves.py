"""Saves waiting in a vLLM worker for their caller, bounded in bytes, count and time (docs/vllm.md).

A request's saves are kept per key from the moment its plan first runs (`open`) and leave the store in one
of five ways, each once:
  take(key)        the caller fetches them: the server's answer, GET /v1/fragments/saves/{key},
                   fragments.vllm.take_saves; a second fetch is told they were taken
  drop(key, why)   the server gives them up (a client that disconnected mid-stream)
  expiry           not fetched FRAGMENTS_VLLM_SAVES_TTL seconds after the request finished
  eviction         a new save or request would pass FRAGMENTS_VLLM_SAVES_MAX_BYTES or
                   FRAGMENTS_VLLM_SAVES_MAX_REQUESTS: finished requests' saves go first, oldest first
A request whose saves would pass FRAGMENTS_VLLM_MAX_SAVE_BYTES keeps what it saved before (truncated, the
reason in its error). What left without being taken is remembered by key (a bounded list), so a later
fetch says why (the server answers 410) instead of looking like a request that saved nothing; each drop is
logged and counted by reason.

Rank 0 answers the caller; the other ranks' saves are equal copies nobody reads, so their stores keep
the bookkeeping (keys, errors) and no tensors (keep=False).

Where rows wait: with a `folder` (shared memory on the worker's machine), each save's rows go into a file of
their own as the steps run (_rowfile.RowFile), and the take seals those files instead of copying. The writing
is _C.RowSink's, on a thread of its own (_rowqueue.RowQueue); rows copied from a GPU without waiting are handed
to it once their step's CUDA event is done (`seal_step`, then `flush` at the next step). Without a folder, rows
wait in memory. While a decode batch repeats, the worker hands a location's block over as one `add_batch`
(a SaveBatch prepared once: the requests' files, rows and bytes), not request by request.
"""
from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections import Counter, OrderedDict
from typing import Callable, Dict, List, Optional

from . import _delivery
from ._rowfile import RowFile
from ._rowqueue import READY, RowQueue, SaveBatch

log = logging.getLogger("fragments.vllm")

# name -> (default, what it bounds); docs/vllm.md lists them beside the server's other settings
SETTINGS = {
    "FRAGMENTS_VLLM_MAX_SAVE_BYTES": (16 << 20, "bytes of tensors one request may save"),
    "FRAGMENTS_VLLM_SAVES_MAX_BYTES": (256 << 20, "bytes of saves the server holds for all requests"),
    "FRAGMENTS_VLLM_SAVES_MAX_REQUESTS": (1024, "requests whose saves the server holds"),
    "FRAGMENTS_VLLM_SAVES_TTL": (300, "seconds a finished request's saves wait to be fetched"),
}

# Drop reasons, the label of the saves-dropped counter (fragments:saves_dropped_total{reason})
EXPIRED, STORE_FULL, TOO_MANY, REQUEST_CAP, DISCONNECTED = \
    "expired", "store_full", "too_many_requests", "request_cap", "disconnected"


def setting(name: str) -> int:
    """A positive integer setting from the environment, or its default; ValueError in one line naming it."""
    default, what = SETTINGS[name]
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{name}={text!r}: expected a positive whole number ({what}; default {default})")
    return value


class _Record:
    __slots__ = ("saves", "files", "error", "bytes", "truncated")

    def __init__(self, error: Optional[str]):
        self.saves: Dict[str, list] = {}  # name -> [(step, host tensor, first row, row past the last)]
        self.files: Dict[str, RowFile] = {}  # name -> its rows in shared memory
        self.error, self.truncated, self.bytes = error, None, 0

    def discard(self) -> None:
        for f in self.files.values():
            f.discard()
        self.files.clear()


class SavesStore:
    """The saves of one worker's requests, by key (module docstring)."""

    def __init__(self, keep: bool = True, clock: Callable[[], float] = time.monotonic,
                 copy: Optional[Callable] = None, wait: Optional[Callable[[], None]] = None,
                 folder: Optional[str] = None):
        self.keep = keep
        self.folder = folder if keep else None  # where rows are written as the steps run (None: in memory)
        # how a kept save leaves the device (the worker's: a GPU value into pinned memory without waiting), and
        # what take waits for before the copies are read
        self._copy = copy or (lambda t: t.detach().to("cpu", copy=True))
        self._wait = wait
        self.request_bytes = setting("FRAGMENTS_VLLM_MAX_SAVE_BYTES")
        self.max_bytes = setting("FRAGMENTS_VLLM_SAVES_MAX_BYTES")
        self.max_requests = setting("FRAGMENTS_VLLM_SAVES_MAX_REQUESTS")
        self.ttl = setting("FRAGMENTS_VLLM_SAVES_TTL")
        self._clock = clock
        self._lock = threading.Lock()
        self._records: Dict[str, _Record] = {}
        # rows on their way to their files (None: rows wait in memory)
        self.rows = RowQueue(self.folder, self._records, wait) if self.folder else None
        self.generation = 0  # changes whenever a prepared SaveBatch may no longer hold (add_batch)
        self._finished: "OrderedDict[str, float]" = OrderedDict()  # key -> when it finished, oldest first
        self._gone: "OrderedDict[str, tuple]" = OrderedDict()  # key -> (status, why): taken or dropped
        self.bytes = 0
        self.dropped: Counter = Counter()  # reason -> requests whose saves were dropped or truncated
        self.dropped_bytes = 0

    # ---- what the worker's steps call ----------------------------------------------------------------
    def open(self, key: str, error: Optional[str] = None) -> None:
        """A request with a plan appeared (its first step). A key taken before starts afresh (fragments.vllm's
        callers may reuse keys); a dropped one stays dropped (a request aborted before it first ran)."""
        with self._lock:
            self._expire()
            if key in self._records or self._gone.get(key, ("",))[0] == "dropped":
                return
            self._gone.pop(key, None)
            if len(self._records) >= self.max_requests:
                self._evict(lambda: len(self._records) < self.max_requests, TOO_MANY)
            if len(self._records) >= self.max_requests:  # all held requests are running: this one keeps nothing
                self._forget(key, TOO_MANY, 0,
                             f"the server already holds the saves of {self.max_requests} running requests "
                             "(FRAGMENTS_VLLM_SAVES_MAX_REQUESTS)")
                return
            self._records[key] = _Record(error)
            self.generation += 1

    def add(self, key: str, name: str, tensor, copied: bool = False, step: int = 0) -> None:
        """One step's rows of a save (this rank's whole value); copied to the host when kept (`copied`: the
        tensor is that copy already). `step`: the request's step (0 = prefill), so that take can leave out
        steps whose tokens the request never had."""
        with self._lock:
            if not self._room(key, name, tensor.numel() * tensor.element_size()):
                return
            host = tensor if copied else self._copy(tensor)
            if self.folder is None:
                self._records[key].saves.setdefault(name, []).append((step, host, None, None))
                return
            rows = host if host.dim() > 0 else host.reshape(1)  # a scalar is a row of its own (stacked at take)
            self.rows.put(name, rows, [(key, 0, rows.shape[0], step)], None if tensor.is_cuda and not copied else READY)

    def add_rows(self, name: str, host, parts, pending: bool = False) -> None:
        """One step's rows of several requests' saves of `name`, all in `host` (one host copy for all): `parts`
        is [(key, first row, row past the last, step)]; `pending`: host's copy may still run (seal_step). In
        memory they are kept as (host, rows) and the views cut when taken, so a decode step costs a tuple per
        request here; in a folder they are written into each save's file once the copy is done."""
        row_bytes = _row_bytes(host)
        with self._lock:
            kept = [(key, lo, hi, step) for key, lo, hi, step in parts if self._room(key, name, (hi - lo) * row_bytes)]
            if not kept:
                return
            if self.folder is None or row_bytes == 0:
                for key, lo, hi, step in kept:
                    self._records[key].saves.setdefault(name, []).append((step, host, lo, hi))
                return
            self.rows.put(name, host, kept, None if pending else READY)

    def batch(self, name: str, host, parts) -> Optional[SaveBatch]:
        """The files of save `name` for `parts` [(key, first row, row past the last)] of blocks like `host`, made
        now where missing, for add_batch at this and later steps; None where a request's rows cannot go to a file
        (no folder, shared memory full, rows of another shape): add_rows serves those. Requests that keep
        nothing (taken, dropped, truncated) are left out."""
        row_bytes = _row_bytes(host)
        if self.rows is None or row_bytes == 0:
            return None
        keys, order, files, lo, hi = [], [], [], [], []
        with self._lock:
            for i, (key, a, b) in enumerate(parts):
                record = self._records.get(key)
                if record is None or record.truncated:
                    continue
                f = self.rows.file(record, key, name, host)
                if f is None:
                    return None
                keys.append(key)
                order.append(i)
                files.append(f.fid)
                lo.append(a)
                hi.append(b)
            return SaveBatch(name, keys, [self._records[k] for k in keys], None if len(order) == len(parts) else order,
                             files, lo, hi, row_bytes, self.generation)

    def add_batch(self, batch: SaveBatch, host, steps: List[List[int]], count: int, pending: bool = False) -> bool:
        """Blocks of `batch`'s requests, several steps' one after the other in `host` (`count` rows a step;
        `steps`: for each step, each request's step, in the batch's order of parts given to `batch`; only those it
        kept are read): one call to the sink. False, nothing kept, where the batch no longer holds or a request
        would pass a cap: add_rows then decides, request by request."""
        with self._lock:
            if batch.generation != self.generation:
                return False
            if not batch.keys:  # every request it was made for keeps nothing (truncated, say)
                return True
            n = len(steps)
            if self.bytes + n * batch.total > self.max_bytes:
                return False
            records = batch.records  # the same records while the generation holds
            if max(map(_bytes_of, records)) + n * batch.largest > self.request_bytes and \
                    any(r.bytes + n * size > self.request_bytes for r, size in zip(records, batch.bytes)):
                return False
            for r, size in zip(records, batch.bytes):
                r.bytes += n * size
            self.bytes += n * batch.total
            files, lo, hi = batch.layout(n, count)  # each file's parts in step order: the sink reserves its rows
            order = batch.order
            flat = [s for step in steps for s in step] if order is None else \
                [step[i] for step in steps for i in order]
            self.rows.put_files(host, files, lo, hi, flat, None if pending else READY)
        return True

    def seal_step(self, event) -> None:
        """The copies queued so far are done when `event` (recorded after them on the stream) is."""
        if self.rows is not None:
            self.rows.seal(event)

    def flush(self, wait: bool = False) -> None:
        """Queued rows whose copy is done go into their files (`wait`: all of them: RowQueue.flush)."""
        if self.rows is not None:
            self.rows.flush(wait)

    def _room(self, key: str, name: str, size: int) -> bool:
        """Whether `size` more bytes of `name` are kept for `key` (counted if so); a request past its cap, or a
        full store, is truncated with the reason."""
        record = self._records.get(key)
        if record is None:  # taken, dropped or never opened: a late step of an aborted request
            return False
        if not self.keep or record.truncated:
            return False
        if record.bytes + size > self.request_bytes:
            self._truncate(key, record, REQUEST_CAP,
                           f"saves truncated: {name} would bring them past {self.request_bytes} bytes "
                           "(FRAGMENTS_VLLM_MAX_SAVE_BYTES); the rows of later steps were not kept")
            return False
        if self.bytes + size > self.max_bytes:
            self._evict(lambda: self.bytes + size <= self.max_bytes, STORE_FULL, spare=key)
        if self.bytes + size > self.max_bytes:
            self._truncate(key, record, STORE_FULL,
                           f"saves truncated: the server's saves store is full ({self.max_bytes} bytes, "
                           "FRAGMENTS_VLLM_SAVES_MAX_BYTES); the rows of later steps were not kept")
            return False
        record.bytes += size
        self.bytes += size
        return True

    def fail(self, key: str, message: str) -> str:
        """A step of the request failed: the first failure is its error. Returns that error."""
        with self._lock:
            record = self._records.get(key)
            if record is None:
                return message
            record.error = record.error or message
            return record.error

    def finish(self, key: str) -> None:
        """The request finished in the engine (done or aborted): its saves now only wait for the caller."""
        with self._lock:
            record = self._records.get(key)
            if record is not None and key not in self._finished:
                self._finished[key] = self._clock()

    # ---- what the caller calls (RPC) -----------------------------------------------------------------
    def take(self, key: str, steps: Optional[int] = None, folder: Optional[str] = None) -> dict:
        """{"status": "ok" | "taken" | "dropped" | "unknown", "error", "data": safetensors bytes or None,
        "bytes": tensor bytes}, or the same safetensors as "files" in `folder` (shared memory on the caller's
        machine: _delivery.py; "data" may hold what is not in them). A key fetches its saves once. `steps`: the
        tokens the request produced (the front end's count, FinishedTokens): rows of later steps are left out.
        vLLM's async scheduling (its GPU default) runs a request one step past the token that ends it, and a
        stop string ends it after steps that already ran; those steps' tokens are discarded, and so are their
        rows here."""
        self.flush(wait=True)
        with self._lock:
            self._expire()
            record = self._pop(key)
            if record is None:
                status, why = self._gone.get(key, ("unknown", None))
                return {"status": status, "error": why, "data": None, "bytes": 0}
            if self._wait is not None and record.saves:
                self._wait()
            self._remember(key, "taken", f"the saves of {key} were already fetched (a key fetches its saves once)")
        answer = {"status": "ok", "error": "; ".join(filter(None, (record.error, record.truncated))) or None,
                  "data": None, "bytes": record.bytes}
        kept = _kept(record.saves, steps) if self.keep else {}
        files: List[str] = []
        try:
            same = folder is not None and self.folder is not None and \
                os.path.realpath(folder) == os.path.realpath(self.folder)
            for name, f in record.files.items():
                failed = f.failed()
                if failed is not None:  # shared memory was full: its later rows waited in the sink's memory
                    log.warning("fragments: %s: the rows of %s went on in memory: writing %s failed (%s)", key, name,
                                f.path, failed)
                if not same or failed is not None:  # the rows travel as bytes (or in the caller's folder)
                    rows = f.read(steps)
                    if rows is not None:
                        kept[name] = [rows]
                    continue
                try:
                    path = f.seal(steps)  # its header written: no row is copied
                except OSError as e:  # not expected: the header's page was allocated with the file
                    answer["error"] = "; ".join(filter(None, (answer["error"], f"save {name!r} lost: {e}")))
                    continue
                if path is not None:
                    files.append(path)
            path = _delivery.write(kept, folder, key) if kept and folder else None
            if path is not None:
                files.append(path)
            elif kept:
                answer["data"] = _serialize(kept)
        except BaseException:  # no answer goes out: no file of it stays behind
            _delivery.discard({"files": files})
            raise
        finally:
            record.discard()  # the files not sealed
        if files:
            answer["files"] = files
        return answer

    def drop(self, key: str, reason: str, why: str) -> None:
        """The server gives up the saves of `key` (e.g. its client disconnected); later steps keep nothing,
        also when the request has not run yet."""
        with self._lock:
            record = self._pop(key)
            if record is not None:
                record.discard()
            self._forget(key, reason, record.bytes if record is not None else 0, why)

    def stats(self) -> dict:
        with self._lock:
            self._expire()
            return {"requests": len(self._records), "running": len(self._records) - len(self._finished),
                    "bytes": self.bytes, "queued": len(self.rows or ()),
                    "files": sum(len(r.files) for r in self._records.values()),
                    "dropped": dict(self.dropped), "dropped_bytes": self.dropped_bytes,
                    "remembered": len(self._gone)}

    # ---- inside (the lock held) ----------------------------------------------------------------------
    def _pop(self, key: str) -> Optional[_Record]:
        record = self._records.pop(key, None)
        if record is not None:
            self.generation += 1
            self._finished.pop(key, None)
            self.bytes -= record.bytes
        return record

    def _expire(self) -> None:
        now = self._clock()
        while self._finished:
            key, finished = next(iter(self._finished.items()))
            if now - finished < self.ttl:
                break
            record = self._pop(key)
            record.discard()
            self._forget(key, EXPIRED, record.bytes,
                         f"the saves of {key} expired: not fetched within {self.ttl} s of the request's end "
                         "(FRAGMENTS_VLLM_SAVES_TTL)")

    def _evict(self, enough: Callable[[], bool], reason: str, spare: Optional[str] = None) -> None:
        """Drops finished requests' saves, oldest first, until enough() holds."""
        for key in [k for k in self._finished if k != spare]:
            if enough():
                return
            record = self._pop(key)
            record.discard()
            why = (f"the saves of {key} were dropped unfetched to make room: the server holds at most "
                   + (f"{self.max_bytes} bytes of saves (FRAGMENTS_VLLM_SAVES_MAX_BYTES)" if reason == STORE_FULL
                      else f"{self.max_requests} requests' saves (FRAGMENTS_VLLM_SAVES_MAX_REQUESTS)"))
            self._forget(key, reason, record.bytes, why)

    def _truncate(self, key: str, record: _Record, reason: str, why: str) -> None:
        record.truncated = why
        self.generation += 1
        self.dropped[reason] += 1
        if self.keep:
            log.warning("fragments: %s: %s", key, why)

    def _forget(self, key: str, reason: str, size: int, why: str) -> None:
        self.dropped[reason] += 1
        self.dropped_bytes += size
        self._remember(key, "dropped", why)
        if self.keep:
            log.warning("fragments: %s (%d bytes)", why, size)

    def _remember(self, key: str, status: str, why: str) -> None:
        self._gone[key] = (status, why)
        self._gone.move_to_end(key)
        while len(self._gone) > 4 * self.max_requests:
            self._gone.popitem(last=False)


_bytes_of = operator.attrgetter("bytes")


def _row_bytes(host) -> int:
    """Bytes of one row of a host block [n, ...] (0 for a scalar or no rows)."""
    return host[0].numel() * host.element_size() if host.dim() > 0 and host.shape[0] else 0


def _kept(saves: Dict[str, List], steps: Optional[int]) -> Dict[str, list]:
    """name -> its row blocks in step order, leaving out steps >= `steps` (SavesStore.take); names with none go."""
    kept = {name: [t if lo is None else t[lo:hi] for step, t, lo, hi in parts if steps is None or step < steps]
            for name, parts in saves.items()}
    return {name: parts for name, parts in kept.items() if parts}


def _serialize(kept: Dict[str, List]) -> bytes:
    """name -> its row blocks as one safetensors file in memory (rows concatenated; scalars stacked)."""
    import torch
    from safetensors.torch import save
    return save({name: torch.cat(parts, 0).contiguous() if parts[0].dim() > 0 else torch.stack(parts)
                 for name, parts in kept.items()})


class FinishedTokens:
    """The front end's count of each finished plan request's tokens, by key (the process that submits: LLM's,
    the OpenAI server's; _install wraps vLLM's OutputProcessor to fill it). Bounded: a count nobody takes
    (a request whose saves were dropped) leaves after `limit` newer ones."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._keys: Dict[str, str] = {}  # request id -> key, while the request runs
        self._tokens: "OrderedDict[str, int]" = OrderedDict()
        self._lock = threading.Lock()

    def started(self, request_id: str, key: str) -> None:
        with self._lock:
            self._keys[request_id] = key

    def finished(self, request_id: str, tokens: Optional[int]) -> None:
        with self._lock:
            key = self._keys.pop(request_id, None)
            if key is None or tokens is None:
                return
            self._tokens[key] = tokens
            while len(self._tokens) > self.limit:
                self._tokens.popitem(last=False)

    def aborted(self, request_id: str) -> None:
        with self._lock:
            self._keys.pop(request_id, None)

    def pop(self, key: str) -> Optional[int]:
        with self._lock:
            return self._tokens.pop(key, None)


finished_tokens = FinishedTokens()


def install_rpc() -> None:
    """Gives vLLM's workers `fragments_saves` (collective_rpc finds worker methods by name): "drop" gives up
    keys' saves (the server's disconnected streams), "stats" reports this rank's store and its live plans
    and hooks (the server's /metrics and the tests read them). Idempotent."""
    from vllm.v1.worker import worker_base

    def fragments_saves(self, op: str, keys=(), reason: str = DISCONNECTED, why: str = ""):
        from . import _worker
        state = _worker.current
        if state is None:
            return None
        if op == "drop":
            for key in keys:
                state.saves.drop(key, reason, why)
            return True
        if op == "stats":
            plans = getattr(state, "plans", {})
            return {"rank": state.rank, **state.saves.stats(),
                    "plans": sum(p is not None for p in plans.values()), "hooks": len(getattr(state, "hooks", ()))}
        raise ValueError(f"fragments_saves: unknown op {op!r}")
    worker_base.WorkerBase.fragments_saves = fragments_saves
