"""fragments.vllm._delivery without vLLM: a take's saves as a shared-memory file or as bytes, read back equal to
what the store held (safetensors' own loader reads the file), files never left behind, and the row blocks that
SavesStore.add_rows keeps (views cut at take).

    PYTHONPATH=python python tests/python/vllm_plugin/test_saves_delivery.py
"""
import os
import shutil
import tempfile
import unittest
from unittest import mock

import torch
from safetensors.torch import load, load_file

from fragments.vllm import _delivery
from fragments.vllm._saves import SavesStore


def subprocess_pid_that_ended() -> int:
    import subprocess
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def filled(keys=("a", "b", "c"), steps=5, width=6, dtype=torch.bfloat16):
    """A store whose requests saved `steps` decode steps of one row each at "h" through add_rows (one host block
    per step for every request), and a scalar per step at "s" through add."""
    s = SavesStore()
    for k in keys:
        s.open(k)
    expected = {k: [] for k in keys}
    for step in range(steps):
        host = torch.randn(len(keys), width).to(dtype)
        s.add_rows("h", host, [(k, i, i + 1, step) for i, k in enumerate(keys)])
        for i, k in enumerate(keys):
            expected[k].append(host[i:i + 1].clone())
            s.add(k, "s", torch.tensor(float(step)), step=step)
    return s, {k: torch.cat(v) for k, v in expected.items()}


class DeliveryTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="delivery-test-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def test_a_file_reads_back_equal_to_the_bytes_form_and_goes_once_read(self):
        s, expected = filled()
        as_file = s.take("a", folder=self.dir)
        as_bytes = s.take("b")
        self.assertIsNone(as_file["data"])
        self.assertTrue(os.path.isfile(as_file["file"]))
        self.assertEqual(os.stat(as_file["file"]).st_mode & 0o777, 0o600)
        self.assertTrue(os.path.basename(as_file["file"]).startswith(f"fragments-saves-{os.getpid()}-"))
        self.assertEqual(set(load_file(as_file["file"])), {"h", "s"})  # safetensors' loader reads our file
        got = _delivery.tensors(as_file)
        self.assertFalse(os.path.exists(as_file["file"]))
        self.assertTrue(torch.equal(got["h"], expected["a"]))
        self.assertEqual(got["h"].dtype, torch.bfloat16)
        self.assertEqual(got["s"].tolist(), [0.0, 1.0, 2.0, 3.0, 4.0])
        other = load(as_bytes["data"])
        self.assertTrue(torch.equal(other["h"], expected["b"]))
        self.assertEqual(as_file["bytes"], as_bytes["bytes"])

    def test_mixed_element_sizes_each_start_aligned(self):
        s = SavesStore()
        s.open("a")
        odd = torch.arange(3, dtype=torch.bfloat16).reshape(1, 3)  # 6 bytes: an unaligned start for what follows
        s.add("a", "a_half", odd)
        s.add("a", "b_float", torch.ones(1, 3))
        s.add("a", "c_long", torch.arange(3).reshape(1, 3))
        got = _delivery.tensors(s.take("a", folder=self.dir))
        self.assertTrue(torch.equal(got["a_half"], odd) and torch.equal(got["b_float"], torch.ones(1, 3)))
        self.assertTrue(torch.equal(got["c_long"], torch.arange(3).reshape(1, 3)))

    def test_payload_is_the_files_bytes_and_steps_past_the_tokens_are_left_out(self):
        s, expected = filled()
        entry = s.take("c", steps=3, folder=self.dir)
        data = _delivery.payload(entry)
        self.assertFalse(os.path.exists(entry["file"]))
        self.assertTrue(torch.equal(load(data)["h"], expected["c"][:3]))

    def test_no_room_in_shared_memory_answers_bytes_and_leaves_no_file(self):
        s, expected = filled()
        with mock.patch.object(os, "posix_fallocate", side_effect=OSError(28, "No space left on device")):
            entry = s.take("a", folder=self.dir)
        self.assertNotIn("file", entry)
        self.assertTrue(torch.equal(load(entry["data"])["h"], expected["a"]))
        self.assertEqual(os.listdir(self.dir), [])

    def test_a_caller_on_another_machine_gets_bytes(self):
        folder = _delivery.Folder()
        self.assertIsNone(folder.get({"dir": self.dir, "host": "another-boot-id"}))
        self.assertIsNone(folder.get(None))
        if _delivery.host_id():
            self.assertEqual(folder.get({"dir": self.dir, "host": _delivery.host_id()}), self.dir)

    def test_files_of_writers_that_died_unread_are_swept(self):
        dead = subprocess_pid_that_ended()
        stale = os.path.join(self.dir, f"fragments-saves-{dead}-0-k.safetensors")
        mine = os.path.join(self.dir, f"fragments-saves-{os.getpid()}-0-k.safetensors")
        other = os.path.join(self.dir, "not-ours")
        for p in (stale, mine, other):
            open(p, "w").close()
        if _delivery.host_id():
            _delivery.Folder().get({"dir": self.dir, "host": _delivery.host_id()})
            self.assertEqual(sorted(os.listdir(self.dir)), sorted([os.path.basename(mine), "not-ours"]))

    def test_discard_removes_an_unread_file(self):
        s, _ = filled()
        entry = s.take("a", folder=self.dir)
        _delivery.discard(entry)
        self.assertFalse(os.path.exists(entry["file"]))
        _delivery.discard(entry)  # twice: nothing to do

    def test_truncation_counts_rows_not_the_host_block(self):
        with mock.patch.dict(os.environ, {"FRAGMENTS_VLLM_MAX_SAVE_BYTES": str(3 * 6 * 4)}):
            s = SavesStore()
        s.open("a")
        s.open("b")
        for step in range(5):  # a block of 2 rows, one per request: 24 bytes each per step
            s.add_rows("h", torch.ones(2, 6), [("a", 0, 1, step), ("b", 1, 2, step)])
        out = s.take("a")
        self.assertEqual(load(out["data"])["h"].shape, (3, 6))
        self.assertIn("FRAGMENTS_VLLM_MAX_SAVE_BYTES", out["error"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
