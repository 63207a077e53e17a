"""A CUDA graph's slots: filled while vLLM captures the graph (`fill`), drained after each replay (`drain`),
a decode step's plain saves at every tapped location in one block (SlotDrain).

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

It serves a step only where that is all a step does: one rank's value is the whole (no collective: tp 1, or a
whole location), plain saves only (no edit, no indexed save, no Python step), rank 0 keeping rows that go to
files, a device whose copies run without waiting. Otherwise the worker acts location by location as before
(_worker.WorkerState._act). A SlotDrain is kept with the step's work (_steady.Steady) and made afresh with it.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

import torch

from . import _steady

ALIGN = 64  # each location's bytes start on a 64-byte boundary of the block (any dtype's view fits)
POOL = 8  # host blocks a drain keeps: steps whose rows the sink has not written yet, each holding one


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
    """One location's share: the rows read from its slot (a range or an index tensor), its bytes [lo, hi) of the
    block, their dtype and shape, its save groups, and `out`, its view of the device buffer."""
    __slots__ = ("location", "where", "count", "lo", "hi", "dtype", "shape", "groups", "out")

    def __init__(self, location, where, count, lo, hi, dtype, shape, groups):
        self.location, self.where, self.count, self.lo, self.hi = location, where, count, lo, hi
        self.dtype, self.shape, self.groups, self.out = dtype, shape, groups, None


class SlotDrain:
    """The step's gathers into one device buffer and one host copy of it (module docstring)."""
    __slots__ = ("parts", "device_block", "host_blocks")

    def __init__(self, parts: List[_Part], device, host_block: Callable[[int], torch.Tensor]):
        self.parts = parts
        total = parts[-1].hi if parts else 0
        self.device_block = torch.empty(total, dtype=torch.uint8, device=device)
        self.host_blocks = HostBlocks(lambda: host_block(total))
        for p in parts:
            p.out = self.device_block[p.lo:p.hi].view(p.dtype).view(p.shape)

    @staticmethod
    def of(slots: Dict[str, torch.Tensor], prepared: Dict[str, object], rules: Dict[str, object], copies) \
            -> Optional["SlotDrain"]:
        """The drain of `prepared` (location -> _steady.Prepared, every location with work this step, its value
        in `slots`), or None where a location needs more than a plain save of its rows as they are, or its copies
        would not run without waiting (`copies`: _rowqueue.HostCopies)."""
        parts, offset, device = [], 0, None
        for location, prep in prepared.items():
            slot = slots[location]
            if rules.get(location) is not None or prep.edits or prep.rest or not prep.saves or slot.dim() < 2 \
                    or not prep.rows or prep.rows[-1] >= slot.shape[0] or not copies.asynchronous(slot):
                return None
            device = slot.device
            shape = (len(prep.rows),) + tuple(slot.shape[1:])
            size = slot.element_size() * len(prep.rows) * slot[0].numel()
            parts.append(_Part(location, prep.where, len(prep.rows), offset, offset + size, slot.dtype, shape,
                               prep.saves))
            offset += -(-size // ALIGN) * ALIGN
        if not parts:
            return None
        return SlotDrain(parts, device, copies.host_block)

    def run(self, slots: Dict[str, torch.Tensor], store, copies) -> None:
        """Gathers every location's rows from its slot, copies the block to the host without waiting (`copies`:
        _rowqueue.HostCopies, sealed at the step's end) and hands each location's view to its save groups."""
        for p in self.parts:
            slot = slots[p.location]
            if isinstance(p.where, range):
                p.out.copy_(slot.narrow(0, p.where.start, p.count))
            else:
                torch.index_select(slot, 0, p.where, out=p.out)
        block = self.host_blocks.take()
        host = copies.copy(self.device_block) if block is None else copies.into(block, self.device_block)
        for p in self.parts:
            view = host[p.lo:p.hi].view(p.dtype).view(p.shape)
            for group in p.groups:
                group.add(store, view, True, p.location)


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
    holds (as the tap's body would have done in the forward); a steady decode step's plain saves in one block."""
    work = state._work()
    acting = {}
    for location in state.taps:
        if location not in state.slots:
            continue  # not in the compiled forward (the logits processor): its tap ran eagerly
        state.tap_calls[location] = state.tap_calls.get(location, 0) + 1
        if work.get(location):
            acting[location] = work[location]
    kept = _kept(state, acting)
    if kept is not None:
        t0 = time.perf_counter()
        kept.run(state.slots, state.saves, state.copies)
        state.host_s["act"] += time.perf_counter() - t0
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
                                              lambda rows, d=state.slots[loc].device: state._where(rows, d))
                        for loc, w in acting.items()}
            steady.drain = SlotDrain.of(state.slots, prepared, state.rules, state.copies) or False
    return steady.drain or None
