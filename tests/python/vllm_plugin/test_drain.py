"""fragments/vllm/_drain.py through the worker, without vLLM or a GPU: a steady decode's plain saves at every tapped
location are gathered on the device, STEPS steps to a block, which goes to the host in one copy and to the sink in
one put per location (copies made as on a GPU: asynchronous, rows released once the step's event is done); they
save what the location-by-location way saves, row for row and step for step, for locations of different widths and
dtypes (each location's bytes aligned in the block), also where steps wait in the block when the batch changes, a
request finishes or a take comes; where a step edits, the location-by-location way serves. States as test_steady.py
makes them.

    PYTHONPATH=python python tests/python/vllm_plugin/test_drain.py
"""
import shutil
import tempfile
import types
import unittest
from unittest import mock

import numpy as np
import torch

import test_steady as ts
from fragments.vllm import _delivery, _drain, _plan, _rowqueue

WIDTHS = {"a.output": (3, torch.float32), "b.input": (5, torch.bfloat16), "c.output": (7, torch.float16)}


class _NotDone(_rowqueue.DoneEvent):
    """A step's event the device has not reached: its blocks stay unreleased until a take waits."""

    def query(self):
        return False


def state(folder, as_gpu, plans=None):
    view = ts._View(["r0", "r1", "r2", "r3", "r4"], [4, 6, 4, 9, 5])
    plans = plans or {"r0": [("a.output", "all"), ("b.input", "all"), ("c.output", "all")], "r1": None,
                      "r2": [("a.output", "decode"), ("c.output", "all")], "r3": None, "r4": [("b.input", "all")]}
    s = ts.state(folder, view, plans)
    s.taps = list(WIDTHS)
    if as_gpu:
        _rowqueue.SimulatedDeviceCopies().attach(s)
    return s


def step(s, number):
    """One decode step: each slot as large as a graph's (more rows than the batch), its values naming the step,
    written into the slot's buffer as a graph's replay does (a slot is made once, at capture)."""
    for at, (w, dtype) in WIDTHS.items():
        value = (torch.arange(8 * w, dtype=torch.float32).view(8, w) + 100.0 * number).to(dtype)
        if at in s.slots:
            s.slots[at].copy_(value)
        else:
            s.slots[at] = value
    s.step_work = None
    s.saves.flush()
    s._drain_slots()
    s.copies.seal(s.saves)
    s.view.computed += 1


def same_saves(test, got, expected):
    test.assertEqual(got.keys(), expected.keys())
    for key in expected:
        test.assertEqual(got[key].keys(), expected[key].keys())
        for name in expected[key]:
            test.assertEqual(got[key][name].dtype, expected[key][name].dtype)
            test.assertTrue(torch.equal(got[key][name], expected[key][name]), (key, name))


class SlotDrainTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="drain-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def run_steps(self, as_gpu, steps=5, plans=None):
        s = state(self.dir, as_gpu, plans)
        for n in range(steps):
            step(s, n)
        return s

    def test_steps_wait_on_the_device_then_save_as_location_by_location(self):
        """Fewer steps than STEPS: nothing is copied until the take, which sends the gathered steps on (one copy
        per location, of its filled steps) and reads what the CPU's location-by-location way saves."""
        s = self.run_steps(as_gpu=True)
        drain = s.steady.drain
        self.assertIsInstance(drain, _drain.SlotDrain)
        self.assertEqual((drain.steps, drain.filled, s.copies.blocks), (_drain.STEPS, 5, 0))
        self.assertIs(s.draining, drain)
        self.assertTrue(all(p.lo % _drain.ALIGN == 0 for p in drain.parts))
        t = self.run_steps(as_gpu=False)  # the CPU's way: location by location
        self.assertIsNone(t.steady.drain or None)
        # the worker's host seconds name the way each step went (compile_stats' host_s; the benchmark's detail)
        self.assertGreater(s.host_s["drain"], 0.0)
        self.assertEqual((t.host_s["drain"], s.host_s["act"] > 0, t.host_s["act"] > 0), (0.0, False, True))
        got = ts.taken(s)
        self.assertEqual((s.copies.intos, drain.filled, s.draining), (3, 0, None))
        same_saves(self, got, ts.taken(t))
        # r2 (row 2) at c.output: its row at every step, in c's dtype
        w = WIDTHS["c.output"][0]
        self.assertEqual(got["k-r2"]["c.output"][:, 0].tolist(), [2.0 * w + 100.0 * n for n in range(5)])

    def test_a_full_block_is_one_copy_and_one_put_per_location(self):
        with mock.patch.object(_drain, "STEPS", 4):
            s = self.run_steps(as_gpu=True, steps=10)
        self.assertEqual((s.copies.intos, s.saves.rows.sink.last), (2, 6))  # 2 blocks of 4 steps, 3 puts each
        got = ts.taken(s)  # the last 2 steps: a copy and a put per location
        self.assertEqual((s.copies.intos, s.saves.rows.sink.last), (5, 9))
        t = self.run_steps(as_gpu=False, steps=10)
        self.assertEqual(t.saves.rows.sink.last, 30)  # location by location: a put per location and step
        same_saves(self, got, ts.taken(t))

    def test_wide_rows_take_fewer_steps_to_a_block(self):
        with mock.patch.object(_drain, "RING_BYTES", 150):  # a step's rows: 24 + 20 + 28 bytes
            s = self.run_steps(as_gpu=True, steps=1)
        self.assertEqual(s.steady.drain.steps, 2)

    def test_a_joining_request_and_a_finished_one_send_the_waiting_steps_first(self):
        """Steps waiting in the block go to their files before rows of another kind could: a request joining
        the batch (its work worked out afresh), a request finishing (vLLM's next step names it). Every request's
        rows come back in step order, as the CPU's way."""
        def run(as_gpu):
            s = state(self.dir, as_gpu)
            for n in range(3):
                step(s, n)
            if as_gpu:
                self.assertEqual(s.draining.filled, 3)
            s.view.req_ids.append("r5")  # a request joins, decoding
            s.view.qsl = np.arange(len(s.view.req_ids) + 1, dtype=np.int32)
            s.view.computed = np.append(s.view.computed, 7).astype(np.int32)
            s.plans["r5"] = _plan.RequestPlan("k-r5", [_plan.Scheduled(ts._Save("a.output"), "all", False)], None)
            s.saves.open("k-r5")
            s.steady = None
            for n in range(3, 6):
                step(s, n)
            if as_gpu:  # the joining step sent steps 0-2 on; steps 3-5 wait
                self.assertEqual((s.copies.intos, s.draining.filled), (3, 3))
            s.compiled, s.hooks, s._failed, s.py_forward, s.forwards = True, {}, False, 0, 0
            s._begin_step(types.SimpleNamespace(finished_req_ids={"r2"}, scheduled_new_reqs=[],
                                                num_scheduled_tokens=dict.fromkeys(s.view.req_ids, 1)))
            if as_gpu:
                self.assertIsNone(s.draining)  # r2's last steps went on before its saves were finished
            return s
        s, t = run(True), run(False)
        got, expected = ts.taken(s), ts.taken(t)
        same_saves(self, got, expected)
        self.assertEqual(got["k-r5"]["a.output"][:, 0].tolist(),
                         [5.0 * WIDTHS["a.output"][0] + 100.0 * n for n in range(3, 6)])
        self.assertEqual(got["k-r0"]["b.input"].shape[0], 6)

    def test_a_prefill_step_served_by_the_taps_bodies_sends_the_waiting_steps_first(self):
        """A step vLLM runs without a FULL graph (a prefill joins: PIECEWISE) is served in the forward by the
        taps' bodies, location by location: the steps waiting in the drain's block reach the files before it."""
        def run(as_gpu):
            s = state(self.dir, as_gpu)
            for n in range(3):
                step(s, n)
            s.view.req_ids.append("r5")  # a prefill of 3 tokens joins: rows 5-7
            s.view.qsl = np.array([0, 1, 2, 3, 4, 5, 8], dtype=np.int32)
            s.view.computed = np.append(s.view.computed, 0).astype(np.int32)
            s.plans["r5"] = None
            s.step_work = None
            for at, (w, dtype) in WIDTHS.items():
                s.tap_body(at, (torch.arange(8 * w, dtype=torch.float32).view(8, w) + 300.0).to(dtype))
            if as_gpu:
                self.assertIsNone(s.draining)
            s.copies.seal(s.saves)
            return s
        same_saves(self, ts.taken(run(True)), ts.taken(run(False)))

    def test_a_written_block_is_reused(self):
        """With the sink's writes done between blocks, one host block serves every one, and what was saved is
        what the CPU's way saves (a block reused too early would have its rows overwritten)."""
        with mock.patch.object(_drain, "STEPS", 2):
            s = state(self.dir, True)
            for n in range(12):
                step(s, n)
                s.saves.flush(wait=True)
        self.assertEqual((len(s.steady.drain.host_blocks.blocks), s.copies.intos), (1, 6))
        same_saves(self, ts.taken(s), ts.taken(self.run_steps(as_gpu=False, steps=12)))

    def test_a_held_block_is_never_reused(self):
        """Blocks whose rows the sink has not written (their step's event not done) stay theirs: the pool grows to
        POOL blocks, then steps copy into blocks of their own; every row comes back right."""
        with mock.patch.object(_drain, "STEPS", 1):
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
