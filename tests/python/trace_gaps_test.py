"""tools/probes/trace_gaps.py on synthetic torch-profiler traces: the GPU's span, busy and idle time (kernels on
two streams overlapping), the gaps past the threshold, copies to the host with their bytes, the kernels and CUDA
runtime calls by time; the host's spans by time and the step's pace; a gzip trace found in a folder; a folder
without traces and a file that is not one refused with one line and exit 1."""
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "probes"))
import trace_gaps  # noqa: E402

TOOL = os.path.join(ROOT, "tools", "probes", "trace_gaps.py")


def event(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7, "args": args}


EVENTS = [event("kernel", "gemm", 0, 10), event("kernel", "norm", 5, 15),  # overlapping: busy 0-20
          event("kernel", "gemm", 50, 10),  # a gap of 30 us before it
          event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 70, 10, bytes=1 << 20),  # a gap of 10 us
          event("cuda_runtime", "cudaHostAlloc", 40, 30), event("cuda_runtime", "cudaLaunchKernel", 1, 2),
          event("cuda_runtime", "cudaLaunchKernel", 45, 2), event("cpu_op", "aten::index_select", 0, 99),
          event("user_annotation", "gpu_model_runner: preprocess", 0, 5),  # steps start at 0, 100, 300
          event("user_annotation", "gpu_model_runner: preprocess", 100, 5),
          event("user_annotation", "gpu_model_runner: preprocess", 300, 7),
          event("user_annotation", "fragments: end_step", 20, 40),
          event("user_annotation", "fragments: end_step", 120, 20),
          event("gpu_user_annotation", "fragments: end_step", 20, 500)]  # the GPU's copy of a span: not host time


class TraceGapsTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="trace-gaps-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def test_span_busy_idle_and_gaps(self):
        s = trace_gaps.summary(EVENTS, gap_us=20, top=8)
        self.assertAlmostEqual(s["span_ms"], 0.080)
        self.assertAlmostEqual(s["busy_ms"], 0.040)  # 0-20, 50-60, 70-80
        self.assertAlmostEqual(s["idle_ms"], 0.040)
        self.assertEqual((s["gaps"], s["largest_gaps_us"]), (1, [30.0]))  # the 10 us gap is under the threshold
        self.assertEqual((s["copies_to_host"], s["copies_to_host_mb"]), (1, 1.0))
        self.assertEqual(s["kernels_ms"][0], ("gemm", 0.020))
        self.assertEqual(s["runtime_ms"][0], ("cudaHostAlloc", 0.030, 1))
        self.assertEqual(s["runtime_ms"][1], ("cudaLaunchKernel", 0.004, 2))

    def test_host_spans_and_the_steps_pace(self):
        s = trace_gaps.summary(EVENTS, gap_us=20, top=8)
        self.assertEqual(s["host_spans_ms"], [("fragments: end_step", 0.060, 2),
                                              ("gpu_model_runner: preprocess", 0.017, 3)])
        self.assertEqual((s["steps"], s["step_median_us"], s["step_p90_us"]), (3, 200.0, 200.0))  # 100, 200
        s = trace_gaps.summary(EVENTS, gap_us=20, top=8, step_span="fragments: end_step")
        self.assertEqual((s["steps"], s["step_median_us"]), (2, 100.0))
        self.assertNotIn("steps", trace_gaps.summary(EVENTS, 20, 8, step_span="nothing"))

    def test_inside_a_span_by_self_time(self):
        # two end_steps; inside the first a Python function holding a copy, inside the second a copy alone; an op
        # outside every end_step and one in another thread's time are not counted
        events = [event("user_annotation", "fragments: end_step", 1000, 100),
                  event("python_function", "_drain.py(120): run", 1010, 50),
                  event("cpu_op", "aten::copy_", 1020, 30),
                  event("cuda_runtime", "cudaMemcpyAsync", 1025, 10),
                  event("user_annotation", "fragments: end_step", 2000, 20),
                  event("cpu_op", "aten::copy_", 2005, 10),
                  event("cpu_op", "aten::empty", 3000, 5),
                  dict(event("cpu_op", "aten::empty", 1001, 90), tid=8)]
        d = trace_gaps.summary(events, 20, 8, spans_inside=["fragments: end_step", "nothing"])["inside"]
        self.assertEqual(d["nothing"], {"count": 0})
        d = d["fragments: end_step"]
        self.assertEqual((d["count"], d["total_ms"], d["median_us"]), (2, 0.12, 100.0))
        self.assertEqual(d["longest"][0], (100.0, 0.0))  # at the trace's first event
        self.assertEqual(dict((n, (ms, c)) for n, ms, c in d["self_ms"]),
                         {"(the span's own)": (0.06, 2),  # 100 - 50 and 20 - 10
                          "aten::copy_": (0.03, 2),  # 30 - 10 and 10
                          "_drain.py(120): run": (0.02, 1), "cudaMemcpyAsync": (0.01, 1)})
        out = subprocess.run([sys.executable, TOOL, self._write(events), "--inside", "fragments: end_step"],
                             capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("inside 'fragments: end_step': 2x, 0.12 ms; median 100.0 us", out.stdout)
        self.assertIn("aten::copy_", out.stdout)

    def _write(self, events):
        path = os.path.join(self.dir, "t.json")
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)
        return path

    def test_a_gzip_trace_in_a_folder(self):
        os.makedirs(os.path.join(self.dir, "plugin"))
        with gzip.open(os.path.join(self.dir, "plugin", "quarter_dp0_pp0_tp0.pt.trace.json.gz"), "wt") as f:
            json.dump({"traceEvents": EVENTS}, f)
        out = subprocess.run([sys.executable, TOOL, self.dir, "--json", os.path.join(self.dir, "s.json")],
                             capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("GPU span 0.1 ms: busy 0.0, idle 0.0 (50%); 1 gaps over 20 us", out.stdout)
        self.assertIn("cudaHostAlloc", out.stdout)
        self.assertIn("steps ('gpu_model_runner: preprocess'): 3, a step every 200 us", out.stdout)
        self.assertIn("30.0 us each  fragments: end_step", out.stdout)
        with open(os.path.join(self.dir, "s.json")) as f:
            self.assertEqual(len(json.load(f)), 1)

    def test_no_traces_and_not_a_trace(self):
        out = subprocess.run([sys.executable, TOOL, self.dir], capture_output=True, text=True)
        self.assertEqual(out.returncode, 1)
        self.assertEqual(out.stderr.count("\n"), 1, out.stderr)
        self.assertIn("no trace files", out.stderr)
        bad = os.path.join(self.dir, "bad.json")
        with open(bad, "w") as f:
            f.write("{not json")
        out = subprocess.run([sys.executable, TOOL, bad], capture_output=True, text=True)
        self.assertEqual(out.returncode, 1)
        self.assertIn("not a trace", out.stderr)
        self.assertEqual(out.stdout, "")


if __name__ == "__main__":
    unittest.main()
