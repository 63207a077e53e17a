"""tools/summarize_tests.py, CI's last line: given the build's test labels, a log left by a target renamed or
removed since is named and not counted (stop 46 counted a renamed target's 7 old cases as passed)."""
import os
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
        _log(self.root, "tests/now_test", "[  PASSED  ] 3 tests.\n")
        _log(self.root, "tests/py_test", "Ran 4 tests in 0.1s\n\nOK (skipped=1)\n")
        _log(self.root, "tests/renamed_old_test", "[  PASSED  ] 7 tests.\n[  FAILED  ] 1 test, listed below:\n")

    def run_tool(self, *labels):
        done = subprocess.run([sys.executable, TOOL, self.root, *labels, "--slowest", "0"], capture_output=True,
                              text=True)
        return done.returncode, done.stdout.strip().splitlines()

    def test_only_the_builds_targets_count(self):
        rc, lines = self.run_tool("tests/now_test", "tests/py_test")
        self.assertEqual(lines[-1], "6 passed, 0 failed, 1 skipped")
        self.assertEqual(rc, 0)
        self.assertIn("tests/renamed_old_test", lines[0])
        self.assertIn("not counted", lines[0])

    def test_a_target_without_a_log_fails(self):
        rc, lines = self.run_tool("tests/now_test", "tests/py_test", "tests/never_ran_test")
        self.assertEqual(lines[-1], "6 passed, 1 failed, 1 skipped")
        self.assertEqual(rc, 1)

    def test_without_labels_every_log_counts(self):
        rc, lines = self.run_tool()
        self.assertEqual(lines[-1], "13 passed, 1 failed, 1 skipped")
        self.assertEqual(rc, 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
