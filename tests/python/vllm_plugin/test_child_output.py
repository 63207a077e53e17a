"""child_output.excerpt keeps a failed engine start's root cause (a worker's first traceback) in the test log,
and run_python_tests.sh runs the Bazel-local tests in a network namespace of their own where it can."""
import os
import unittest

import child_output

WORKER = """(Worker_TP1 pid=5) ERROR WorkerProc failed to start.
(Worker_TP1 pid=5) Traceback (most recent call last):
(Worker_TP1 pid=5)   File "worker.py", line 3, in init_device
(Worker_TP1 pid=5)     raise RuntimeError(
(Worker_TP1 pid=5) RuntimeError: The server socket has failed to listen on any local network address. port: 41234
(Worker_TP1 pid=5) after the cause
"""
CALLER = """Traceback (most recent call last):
  File "check.py", line 1, in <module>
RuntimeError: Engine core initialization failed. See root cause above.
"""


class ExcerptTest(unittest.TestCase):
    def test_cause_before_the_tail_is_kept(self):
        text = WORKER + "noise\n" * 2000 + CALLER
        cut = child_output.excerpt(text, tail=3000)
        self.assertIn("failed to listen on any local network address. port: 41234", cut)
        self.assertNotIn("after the cause", cut)  # the block ends at its exception line
        self.assertTrue(cut.endswith(CALLER))
        self.assertLess(len(cut), 3000 + 1000)

    def test_short_output_is_left_as_it_is(self):
        self.assertEqual(child_output.excerpt(WORKER + CALLER), WORKER + CALLER)
        self.assertEqual(child_output.excerpt("no traceback\n" * 1000, tail=100), ("no traceback\n" * 1000)[-100:])

    def test_first_traceback_without_an_exception_line_is_capped(self):
        text = "Traceback (most recent call last):\n" + "  frame\n" * 500
        self.assertEqual(len(child_output.first_traceback(text, most=80).splitlines()), 80)


class NetworkTest(unittest.TestCase):
    def test_own_network_namespace_where_the_runner_made_one(self):
        if os.environ.get("FRAG_OWN_NETNS") != "1":
            print("SKIPPED network namespace check: run_python_tests.sh could not make one here (unshare -n "
                  "needs root or user namespaces)")
            self.skipTest("no network namespace of its own")
        with open("/proc/net/dev") as f:
            devices = [line.split(":")[0].strip() for line in f.readlines()[2:]]
        self.assertEqual(devices, ["lo"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
