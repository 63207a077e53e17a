"""fragments/vllm/_drain.py through the worker, without vLLM or a GPU: a decode step's plain saves at every tapped
location leave the slots in one block (copies made as on a GPU: a block per copy, rows released once the step's
event is done) and save what the location-by-location way saves, row for row and step for step, for locations of
different widths and dtypes (each location's bytes aligned in the block); where a step edits, or a location's
copy would wait, the location-by-location way serves. States as test_steady.py makes them.

    PYTHONPATH=python python tests/python/vllm_plugin/test_drain.py
"""
import shutil
import tempfile
import unittest

import torch

import test_steady as ts
from fragments.vllm import _delivery, _drain, _plan, _rowqueue

WIDTHS = {"a.output": (3, torch.float32), "b.input": (5, torch.bfloat16), "c.output": (7, torch.float16)}


class _Done:
    def query(self):
        return True

    def synchronize(self):
        pass


class _NotDone(_Done):
    """A step's event the device has not reached: its blocks stay unreleased until a take waits."""

    def query(self):
        return False


class _CopiesAsGpu(_rowqueue.HostCopies):
    """HostCopies as on a GPU, on the CPU: every copy a block of its own or into a kept one, asynchronous, sealed
    at the step's end (`event`: what the step's event answers)."""

    def __init__(self, device):
        super().__init__(device)
        self.blocks = self.intos = 0
        self.event = _Done

    @staticmethod
    def asynchronous(part):
        return True

    def copy(self, part):
        self.stream = True
        self.blocks += 1
        return part.detach().clone()

    def into(self, host, part):
        self.stream = True
        self.blocks += 1
        self.intos += 1
        return host.copy_(part)

    def seal(self, store):
        if self.stream is not None:
            store.seal_step(self.event())
            self.stream = None

    def wait(self):
        pass


def state(folder, as_gpu, plans=None):
    view = ts._View(["r0", "r1", "r2", "r3", "r4"], [4, 6, 4, 9, 5])
    plans = plans or {"r0": [("a.output", "all"), ("b.input", "all"), ("c.output", "all")], "r1": None,
                      "r2": [("a.output", "decode"), ("c.output", "all")], "r3": None, "r4": [("b.input", "all")]}
    s = ts.state(folder, view, plans)
    s.taps = list(WIDTHS)
    if as_gpu:
        s.copies = _CopiesAsGpu(torch.device("cpu"))
        s.saves._copy, s.saves._wait = s.copies.copy, s.copies.wait
        s.saves.rows._wait = s.copies.wait
    return s


def step(s, number):
    """One decode step: each slot as large as a graph's (more rows than the batch), its values naming the step."""
    for at, (w, dtype) in WIDTHS.items():
        s.slots[at] = (torch.arange(8 * w, dtype=torch.float32).view(8, w) + 100.0 * number).to(dtype)
    s.step_work = None
    s.saves.flush()
    s._drain_slots()
    s.copies.seal(s.saves)
    s.view.computed += 1


class SlotDrainTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="drain-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def run_steps(self, as_gpu, steps=5, plans=None):
        s = state(self.dir, as_gpu, plans)
        for n in range(steps):
            step(s, n)
        return s

    def test_one_block_per_step_saves_as_location_by_location(self):
        s = self.run_steps(as_gpu=True)
        self.assertIsInstance(s.steady.drain, _drain.SlotDrain)
        self.assertEqual(s.copies.blocks, 5)  # one block a step for the three locations
        self.assertTrue(all(p.lo % _drain.ALIGN == 0 for p in s.steady.drain.parts))
        t = self.run_steps(as_gpu=False)  # the CPU's way: location by location
        self.assertIsNone(t.steady.drain or None)
        got, expected = ts.taken(s), ts.taken(t)
        self.assertEqual(got.keys(), expected.keys())
        for key in expected:
            self.assertEqual(got[key].keys(), expected[key].keys())
            for name in expected[key]:
                self.assertEqual(got[key][name].dtype, expected[key][name].dtype)
                self.assertTrue(torch.equal(got[key][name], expected[key][name]), (key, name))
        # r2 (row 2) at c.output: its row at every step, in c's dtype
        w = WIDTHS["c.output"][0]
        self.assertEqual(got["k-r2"]["c.output"][:, 0].tolist(), [2.0 * w + 100.0 * n for n in range(5)])

    def test_a_written_block_is_reused(self):
        """With the sink's writes done between steps, one host block serves every step, and what was saved is
        what the CPU's way saves (a block reused too early would have its rows overwritten)."""
        s = state(self.dir, True)
        for n in range(12):
            step(s, n)
            s.saves.flush(wait=True)
        self.assertEqual((len(s.steady.drain.host_blocks.blocks), s.copies.intos), (1, 12))
        t = self.run_steps(as_gpu=False, steps=12)
        got, expected = ts.taken(s), ts.taken(t)
        for key in expected:
            for name in expected[key]:
                self.assertTrue(torch.equal(got[key][name], expected[key][name]), (key, name))

    def test_a_held_block_is_never_reused(self):
        """Blocks whose rows the sink has not written (their step's event not done) stay theirs: the pool grows to
        POOL blocks, then steps copy into blocks of their own; every row comes back right."""
        s = state(self.dir, True)
        s.copies.event = _NotDone
        steps = _drain.POOL + 3
        for n in range(steps):
            step(s, n)
        self.assertEqual(len(s.steady.drain.host_blocks.blocks), _drain.POOL)
        self.assertEqual((s.copies.intos, s.copies.blocks), (_drain.POOL, steps))
        got = ts.taken(s)
        w = WIDTHS["a.output"][0]
        self.assertEqual(got["k-r2"]["a.output"][:, 0].tolist(), [2.0 * w + 100.0 * n for n in range(steps)])

    def test_an_edit_at_a_location_is_served_location_by_location(self):
        s = state(self.dir, True, {"r0": [("a.output", "all")], "r1": [("b.input", "all")]})
        zero = _plan.Scheduled(_ZeroStep("b.input"), "all", False)
        s.plans["r1"] = _plan.RequestPlan("k-r1", [zero], None)
        for n in range(3):
            step(s, n)
        self.assertIs(s.steady.drain, False)
        self.assertEqual(s.copies.blocks, 3)  # r0's save: one location, its own block, as before
        self.assertEqual(ts.taken(s)["k-r0"]["a.output"][:, 0].tolist(), [0.0, 100.0, 200.0])


class _ZeroStep:
    def __init__(self, at):
        self.at, self.do, self.as_, self.index, self.value, self.by = at, "zero", None, None, None, None


if __name__ == "__main__":
    unittest.main()
