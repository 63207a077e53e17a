"""A CUDA graph's slots: filled while vLLM captures the graph (`fill`), drained after each replay (`drain`),
a steady decode's plain saves at every tapped location gathered on the device, STEPS steps to one block (SlotDrain).

A tap inside a captured graph cannot run the worker's Python at replay. So while vLLM captures, the tap's body
records a copy of its value into the location's slot (one buffer for every graph, as large as vLLM's largest);
every replay makes that copy, and after it the worker acts on the slots as the taps' bodies would have
(read-only plans only: a step that edits replays no graph, _runner.py's guard).

Why one block: after a FULL graph's replay with read-only plans, each tapped location's saving rows went their own way:
a gather, a pinned host block from torch's caching allocator and a copy each. On the H100's host (run36,
tools/probes/vllm_step_cost.py --profile) the pinned block alone cost ~21 us and the copy ~8 us, per location
and step, of a ~0.4 ms step's host work. Here every location's rows are gathered into one device buffer (one
index_select into it each: no allocation) and that buffer goes to the host in one pinned block with one copy;
each location's save groups get their view of the block, as they got their own block before (_steady.SaveGroup).
The host blocks are the drain's own (HostBlocks), reused once the sink has written a block's rows and nothing
else holds it: torch's caching host allocator then cost ~94 us a step for the one block (run36).

Why STEPS steps to a block: on the H100 (run37, vLLM's profiler) the decode step is the host's, the GPU idle 56% of
it, so every microsecond of the worker's shows in tokens/s; end_step took a median 365 us a step in the saving
column against 12 us without plans, of which the torch ops (the gathers, the copy, views) were ~130 us and the rest
Python: each location's save groups, the sink's puts, the block, the event. So a step now only gathers its rows into
its place in the device block; every STEPS steps (fewer where rows are wide: RING_BYTES)
the block goes to the host in one copy and each location's rows of all those steps go to the sink in one put
(_saves.SavesStore.add_batch over several steps). Steps gathered and not yet copied are `filled`; `settle` sends them
on before anything else could put rows or read saves: a new batch or plan (_worker._work), finished requests
(_worker._begin_step), a take (_worker.take_saves), a step the drain does not serve (`drain`).

Why one gather a step: an index_select per location was a Python call and a kernel launch each (4 of the ~130 us
of torch ops above, more with more locations); _C.gather_rows (runtime/row_gather.h) gathers every location's rows
in one call, on a GPU one kernel launch (row_gather_cuda.cu, where the build had nvcc). It reads the slots as
they were at `of` (a slot is one buffer, made at capture and written by every replay) and does not bound-check
rows on the GPU: `of` does, once.

It serves a step only where that is all a step does: one rank's value is the whole (no collective: tp 1, or a
whole location), plain saves only (no edit, no indexed save, no Python step), rank 0 keeping rows that go to
files, a device whose copies run without waiting. Otherwise the worker acts location by location as before
(_worker.WorkerState._act). A SlotDrain is kept with the step's work (_steady.Steady) and made afresh with it.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

import torch

from .. import _C
from . import _steady

ALIGN = 64  # each location's bytes start on a 64-byte boundary of the block (any dtype's view fits)
POOL = 4  # host blocks a drain keeps: blocks whose rows the sink has not written yet, STEPS steps each
STEPS = 8  # steps gathered on the device before one copy to the host and one put per location
RING_BYTES = 16 << 20  # a block's bytes at most: fewer steps to a block where a step's rows are wider


def _holders(block) -> int:
    """How many hold the block's memory: tensors (views in a request's rows kept in memory among them) and the
    sink's queued or spilled blocks (_C.RowSink keeps the storage)."""
    return torch._C._storage_Use_Count(block.untyped_storage()._cdata)


class HostBlocks:
    """The drain's host blocks, reused once nothing but the pool holds one: its rows written by the sink's
    thread (which the step's CUDA event gates: the copy into it is done), no view of it kept. Why: torch's
    caching host allocator took ~94 us a step for the one block (run36's profile on the H100's host)."""
    __slots__ = ("make", "blocks")

    def __init__(self, make: Callable[[], torch.Tensor]):
        self.make, self.blocks = make, []  # [(block, its holders when free)]

    def take(self) -> Optional[torch.Tensor]:
        """A free block (a new one while fewer than POOL are kept), or None: every one is still held."""
        for block, free in self.blocks:
            if _holders(block) == free:
                return block
        if len(self.blocks) < POOL:
            block = self.make()
            self.blocks.append((block, _holders(block)))
            return block
        return None


class _Part:
    """One location's share: the rows read from its slot (a range or an index tensor), `size` bytes a step, its
    bytes [lo, hi) of the block (`steps` steps: step j at lo + j * size), their dtype and one step's shape, and
    its save groups."""
    __slots__ = ("location", "where", "count", "size", "lo", "hi", "dtype", "shape", "groups")

    def __init__(self, location, where, count, size, lo, hi, dtype, shape, groups):
        self.location, self.where, self.count, self.size, self.lo, self.hi = location, where, count, size, lo, hi
        self.dtype, self.shape, self.groups = dtype, shape, groups


class SlotDrain:
    """A steady batch's gathers into one device block, STEPS steps of them, and one host copy of it (module
    docstring). `filled`: steps gathered since the last copy, `shifts`: their steps past the batch's first."""
    __slots__ = ("parts", "steps", "device_block", "host_blocks", "filled", "shifts", "srcs", "indices", "outs")

    def __init__(self, parts: List[_Part], steps: int, srcs: List[torch.Tensor],
                 host_block: Callable[[int], torch.Tensor]):
        self.parts, self.steps, self.filled, self.shifts = parts, steps, 0, []
        total = parts[-1].hi if parts else 0
        device = srcs[0].device
        self.device_block = torch.empty(total, dtype=torch.uint8, device=device)
        self.host_blocks = HostBlocks(lambda: host_block(total))
        # One gather a step for all locations (_C.gather_rows): each part's slot, its rows as an index on the
        # device (a range too: one kernel serves both), and step j's view of the block for each.
        self.srcs = srcs
        self.indices = [torch.arange(p.where.start, p.where.stop, device=device) if isinstance(p.where, range)
                        else p.where for p in parts]
        self.outs = [[self.device_block[p.lo + j * p.size:p.lo + (j + 1) * p.size].view(p.dtype).view(p.shape)
                      for p in parts] for j in range(steps)]

    @staticmethod
    def of(slots: Dict[str, torch.Tensor], prepared: Dict[str, object], rules: Dict[str, object], copies) \
            -> Optional["SlotDrain"]:
        """The drain of `prepared` (location -> _steady.Prepared, every location with work this step, its value
        in `slots`), or None where a location needs more than a plain save of its rows as they are, or its copies
        would not run without waiting (`copies`: _rowqueue.HostCopies)."""
        found = []
        for location, prep in prepared.items():
            slot = slots[location]
            if rules.get(location) is not None or prep.edits or prep.rest or not prep.saves or slot.dim() < 2 \
                    or not prep.count or prep.first < 0 or prep.last >= slot.shape[0] \
                    or not copies.asynchronous(slot):  # (rows in range: the GPU's gather does not check them)
                return None
            found.append((location, prep, slot, slot.element_size() * prep.count * slot[0].numel()))
        if not found:
            return None
        steps = max(1, min(STEPS, RING_BYTES // max(1, sum(size for *_, size in found))))
        parts, offset = [], 0
        for location, prep, slot, size in found:
            shape = (prep.count,) + tuple(slot.shape[1:])
            parts.append(_Part(location, prep.where, prep.count, size, offset, offset + steps * size, slot.dtype,
                               shape, prep.saves))
            offset += -(-(steps * size) // ALIGN) * ALIGN
        return SlotDrain(parts, steps, [slot for _, _, slot, _ in found], copies.host_block)

    def run(self, shift: int, store, copies) -> None:
        """Gathers every location's rows from its slot into this step's place in the device block (`shift`: the
        batch's steps so far, _steady.Steady.shift): one _C.gather_rows, on a GPU one kernel launch for every
        location; once STEPS steps are there, `flush`."""
        j = self.filled
        _C.gather_rows(self.srcs, self.indices, self.outs[j])
        self.shifts.append(shift)
        self.filled = j + 1
        if self.filled == self.steps:
            self.flush(store, copies)

    def flush(self, store, copies) -> None:
        """The steps gathered so far to the host without waiting (`copies`: _rowqueue.HostCopies, sealed at the
        step's end; one copy of the block when full, each location's filled bytes otherwise) and each location's
        rows of all of them to its save groups, one put each."""
        n, shifts = self.filled, self.shifts
        if not n:
            return
        self.filled, self.shifts = 0, []
        block = self.host_blocks.take()
        if n == self.steps:
            host = copies.copy(self.device_block) if block is None else copies.into(block, self.device_block)
        else:
            host = copies.host_block(self.device_block.numel()) if block is None else block
            for p in self.parts:
                copies.into(host[p.lo:p.lo + n * p.size], self.device_block[p.lo:p.lo + n * p.size])
        for p in self.parts:
            view = host[p.lo:p.lo + n * p.size].view(p.dtype).view((n * p.count,) + p.shape[1:])
            for group in p.groups:
                group.add_steps(store, view, shifts, p.count, p.location)


def settle(state) -> None:
    """Steps a drain gathered and has not copied yet (`state.draining`) go on to their saves now: before rows of
    another kind could reach the same files, or saves be read (module docstring)."""
    kept, state.draining = state.draining, None
    if kept is not None:
        t0 = time.perf_counter()
        kept.flush(state.saves, state.copies)
        state.host_s["drain"] += time.perf_counter() - t0


def fill(state, location: str, x) -> None:
    """In a graph being captured: x copied into the location's slot (state.slots; one buffer for every graph, as
    large as the largest vLLM captures; a graph uses its first rows). `state`: the worker's WorkerState."""
    x = state._token_rows(x)  # [tokens, ...]: a graph's size is its token count
    slot = state.slots.get(location)
    if slot is None:
        largest = getattr(state.runner.vllm_config.compilation_config, "max_cudagraph_capture_size", None) or 0
        slot = state.slots[location] = x.new_empty((max(largest, x.shape[0]),) + tuple(x.shape[1:]))
    elif slot.shape[0] < x.shape[0] or slot.shape[1:] != x.shape[1:] or slot.dtype != x.dtype:
        raise RuntimeError(f"fragments: a CUDA graph captured at {location} with a value of {tuple(x.shape)} "
                           f"{x.dtype}, its slot {tuple(slot.shape)} {slot.dtype} (made for vLLM's largest "
                           "graph): one slot cannot serve both; start the engine with compilation_config "
                           '{"cudagraph_mode": "NONE"} or enforce_eager=True')
    slot[:x.shape[0]].copy_(x)


def drain(state) -> None:
    """After a graph's replay with read-only plans in the step: each tapped location's work on the value its slot
    holds (as the tap's body would have done in the forward); a steady decode step's plain saves gathered into the
    drain's device block (SlotDrain.run)."""
    work = state._work()
    acting = {}
    for location in state.taps:
        if location not in state.slots:
            continue  # not in the compiled forward (the logits processor): its tap ran eagerly
        state.tap_calls[location] = state.tap_calls.get(location, 0) + 1
        if work.get(location):
            acting[location] = work[location]
    kept = _kept(state, acting)
    if state.draining is not None and state.draining is not kept:
        settle(state)
    if kept is not None:
        t0 = time.perf_counter()
        kept.run(state.steady.shift[0], state.saves, state.copies)
        state.draining = kept if kept.filled else None
        state.host_s["drain"] += time.perf_counter() - t0
        return
    for location, located in acting.items():
        state._act(location, state._token_rows(state.slots[location]), located)


def _kept(state, acting) -> Optional[SlotDrain]:
    """The step's SlotDrain, kept with a steady batch's work (worked out at its first step); None where it does not
    serve (a new batch, a gather or an edit at a location, rows not kept in files on rank 0)."""
    steady = state.steady
    if not acting or steady is None or steady.work is not state.step_work:
        return None
    if steady.drain is None:
        steady.drain = False
        if state.saves.keep and state.saves.folder:
            prepared = {loc: _steady.prepared(steady, state.step_work, loc, w,
                                              lambda spans, d=state.slots[loc].device: state._where(spans, d))
                        for loc, w in acting.items()}
            steady.drain = SlotDrain.of(state.slots, prepared, state.rules, state.copies) or False
    return steady.drain or None
