"""fragments/vllm/_steady.py through the worker, without vLLM: a decode batch that repeats keeps its work and each
location's prepared share from step to step (the runner's batch checked in a few array comparisons), and what it
saves is what working every step out afresh saves, row for row and step for step; a batch that changes (a
request more, a prefill, a request that did not advance, a plan step whose set of steps begins or ends) is
worked out afresh at that step. WorkerState's methods on a state made as tools/probes/vllm_step_cost.py makes it.

    PYTHONPATH=python python tests/python/vllm_plugin/test_steady.py
"""
import collections
import shutil
import tempfile
import unittest

import numpy as np
import torch

from fragments.vllm import _delivery, _durations, _plan, _rowqueue, _runner, _saves, _steady, _worker

WIDTHS = {"a.output": 3, "b.input": 5}


class _Save:
    def __init__(self, at, as_=None):
        self.at, self.do, self.as_, self.index, self.value, self.by = at, "save", as_ or at, None, None, None


class _View:
    """The runner's batch, its arrays changed in place as vLLM's are."""

    def __init__(self, req_ids, computed, prompt=4):
        self.req_ids, self.prompt, self.graph = list(req_ids), prompt, "FULL"
        self.qsl = np.arange(len(req_ids) + 1, dtype=np.int32)
        self.computed = np.array(computed, dtype=np.int32)

    def rows(self):
        return [_runner.Row(r, i, int(self.qsl[i]), int(self.qsl[i + 1]), int(self.computed[i]), self.prompt)
                for i, r in enumerate(self.req_ids)]

    def batch_arrays(self):
        return self.req_ids, self.qsl, self.computed

    def sampling_params(self, req_id):
        return None

    def begin_step(self):
        pass


def state(folder, view, plans):
    """A worker state whose taps' values sit in slots (a FULL graph's), `plans`: req id -> [(location, steps)]."""
    s = _worker.WorkerState.__new__(_worker.WorkerState)
    s.view, s.device, s.rank, s.pp, s.stage, s.stage_of = view, torch.device("cpu"), 0, None, 0, {}
    s.fragmented, s.rules, s.leading_batch, s.copies = {}, {}, False, _rowqueue.HostCopies(torch.device("cpu"))
    s.saves = _saves.SavesStore(copy=s.copies.copy, wait=s.copies.wait, folder=folder)
    s.answers, s.plans, s.last_rows, s.steady, s.draining = _delivery.Folder(), {}, (None, None), None, None
    s.live_plans = None
    for req, steps in plans.items():
        if steps is None:
            s.plans[req] = None
            continue
        scheduled = [_plan.Scheduled(_Save(at), when, False) for at, when in steps]
        s.plans[req] = _plan.RequestPlan(f"k-{req}", scheduled, None)
        s.saves.open(f"k-{req}")
    s.taps = list(WIDTHS)
    s.slots = {}
    s.tap_calls, s.host_s, s.step_counts = collections.Counter(), collections.Counter(), collections.Counter()
    s.durations = _durations.StepDurations()
    s.in_step, s.executing, s.logits_done = True, True, set()
    return s


def step(s, number, afresh=False):
    """One step: the slots hold values that name the step and the row; the slots drained as after a replay."""
    rows = len(s.view.req_ids)
    for at, w in WIDTHS.items():
        s.slots[at] = torch.arange(rows * w, dtype=torch.float32).view(rows, w) + 1000.0 * number
    s.step_work = None
    if afresh:
        s.steady = None
    s._drain_slots()


def taken(s):
    return {p.key: {k: v.clone() for k, v in _delivery.tensors(s.take_saves([p.key], _delivery.route())[p.key]).items()}
            for p in s.plans.values() if p is not None}


class SteadyTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="steady-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def run_steps(self, afresh, steps=6, plans=None, change=None):
        view = _View(["r0", "r1", "r2", "r3"], [4, 6, 4, 9])  # four decoding requests, at steps 1, 3, 1, 6
        plans = plans or {"r0": [("a.output", "all"), ("b.input", "all")], "r2": [("a.output", "decode")],
                          "r3": [("b.input", frozenset({8, 9}))]}
        s = state(self.dir, view, dict(plans, r1=None) if "r1" not in plans else plans)
        works = []
        for n in range(steps):
            if change is not None:
                change(view, n)
            step(s, n, afresh)
            works.append(s.step_work)
            view.computed += 1
        return s, works

    def test_a_repeating_decode_batch_keeps_its_work_and_saves_as_afresh(self):
        s, works = self.run_steps(afresh=False)
        t, fresh = self.run_steps(afresh=True)
        self.assertIs(works[0], works[1])  # kept from step to step (r3 begins saving at the third)
        self.assertIsNot(fresh[0], fresh[1])
        got, expected = taken(s), taken(t)
        self.assertEqual(got.keys(), expected.keys())
        for key in expected:
            self.assertEqual(got[key].keys(), expected[key].keys())
            for name in expected[key]:
                self.assertTrue(torch.equal(got[key][name], expected[key][name]), (key, name))
        # r0's row 0 at every step (its value names the step); r3 saved only at its steps 8 and 9 (steps 2 and 3)
        self.assertEqual(got["k-r0"]["a.output"][:, 0].tolist(), [1000.0 * n for n in range(6)])
        self.assertEqual(got["k-r3"]["b.input"][:, 0].tolist(), [1000.0 * 2 + 15, 1000.0 * 3 + 15])

    def test_the_step_of_each_saved_row_is_kept(self):
        """take(steps=N) leaves out rows of steps >= N: the kept work's rows carry each request's own step."""
        s, _ = self.run_steps(afresh=False)
        got = _delivery.tensors(s.take_saves({"k-r0": 4}, _delivery.route())["k-r0"])
        self.assertEqual(got["a.output"][:, 0].tolist(), [0.0, 1000.0, 2000.0])  # r0 was at steps 1, 2, 3, ...

    def test_a_set_of_steps_beginning_or_ending_works_the_step_out_afresh(self):
        s, works = self.run_steps(afresh=False)
        # r3 is at steps 6, 7, 8, 9, 10, 11: its save begins at the third step and ends at the fifth
        self.assertIs(works[0], works[1])
        self.assertIsNot(works[1], works[2])
        self.assertIs(works[2], works[3])
        self.assertIsNot(works[3], works[4])
        self.assertIs(works[4], works[5])

    def test_a_changed_batch_is_worked_out_afresh(self):
        def change(view, n):
            if n == 2:  # a request did not advance with the others (preempted and resumed, say)
                view.computed[1] -= 1
            if n == 4:  # a prefill joins
                view.req_ids.append("r4")
                view.qsl = np.array([0, 1, 2, 3, 4, 7], dtype=np.int32)
                view.computed = np.append(view.computed, 0).astype(np.int32)
        s, works = self.run_steps(afresh=False, change=change, plans={"r0": [("a.output", "all")],
                                                                      "r1": [("a.output", "all")]})
        self.assertIs(works[0], works[1])
        self.assertIsNot(works[1], works[2])
        self.assertIs(works[2], works[3])
        self.assertIsNot(works[3], works[4])
        self.assertIsNone(s.steady)  # a prefill in the batch: nothing is kept
        got = taken(s)
        self.assertEqual(got["k-r0"]["a.output"][:, 0].tolist(), [1000.0 * n for n in range(6)])
        self.assertEqual(got["k-r1"]["a.output"][:, 0].tolist(), [1000.0 * n + 3 for n in range(6)])

    def test_a_save_that_fails_fails_its_requests_saves_not_the_step(self):
        """Saving is rank 0's alone: an error there (here the store's add_batch raising) leaves the requests' work
        as it is (every rank must go on alike) and puts the reason in their saves' error."""
        from unittest import mock
        with mock.patch.object(_saves.SavesStore, "add_batch", side_effect=RuntimeError("boom")), \
                self.assertLogs("fragments.vllm", "ERROR"):
            s, works = self.run_steps(afresh=False, steps=2)
        self.assertIs(works[0], works[1])
        answer = s.take_saves(["k-r0"], _delivery.route())["k-r0"]
        self.assertIn("saving a.output at a.output failed at step 1: RuntimeError: boom", answer["error"])

    def test_no_steady_batch_with_a_prefill(self):
        self.assertIsNone(_steady.Steady.of((["a", "b"], np.array([0, 1, 5]), np.array([3, 0])), [0], {}, [0], []))
        self.assertIsNotNone(_steady.Steady.of((["a", "b"], np.array([0, 1, 2]), np.array([3, 4])), [0], {}, [0], []))

    def test_a_prefills_rows_as_spans(self):
        """A prefill's requests hold many rows each: a location's rows are kept as spans (a request's rows read by
        several steps once; neighbouring requests' rows one span), each work's rows found in the block by its
        span, and the index the forward reads is every row of every span in order."""
        shift = [0]
        work = [_worker._Work("k0", 0, 4, _Save("a.output"), 0, shift),
                _worker._Work("k0", 0, 4, _Save("a.output", "again"), 0, shift),  # the same rows, another save
                _worker._Work("k1", 4, 9, _Save("a.output"), 0, shift),  # touches k0's: one span
                _worker._Work("k2", 12, 15, _Save("a.output"), 0, shift)]
        prep = _steady.Prepared(work, lambda spans: _runner.row_index(spans, torch.device("cpu")))
        self.assertEqual((prep.spans, prep.count, prep.first, prep.last), ([(0, 9), (12, 15)], 12, 0, 14))
        self.assertEqual([prep.block_rows(w) for w in work], [(0, 4), (0, 4), (4, 9), (9, 12)])
        self.assertEqual(prep.where.tolist(), list(range(9)) + [12, 13, 14])
        self.assertEqual({g.name: g.parts for g in prep.saves},
                         {"a.output": [("k0", 0, 4), ("k1", 4, 9), ("k2", 9, 12)], "again": [("k0", 0, 4)]})
        one = _steady.Prepared(work[2:3], lambda spans: _runner.row_index(spans, torch.device("cpu")))
        self.assertEqual((one.where, one.count), (range(4, 9), 5))  # one span: a narrow view, no index tensor
        none = _steady.Prepared([], lambda spans: _runner.row_index(spans, torch.device("cpu")))
        self.assertEqual((none.count, none.where), (0, range(0)))


if __name__ == "__main__":
    unittest.main()
