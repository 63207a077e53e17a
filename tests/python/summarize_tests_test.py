"""tools/summarize_tests.py, CI's last line: given the build's test labels, a log left by a target renamed or
removed since is named and not counted (stop 46 counted a renamed target's 7 old cases as passed); every
unittest run in a log counts (a runner that runs three files was counted as its first)."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "summarize_tests.py")


def _log(root, label, text):
    os.makedirs(os.path.join(root, label))
    with open(os.path.join(root, label, "test.log"), "w") as f:
        f.write(text)


class SummarizeTest(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="summarize-")
        self.addCleanup(shutil.rmtree, self.root, True)
        _log(self.root, "tests/now_test", "[  PASSED  ] 3 tests.\n")
        # two files run by one runner: both runs count
        _log(self.root, "tests/py_test", "Ran 4 tests in 0.1s\n\nOK (skipped=1)\n...\nRan 2 tests in 0.013s\n\nOK\n")
        _log(self.root, "tests/renamed_old_test", "[  PASSED  ] 7 tests.\n[  FAILED  ] 1 test, listed below:\n")

    def run_tool(self, *labels):
        done = subprocess.run([sys.executable, TOOL, self.root, *labels, "--slowest", "0"], capture_output=True,
                              text=True)
        return done.returncode, done.stdout.strip().splitlines()

    def test_only_the_builds_targets_count(self):
        rc, lines = self.run_tool("tests/now_test", "tests/py_test")
        self.assertEqual(lines[-1], "8 passed, 0 failed, 1 skipped")
        self.assertEqual(rc, 0)
        self.assertIn("tests/renamed_old_test", lines[0])
        self.assertIn("not counted", lines[0])

    def test_a_target_without_a_log_fails(self):
        rc, lines = self.run_tool("tests/now_test", "tests/py_test", "tests/never_ran_test")
        self.assertEqual(lines[-1], "8 passed, 1 failed, 1 skipped")
        self.assertEqual(rc, 1)

    def test_failed_runs_count_their_failures_once(self):
        _log(self.root, "tests/failing_test", "Ran 3 tests in 1.0s\n\nFAILED (failures=1, skipped=1)\n"
             "Ran 2 tests in 0.1s\n\nFAILED (errors=2)\nRan 2 tests in 0.1s\n\nOK (expected failures=1)\n")
        rc, lines = self.run_tool("tests/now_test", "tests/failing_test")
        self.assertEqual(lines[-1], "6 passed, 3 failed, 1 skipped")
        self.assertEqual(rc, 1)

    def test_without_labels_every_log_counts(self):
        rc, lines = self.run_tool()
        self.assertEqual(lines[-1], "15 passed, 1 failed, 1 skipped")
        self.assertEqual(rc, 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
