"""A decode batch that repeats from step to step: its work, and each location's rows and saves, worked out once.

Why: while vLLM decodes the same requests step after step (one token each, each one step further), a step's
work is the last one's with every request's step one more. Worked out afresh it cost, for 64 requests of which
16 save 4 locations, 0.28 ms of Python per step (the runner's rows, every plan step of every row) and as much
again for each location's rows, positions and saving requests (tools/probes/vllm_step_cost.py --as-gpu),
beside a plain GPU decode step of 2.6 ms. The worker (_worker.WorkerState._work) works a step out as before
whenever its batch is new, and keeps it here while the runner's batch follows on from it (`Steady.follows`:
a few array comparisons); each location's `Prepared` share is made at its first visit and kept as long.
"""
from __future__ import annotations

import bisect
import logging
from typing import Dict, List, Optional

import numpy as np

log = logging.getLogger("fragments.vllm")


class Work:
    """One plan step acting on one request's rows [start, stop) at one location in this forward; the request's
    step is `base` plus the batch's `shift` (Steady: how many steps it has followed on)."""
    __slots__ = ("key", "start", "stop", "step", "base", "shift")

    def __init__(self, key, start, stop, step, base, shift):
        self.key, self.start, self.stop, self.step, self.base, self.shift = key, start, stop, step, base, shift

    @property
    def at_step(self) -> int:
        return self.base + self.shift[0]


class SaveGroup:
    """One save name's read-only work at a location: its requests' rows of the location's block (`parts`, in the
    order of `work`) and the store's SaveBatch for them (made at the first step, None until then)."""
    __slots__ = ("name", "work", "parts", "batch")

    def __init__(self, name: str):
        self.name, self.work, self.parts, self.batch = name, [], [], None

    def add(self, store, host, pending: bool, location: str) -> None:
        """One step's rows of `host` (this step's: the work's shift now) into `store` (_saves.SavesStore)."""
        self.add_steps(store, host, [self.work[0].shift[0]], host.shape[0], location, pending)

    def add_steps(self, store, host, shifts: List[int], count: int, location: str, pending: bool = True) -> None:
        """The group's rows of several steps of a steady batch into `store`: `host` holds `count` rows a step, the
        steps' blocks one after the other, `shifts` their steps past the batch's first (_drain.SlotDrain). Rank 0's
        work alone: should it fail, the requests' saves say so and their work goes on, alike on every rank (no
        collective is left half-issued)."""
        try:
            self._add(store, host, shifts, count, pending)
        except Exception as e:
            log.exception("fragments: saving %s at %s failed", self.name, location)
            for w in self.work:
                store.fail(w.key, f"fragments plan of request {w.key}: saving {self.name} at {location} failed at "
                           f"step {w.base + shifts[-1]}: {type(e).__name__}: {e}")

    def _add(self, store, host, shifts: List[int], count: int, pending: bool) -> None:
        """One call with the SaveBatch (made at the first step, again when the store's requests changed); step by
        step and request by request where it cannot serve."""
        steps = [[w.base + shift for w in self.work] for shift in shifts]
        if self.batch is not None and store.add_batch(self.batch, host, steps, count, pending):
            return
        self.batch = store.batch(self.name, host[:count], self.parts)  # None where the store cannot batch
        if self.batch is not None and store.add_batch(self.batch, host, steps, count, pending):
            return
        for j, step in enumerate(steps):
            store.add_rows(self.name, host[j * count:(j + 1) * count],
                           [(k, a, b, st) for (k, a, b), st in zip(self.parts, step)], pending)


class Prepared:
    """A location's share of a step's work: the rows it reads, as `spans` (sorted disjoint [start, stop) of the
    forward's rows: a request's rows are one span) and `where` (a range or an index tensor), `count` rows from
    `first` to `last`, whether any step edits, the save groups (plain saves, served from one host block) and the
    rest (indexed saves, edits, Python steps), each run as before. Why spans, not a list of rows: a prefill's
    requests hold thousands of rows each (run39's profile: a set and a dict of 2048 rows cost 0.28 ms a location)."""
    __slots__ = ("spans", "offsets", "count", "first", "last", "where", "edits", "saves", "rest")

    def __init__(self, work: List[Work], where_of):
        self.spans = _merged(sorted({(w.start, w.stop) for w in work if w.stop > w.start}))
        self.offsets, n = [], 0  # each span's first position in the block
        for a, b in self.spans:
            self.offsets.append(n)
            n += b - a
        self.count = n
        self.first = self.spans[0][0] if self.spans else 0
        self.last = self.spans[-1][1] - 1 if self.spans else -1
        self.where = where_of(self.spans)
        self.edits = any(w.step.do != "save" for w in work)
        groups: Dict[str, SaveGroup] = {}
        self.rest: List[Work] = []
        for w in work:
            if w.step.do == "save" and not w.step.index:
                g = groups.get(w.step.as_)
                if g is None:
                    g = groups[w.step.as_] = SaveGroup(w.step.as_)
                g.work.append(w)
                g.parts.append((w.key,) + self.block_rows(w))
            else:
                self.rest.append(w)
        self.saves = list(groups.values())

    def block_rows(self, w: Work) -> tuple:
        """(first, past the last) of `w`'s rows in the block: its rows lie in one span."""
        k = bisect.bisect_right(self.spans, (w.start, float("inf"))) - 1
        a = self.offsets[k] + w.start - self.spans[k][0]
        return a, a + (w.stop - w.start)


def _merged(spans: List[tuple]) -> List[tuple]:
    """Sorted [start, stop) spans with overlapping or touching ones joined (a request's rows, seen by several
    steps, are one span; neighbouring requests' rows one span: a range where the whole batch saves)."""
    out: List[list] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(x) for x in out]


class Steady:
    """A step's work kept while the runner's batch follows on from it: the same requests in the same places,
    one token each, each one step further, and no plan step whose schedule (a set of steps) turns on or off."""
    __slots__ = ("req_ids", "qsl", "planned", "computed", "first", "work", "shift", "variable", "prepared", "drain")

    def __init__(self, req_ids, qsl, planned, computed, work, shift, variable):
        """`qsl`, `computed`: the arrays' bytes at the kept step; `first`: the first planned request's count."""
        self.req_ids, self.qsl, self.planned, self.computed = req_ids, qsl.tobytes(), planned, computed.tobytes()
        self.first = int(computed[0]) if len(computed) else 0
        self.work, self.shift, self.variable = work, shift, variable
        self.prepared: Dict[str, Prepared] = {}
        self.drain = None  # _drain.SlotDrain of a FULL graph's slots, or False where none serves (worked out once)

    @staticmethod
    def of(batch, planned: List[int], work, shift: list, variable: list) -> Optional["Steady"]:
        """`batch`: the runner's (request ids, query start offsets, tokens computed) at the step `work` was worked
        out for; `planned`: the batch indices of requests with a plan; `variable`: [(a scheduled plan step whose
        steps are a set, its request's step now, whether it runs now)]. None unless every request decodes."""
        if batch is None:
            return None
        req_ids, qsl, computed = batch
        if len(req_ids) == 0 or not np.all(np.diff(qsl) == 1):
            return None  # a prefill (or a chunk of one) in the batch: its next step differs
        ix = np.asarray(planned, dtype=np.int64)
        return Steady(list(req_ids), qsl, ix, computed[ix], work, shift, variable)

    def follows(self, batch) -> bool:
        """Whether this step's batch is the kept one advanced: then `shift` says by how many steps."""
        if batch is None:
            return False
        req_ids, qsl, computed = batch
        if not isinstance(req_ids, list):
            req_ids = list(req_ids)
        if req_ids != self.req_ids or qsl.tobytes() != self.qsl:  # bytes: a few times cheaper than numpy's
            return False
        if len(self.planned):
            now = computed[self.planned]
            d = int(now[0]) - self.first
            if d <= 0 or (now - d).tobytes() != self.computed:  # every planned request one step further
                return False
        else:
            d = self.shift[0] + 1
        if any(s.runs_at(base + d) != ran for s, base, ran in self.variable):
            return False
        self.shift[0] = d
        return True


def prepared(steady: Optional[Steady], step_work, location: str, work: List[Work], where_of) -> Prepared:
    """The location's share of this step's work: kept in `steady` while this step's work is its own."""
    if steady is None or steady.work is not step_work:
        return Prepared(work, where_of)
    prep = steady.prepared.get(location)
    if prep is None:
        prep = steady.prepared[location] = Prepared(work, where_of)
    return prep
