"""bench/rewrite_benchmark's targets as a test (issue 41 item 7): the slow tier's guard on the pass's speed.

FRAG_SLOW=1 only (the benchmark at 40, 80 and 160 layers, 7 reps: about a minute on an idle 2-core machine);
otherwise skipped, loudly. Runs `rewrite_benchmark --reps 7 --pt2 none --check` and fails when it reports a
guarded target missed: frag rewrite of the 80-layer tree <= 20 ms (thread CPU median; 10.6-10.8 ms when this
test came, 44.5 ms with the regression it was written for), 160 layers <= 3.0 x 80 (thread CPU; x1.82-x2.32),
the saved file <= 2 x the original's save at every depth (x1.34-x1.61). bench/README.md says how the margins
were chosen.

    FRAG_SLOW=1 python tests/bench/rewrite_benchmark_test.py [BENCHMARK]   # from the repository root
    # BENCHMARK: default bench/rewrite_benchmark (the runfiles), else bazel-bin/bench/rewrite_benchmark
"""
import os
import re
import subprocess
import sys
import unittest

BENCHMARK = None


def benchmark():
    for path in ([BENCHMARK] if BENCHMARK else ["bench/rewrite_benchmark", "bazel-bin/bench/rewrite_benchmark"]):
        if os.path.exists(path):
            return path
    raise AssertionError("rewrite_benchmark not found: bazel build //bench:rewrite_benchmark")


class RewriteBenchmarkTargets(unittest.TestCase):
    def test_guarded_targets_are_met(self):
        if os.environ.get("FRAG_SLOW") != "1":
            print("SKIPPED rewrite_benchmark_test: FRAG_SLOW=1 runs it (a timed benchmark, ~1 min)", file=sys.stderr)
            self.skipTest("FRAG_SLOW=1 runs it")
        proc = subprocess.run([benchmark(), "--reps", "7", "--pt2", "none", "--check"], capture_output=True,
                              text=True, timeout=1500)
        print(proc.stdout)
        guarded = re.findall(r"^target: .*\[guarded: (?:MET|NOT MET)\]$", proc.stdout, re.M)
        # Every guarded target was judged on this run (80 and 160 layers measured), and none missed.
        self.assertEqual(len(guarded), 3, "expected three guarded targets:\n%s\n%s" % (proc.stdout, proc.stderr[-3000:]))
        missed = [t for t in guarded if t.endswith("[guarded: NOT MET]")]
        self.assertEqual(missed, [], "guarded targets missed:\n" + "\n".join(missed))
        self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-2000:])


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        BENCHMARK = sys.argv.pop(1)
    unittest.main()
