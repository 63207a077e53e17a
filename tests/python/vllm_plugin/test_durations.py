"""fragments/vllm/_durations.py: each begin_step and end_step call's duration kept (the last KEEP per phase, every
call counted), and the calls between two reports summed up as the benchmark's detail has them (median, 90th
percentile, longest, the longest three apart from the rest); through the worker, begin_step and end_step record
one call each per step and compile_stats' "step_s" is the report. States as test_steady.py makes them.

    PYTHONPATH=python python tests/python/vllm_plugin/test_durations.py
"""
import shutil
import tempfile
import types
import unittest
from unittest import mock

import test_steady as ts
from fragments.vllm import _durations


class StepDurationsTest(unittest.TestCase):
    def test_the_last_calls_are_kept_and_every_call_counted(self):
        d = _durations.StepDurations()
        with mock.patch.object(_durations, "KEEP", 4):
            for i in range(6):
                d.add("end_step", float(i))
        d.add("begin_step", 2e-6)
        report = d.report()
        self.assertEqual(report["end_step"], {"calls": 6, "last": [2.0, 3.0, 4.0, 5.0]})
        self.assertEqual(report["begin_step"], {"calls": 1, "last": [2e-6]})

    def test_between_sums_up_the_calls_made_since_the_first_report(self):
        d = _durations.StepDurations()
        d.add("end_step", 1.0)  # before: not counted
        before = d.report()
        for us in (10, 20, 30, 40, 50, 60, 70, 80, 90, 4000, 3000, 5000):
            d.add("end_step", us * 1e-6)
        got = _durations.between(before, d.report())
        self.assertEqual(got["end_step_calls"], 12)
        self.assertAlmostEqual(got["end_step_median_us"], 65.0)
        self.assertAlmostEqual(got["end_step_p90_us"], 4000.0)  # the 11th of 12 sorted (index int(0.9 * 12) = 10)
        self.assertAlmostEqual(got["end_step_max_us"], 5000.0)
        self.assertAlmostEqual(got["end_step_top3_ms"], 12.0)
        self.assertAlmostEqual(got["end_step_rest_ms"], 0.45)
        self.assertNotIn("begin_step_calls", got)

    def test_more_calls_than_kept_are_counted_and_the_kept_summed_up(self):
        d = _durations.StepDurations()
        with mock.patch.object(_durations, "KEEP", 3):
            before = d.report()
            for us in (1, 2, 3, 4, 5):
                d.add("begin_step", us * 1e-6)
        got = _durations.between(before, d.report(), longest=1)
        self.assertEqual(got["begin_step_calls"], 5)
        self.assertAlmostEqual(got["begin_step_median_us"], 4.0)  # of 3, 4, 5
        self.assertAlmostEqual(got["begin_step_top1_ms"], 0.005)
        self.assertAlmostEqual(got["begin_step_rest_ms"], 0.007)

    def test_a_phase_with_no_new_call_is_left_out(self):
        d = _durations.StepDurations()
        d.add("end_step", 1e-6)
        self.assertEqual(_durations.between(d.report(), d.report()), {})


class WorkerTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="durations-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def test_each_step_records_one_begin_and_one_end(self):
        view = ts._View(["r0", "r1"], [4, 6])
        s = ts.state(self.dir, view, {"r0": [("a.output", "all")], "r1": None})
        s.compiled, s.graphs, s.hooks, s._failed, s.py_forward, s.forwards = True, "slots", {}, False, 0, 0
        scheduled = types.SimpleNamespace(finished_req_ids=(), scheduled_new_reqs=(),
                                          num_scheduled_tokens={"r0": 1, "r1": 1})
        before = s.durations.report()
        for n in range(5):
            for at, w in ts.WIDTHS.items():
                s.slots[at] = ts.torch.zeros(2, w) + n
            s.begin_step(scheduled)
            s.end_step()
            view.computed += 1
        got = _durations.between(before, s.durations.report())
        self.assertEqual((got["begin_step_calls"], got["end_step_calls"]), (5, 5))
        kept = s.durations.report()["end_step"]["last"]
        self.assertAlmostEqual(sum(kept), s.host_s["end_step"])  # the same durations as the phase's sum
        self.assertGreater(got["end_step_max_us"], 0.0)
        self.assertEqual(s.step_counts["acting"], 5)
        self.assertEqual(ts.taken(s)["k-r0"]["a.output"][:, 0].tolist(), [0.0, 1.0, 2.0, 3.0, 4.0])


if __name__ == "__main__":
    unittest.main(verbosity=2)
