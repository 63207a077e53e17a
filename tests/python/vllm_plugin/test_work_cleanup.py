"""vllm_check.remove_stray_shm: vLLM CPU's shared-memory segments that no process maps any more (left by workers
that did not exit cleanly) go when a check ends; a mapped one (a live engine's) and a young one (an engine still
starting) stay. In a folder of its own, not /dev/shm. vllm_check.stop_process_group: a process group's members end
at SIGTERM, and one that ignores it (as Python's resource tracker does) outlives them, so it can clear up after
them, and is killed only once the grace is over.

    PYTHONPATH=python python tests/python/vllm_plugin/test_work_cleanup.py
"""
import contextlib
import io
import mmap
import os
import shutil
import subprocess
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


# A group as an engine's: a worker that ends at SIGTERM and a tracker that ignores it and, once the worker is gone,
# removes the worker's file (Python's resource tracker unlinking a dead process's shared memory).
_LEADER = """
import subprocess, sys, time
folder = sys.argv[1]
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
subprocess.Popen([sys.executable, "-c", sys.argv[2], folder, str(worker.pid)])
time.sleep(600)
"""
_TRACKER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
folder, pid = sys.argv[1], int(sys.argv[2])
open(os.path.join(folder, "ready"), "w").close()
def alive():
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
while alive():
    time.sleep(0.05)
os.unlink(os.path.join(folder, "segment"))
"""
_STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(600)
"""


class ProcessGroupTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="frag-group-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def start(self, *args):
        proc = subprocess.Popen([sys.executable, "-c", *args], start_new_session=True)
        self.addCleanup(lambda: proc.poll() is None and vllm_check.stop_process_group(proc, grace=0.0))
        return proc

    def group_gone(self, proc):
        try:
            os.killpg(proc.pid, 0)
            return False
        except ProcessLookupError:
            return True

    def test_a_member_ignoring_sigterm_clears_up_after_the_others(self):
        open(os.path.join(self.dir, "segment"), "w").close()
        proc = self.start(_LEADER, self.dir, _TRACKER)
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(self.dir, "ready")) and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        vllm_check.stop_process_group(proc, grace=20.0)
        self.assertTrue(self.group_gone(proc))
        self.assertFalse(os.path.exists(os.path.join(self.dir, "segment")), "the tracker did not clear up")
        self.assertLess(time.monotonic() - t0, 15.0, "the group was empty long before the grace ended")

    def test_what_outlives_the_grace_is_killed(self):
        proc = self.start(_STUBBORN)
        time.sleep(0.5)  # its SIGTERM handler set
        t0 = time.monotonic()
        vllm_check.stop_process_group(proc, grace=1.0)
        self.assertGreaterEqual(time.monotonic() - t0, 1.0)
        self.assertTrue(self.group_gone(proc))
        self.assertEqual(proc.returncode, -9)


if __name__ == "__main__":
    unittest.main()
