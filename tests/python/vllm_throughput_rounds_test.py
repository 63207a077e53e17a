"""bench/vllm_throughput.py's rounds without vLLM: engines faked, the clock too. A --deadline ends the rounds
before one that would not fit (judged by the longest round so far) and the report covers the rounds done and
says why they stopped; another pass is not started when its engines' start would not fit; SIGTERM (a device
call's `timeout`) ends the rounds alike and closes every engine; the --control column is a second plain engine's
run, its ratio to plain taken within the round; the summary's medians are those of the rounds done; the report so
far is written after every round, and the engines are all asked to quit before any is waited for. (run40 on an
H200: 64 rounds outran a 570 s call and left a log but no JSON; run41 on an H100: the call's limit came while the
engines closed one after another, after the last round, before the report.)"""
import json
import os
import shutil
import signal
import sys
import tempfile
import types
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import vllm_throughput as bench  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakeEngine:
    """An engine whose runs take `run_s` on the fake clock; `rates`: tokens/s by column; `on_run(n)`: called at
    its n-th run (a SIGTERM sent from it). `events`: ("start" or "ready", mode) in order."""
    made, events = [], []

    def __init__(self, args, mode, site, work, clock=None, rates=None, run_s=2.0, on_run=None, details=None):
        self.mode, self.clock, self.rates, self.run_s, self.on_run = mode, clock, rates or {}, run_s, on_run
        self.details = details
        self.start_s, self.closed, self.runs = None, False, 0
        FakeEngine.made.append(self)
        FakeEngine.events.append(("start", mode))

    def ready(self):
        self.start_s = 30.0
        FakeEngine.events.append(("ready", self.mode))

    def cpu_seconds(self):
        return 0.0

    def run(self, column, profile=False):
        self.runs += 1
        self.clock.now += self.run_s
        if self.on_run is not None:
            self.on_run(self.runs)
        rate = self.rates.get(column, 100.0)
        detail = self.details(column, self.runs) if self.details else {}
        return {"column": column, "tokens_per_s": rate, "tokens_per_cpu_s": rate / 2, "saved": 0, "detail": detail}

    def quit(self):
        FakeEngine.events.append(("quit", self.mode))

    def close(self):
        FakeEngine.events.append(("close", self.mode))
        self.closed = True


def args(**kw):
    a = dict(rounds=10, settle=0.0, gpu=True, profile_dir=None, start_orders=1, prompts=64, prompt_len=128,
             max_tokens=128, repeat=1, chunked_prefill="off", layers=8)
    a.update(kw)
    return types.SimpleNamespace(**a)


class RoundsTest(unittest.TestCase):
    def setUp(self):
        FakeEngine.made, FakeEngine.events = [], []
        self.clock = Clock()

    def engine(self, **kw):
        return lambda a, mode, site, work: FakeEngine(a, mode, site, work, clock=self.clock, **kw)

    def test_deadline_stops_before_a_round_that_would_not_fit(self):
        columns = ["plain", "none", "quarter"]
        deadline = bench.Deadline(20.0, clock=self.clock)
        rounds, start_s = [], {}
        # warm-up 6 s (t=6); round 1 to t=12 (6 s, the longest); round 2 to t=18; 2 s left < 6: cut
        bench.run_pass(args(), columns, ["plain", "plugin"], None, None, start_s, 0, rounds, deadline,
                       engine=self.engine())
        self.assertEqual(len(rounds), 2)
        self.assertIn("--deadline 20 s", deadline.cut)
        self.assertIn("round would take ~6 s", deadline.cut)
        self.assertTrue(all(e.closed for e in FakeEngine.made))
        self.assertEqual(start_s, {"plain": [30.0], "plugin": [30.0]})
        report = bench.summarize(args(gpu=False), columns, rounds, start_s, (0.0, 0.0, 0.0), deadline.cut)
        self.assertEqual((report["rounds_done"], report["cut_short"]), (2, deadline.cut))

    def test_a_second_pass_is_not_started_past_the_deadline(self):
        deadline = bench.Deadline(50.0, clock=self.clock)
        rounds, start_s = [], {}
        # pass 1: warm-up 4 s, 5 rounds of 4 s (t=24); pass 2 would need its engines' start (30 s) and a round
        bench.run_passes(args(rounds=5, start_orders=2), ["plain", "none"], None, None, rounds, start_s, deadline,
                         engine=self.engine())
        self.assertEqual((len(rounds), len(FakeEngine.made)), (5, 2))
        self.assertFalse(deadline.signalled)
        self.assertIn("engine start and round would take ~34 s", deadline.cut)

    def test_no_deadline_runs_every_round(self):
        deadline = bench.Deadline(None, clock=self.clock)
        rounds = []
        bench.run_pass(args(rounds=4), ["plain", "none"], ["plain", "plugin"], None, None, {}, 0, rounds, deadline,
                       engine=self.engine())
        self.assertEqual((len(rounds), deadline.cut), (4, None))

    def test_another_pass_needs_room_for_its_engines_start(self):
        deadline = bench.Deadline(100.0, clock=self.clock)
        deadline.longest["round"] = 6.0
        self.clock.now = 60.0
        deadline.longest["engine start"] = 30.0
        self.assertTrue(deadline.allows("engine start", "round"))  # 40 s left, 36 needed
        self.clock.now = 70.0
        self.assertFalse(deadline.allows("engine start", "round"))  # 30 s left
        self.assertIn("engine start and round", deadline.cut)
        self.assertFalse(deadline.allows("round"), "once cut, nothing more starts")

    def test_sigterm_ends_the_rounds_and_closes_the_engines(self):
        deadline = bench.Deadline(None, clock=self.clock)
        rounds = []

        def term(n):
            if n == 5:  # the plugin engine's 5th run: its warm-up (2 columns) and rounds 1-3 of "none", "quarter"
                os.kill(os.getpid(), signal.SIGTERM)
        previous = signal.getsignal(signal.SIGTERM)
        bench.stop_on_sigterm()
        try:
            made = {"plain": self.engine(), "plugin": self.engine(on_run=term)}
            bench.run_passes(args(start_orders=2), ["plain", "none", "quarter"], None, None, rounds, {}, deadline,
                             engine=lambda a, mode, site, work: made[mode](a, mode, site, work))
            self.assertEqual(signal.getsignal(signal.SIGTERM), signal.SIG_IGN, "a second SIGTERM is ignored")
        finally:
            signal.signal(signal.SIGTERM, previous)
        self.assertTrue(deadline.signalled)
        self.assertTrue(deadline.cut.startswith("SIGTERM"), deadline.cut)
        self.assertEqual(len(FakeEngine.made), 2, "the second pass was not started")
        self.assertLess(len(rounds), 10)
        self.assertGreaterEqual(len(rounds), 1)
        self.assertIn(f"after {len(rounds)} round(s)", deadline.cut)
        self.assertTrue(all(e.closed for e in FakeEngine.made))
        ends = [e for e in FakeEngine.events if e[0] in ("quit", "close")]
        self.assertEqual(ends, [("quit", "plain"), ("quit", "plugin"), ("close", "plain"), ("close", "plugin")],
                         "every engine asked to quit before any is waited for: their shutdowns overlap")

    def test_the_report_so_far_is_written_after_every_round(self):
        folder = tempfile.mkdtemp(prefix="frag-rounds-test-")
        self.addCleanup(shutil.rmtree, folder)
        path = os.path.join(folder, "out.json")
        rounds, start_s, seen = [], {}, []
        deadline = bench.Deadline(None, clock=self.clock)
        columns = ["plain", "none"]

        def on_round():  # as main's: the report so far, then what the file holds at that moment
            bench.write_report(path, dict(bench.summarize(args(rounds=3, gpu=False), columns, rounds, start_s,
                                                          (0.0, 0.0, 0.0), deadline.cut, show=False),
                                          complete=False))
            with open(path) as f:
                seen.append(json.load(f)["rounds_done"])
        bench.run_pass(args(rounds=3), columns, ["plain", "plugin"], None, None, start_s, 0, rounds, deadline,
                       engine=self.engine(rates={"none": 90.0}), on_round=on_round)
        self.assertEqual(seen, [1, 2, 3])
        self.assertEqual(os.listdir(folder), ["out.json"], "written beside, then renamed: no part file left")
        with open(path) as f:
            report = json.load(f)
        self.assertEqual((report["complete"], report["summary"]["none"]["ratio_median"]), (False, 0.9))

    def test_control_column_is_a_second_plain_engine(self):
        columns = ["plain", "plain_b", "none", "quarter"]
        deadline = bench.Deadline(None, clock=self.clock)
        rounds, start_s = [], {}
        modes = list(dict.fromkeys(bench.OWNER[c] for c in columns))
        self.assertEqual(modes, ["plain", "plain_b", "plugin"])
        bench.run_pass(args(rounds=3), columns, modes, None, None, start_s, 0, rounds, deadline,
                       engine=self.engine(rates={"plain": 100.0, "plain_b": 97.0, "none": 96.0, "quarter": 88.0}))
        self.assertEqual(sorted(e.mode for e in FakeEngine.made), ["plain", "plain_b", "plugin"])
        # on a GPU the engines start side by side, but the control last, once plain is up: it loads plain's
        # compiled graphs from vLLM's cache instead of compiling them again beside it
        self.assertEqual([e for e in FakeEngine.events if e[0] in ("start", "ready")], [("start", "plain"), ("start", "plugin"), ("ready", "plain"),
                                             ("start", "plain_b"), ("ready", "plain_b"), ("ready", "plugin")])
        self.assertEqual([e.runs for e in FakeEngine.made if e.mode == "plain_b"], [4])  # warm-up and 3 rounds
        for r in rounds:
            self.assertAlmostEqual(r["ratio"]["plain_b"], 0.97)
            self.assertAlmostEqual(r["ratio"]["quarter"], 0.88)
        report = bench.summarize(args(rounds=3, gpu=False), columns, rounds, start_s, (0.0, 0.0, 0.0), None)
        self.assertAlmostEqual(report["summary"]["plain_b"]["ratio_median"], 0.97)
        self.assertIsNone(report["summary"]["plain_b"]["goal"])
        self.assertEqual(report["summary"]["none"]["goal"], 0.97)  # the CPU's (gpu=False: no device named)
        self.assertEqual((report["cut_short"], report["rounds_done"]), (None, 3))


    def test_worker_detail_is_summed_up_by_its_rounds_median(self):
        columns = ["plain", "none", "quarter"]

        def details(column, run):  # the engine's run count: warm-ups are runs 1 and 2 of the plugin's engine
            if column == "quarter":  # a figure every round, one only in some, one not a number
                return dict({"end_step_s": 0.01 * run, "saved_rows": [255]}, **({"load_s": 1.0} if run > 4 else {}))
            return {"end_step_s": 0.001 * run} if column == "none" else {}
        rounds, start_s = [], {}
        bench.run_pass(args(rounds=3), columns, ["plain", "plugin"], None, None, start_s, 0, rounds,
                       bench.Deadline(None, clock=self.clock), engine=self.engine(details=details))
        report = bench.summarize(args(rounds=3, gpu=False), columns, rounds, start_s, (0.0, 0.0, 0.0), None)["summary"]
        # the plugin's engine ran none and quarter in turn: each column's rounds were runs 3-8 of that engine
        quarter = sorted(r["rows"]["quarter"]["detail"]["end_step_s"] for r in rounds)
        self.assertEqual(report["quarter"]["detail_median"], {"end_step_s": quarter[1]})
        none = sorted(r["rows"]["none"]["detail"]["end_step_s"] for r in rounds)
        self.assertEqual(report["none"]["detail_median"], {"end_step_s": none[1]})
        self.assertNotIn("detail_median", report["plain"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
