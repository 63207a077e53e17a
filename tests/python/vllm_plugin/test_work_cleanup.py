"""vllm_check.remove_stray_shm: vLLM CPU's shared-memory segments that no process maps any more (left by workers
that did not exit cleanly) go when a check ends; a mapped one (a live engine's) and a young one (an engine still
starting) stay. In a folder of its own, not /dev/shm.

    PYTHONPATH=python python tests/python/vllm_plugin/test_work_cleanup.py
"""
import contextlib
import io
import mmap
import os
import shutil
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_check  # noqa: E402


class StrayShmTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="frag-shm-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def segment(self, name, age_s):
        path = os.path.join(self.dir, name)
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        old = time.time() - age_s
        os.utime(path, (old, old))
        return path

    def test_only_old_unmapped_segments_go(self):
        stray = self.segment("41234-tp:0-[0-1]-cpushm_0", 60)
        young = self.segment("41234-tp:0-[0-1]-cpushm_1", 1)
        live = self.segment("50000-tp:0-[0-1]-cpushm_0", 60)
        other = self.segment("not-a-segment", 60)
        with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096) as m:  # a live engine's: mapped here
            m[0] = 1
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                removed = vllm_check.remove_stray_shm(self.dir)
        self.assertEqual(removed, [stray])
        self.assertEqual(sorted(os.listdir(self.dir)), sorted(os.path.basename(p) for p in (young, live, other)))
        self.assertIn("removed 1 stray vLLM shared-memory segment(s)", err.getvalue())
        self.assertEqual(err.getvalue().count("\n"), 1)

    def test_nothing_to_remove_says_nothing(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(vllm_check.remove_stray_shm(self.dir), [])
        self.assertEqual(err.getvalue(), "")


if __name__ == "__main__":
    unittest.main()
