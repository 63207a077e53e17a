"""fragments.vllm._delivery without vLLM: a take's saves as a shared-memory file or as bytes, read back equal to
what the store held (safetensors' own loader reads the file), files never left behind, and the row blocks that
SavesStore.add_rows keeps (views cut at take). RowFilesTest: a store with a folder writes each save's rows into
a file of its own as the steps run (_rowfile.RowFile), and the take seals them.

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


def filled(keys=("a", "b", "c"), steps=5, width=6, dtype=torch.bfloat16, folder=None):
    """A store whose requests saved `steps` decode steps of one row each at "h" through add_rows (one host block
    per step for every request), and a scalar per step at "s" through add."""
    s = SavesStore(folder=folder)
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


def counted_puts(store) -> list:
    """The store's sink wrapped: each put's count of parts appended to the list returned."""
    puts, real = [], store.rows.sink

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def put(self, *args):
            puts.append(len(args[1]))
            return real.put(*args)
    store.rows.sink = Counting()
    return puts


class DeliveryTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="delivery-test-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def test_a_file_reads_back_equal_to_the_bytes_form_and_goes_once_read(self):
        s, expected = filled()
        as_file = s.take("a", folder=self.dir)
        as_bytes = s.take("b")
        self.assertIsNone(as_file["data"])
        self.assertTrue(os.path.isfile(as_file["files"][0]))
        self.assertEqual(os.stat(as_file["files"][0]).st_mode & 0o777, 0o600)
        self.assertTrue(os.path.basename(as_file["files"][0]).startswith(f"fragments-saves-{os.getpid()}-"))
        self.assertEqual(set(load_file(as_file["files"][0])), {"h", "s"})  # safetensors' loader reads our file
        got = _delivery.tensors(as_file)
        self.assertFalse(os.path.exists(as_file["files"][0]))
        self.assertEqual(len(as_file["files"]), 1)  # in memory until the take: one file for every save
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
        self.assertFalse(os.path.exists(entry["files"][0]))
        self.assertTrue(torch.equal(load(data)["h"], expected["c"][:3]))

    def test_no_room_in_shared_memory_answers_bytes_and_leaves_no_file(self):
        s, expected = filled()
        with mock.patch.object(os, "posix_fallocate", side_effect=OSError(28, "No space left on device")):
            entry = s.take("a", folder=self.dir)
        self.assertNotIn("files", entry)
        self.assertTrue(torch.equal(load(entry["data"])["h"], expected["a"]))
        self.assertEqual(os.listdir(self.dir), [])

    def test_a_folder_that_cannot_be_written_answers_bytes(self):
        s, expected = filled()
        entry = s.take("a", folder=os.path.join(self.dir, "no-such-folder"))
        self.assertNotIn("files", entry)
        self.assertTrue(torch.equal(load(entry["data"])["h"], expected["a"]))

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
        self.assertFalse(os.path.exists(entry["files"][0]))
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


class RowFilesTest(unittest.TestCase):
    """A store with a folder: every read-only save's rows in a file of their own, written as the steps run."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="rowfiles-test-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def mine(self):
        return sorted(f for f in os.listdir(self.dir) if f.startswith("fragments-saves-"))

    def test_rows_are_in_files_before_the_take_which_seals_them_without_a_copy(self):
        s, expected = filled(folder=self.dir)
        self.assertEqual(len(self.mine()), 6)  # 3 requests x 2 saves, written as the steps ran
        sizes = {f: os.path.getsize(os.path.join(self.dir, f)) for f in self.mine()}
        with mock.patch("fragments.vllm._delivery.write", side_effect=AssertionError("copied")):
            entry = s.take("a", folder=self.dir)
        self.assertEqual(len(entry["files"]), 2)
        for path in entry["files"]:
            self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
            self.assertEqual(len(load_file(path)), 1)  # safetensors' own loader reads a sealed file
        got = _delivery.tensors(entry)
        self.assertTrue(torch.equal(got["h"], expected["a"]) and got["h"].dtype == torch.bfloat16)
        self.assertEqual(got["s"].tolist(), [0.0, 1.0, 2.0, 3.0, 4.0])
        self.assertEqual(len(self.mine()), 4)  # read and removed; b's and c's wait
        self.assertEqual(entry["bytes"], 5 * 6 * 2 + 5 * 4)
        self.assertTrue(all(sizes[f] > 0 for f in sizes))

    def test_steps_past_the_tokens_are_cut_from_the_file(self):
        s, expected = filled(folder=self.dir)
        got = _delivery.tensors(s.take("b", steps=3, folder=self.dir))
        self.assertTrue(torch.equal(got["h"], expected["b"][:3]))
        self.assertEqual(got["s"].tolist(), [0.0, 1.0, 2.0])

    def test_nothing_kept_leaves_no_file(self):
        s, _ = filled(folder=self.dir)
        entry = s.take("a", steps=0, folder=self.dir)
        self.assertNotIn("files", entry)
        self.assertIsNone(entry["data"])
        self.assertEqual(len(self.mine()), 4)

    def test_a_caller_elsewhere_gets_the_rows_as_bytes_and_the_files_go(self):
        s, expected = filled(folder=self.dir)
        entry = s.take("a")  # no folder: another machine
        self.assertNotIn("files", entry)
        self.assertTrue(torch.equal(load(entry["data"])["h"], expected["a"]))
        other = tempfile.mkdtemp(prefix="rowfiles-other-")
        self.addCleanup(shutil.rmtree, other, True)
        entry = s.take("b", folder=other)  # this machine, another folder: one file there, written at the take
        self.assertEqual([os.path.dirname(p) for p in entry["files"]], [other])
        self.assertTrue(torch.equal(_delivery.tensors(entry)["h"], expected["b"]))
        self.assertEqual(len(self.mine()), 2)

    def test_the_server_payload_is_one_safetensors_of_every_file(self):
        s, expected = filled(folder=self.dir)
        entry = s.take("a", steps=4, folder=self.dir)
        got = load(_delivery.payload(entry))
        self.assertTrue(torch.equal(got["h"], expected["a"][:4]) and got["s"].tolist() == [0.0, 1.0, 2.0, 3.0])
        self.assertTrue(not any(os.path.exists(p) for p in entry["files"]))

    def test_dropped_expired_and_evicted_saves_remove_their_files(self):
        now = [0.0]
        with mock.patch.dict(os.environ, {"FRAGMENTS_VLLM_SAVES_TTL": "10", "FRAGMENTS_VLLM_SAVES_MAX_REQUESTS": "3"}):
            s = SavesStore(folder=self.dir, clock=lambda: now[0])
        for k in ("a", "b", "c"):
            s.open(k)
            s.add_rows("h", torch.ones(1, 4), [(k, 0, 1, 0)])
        self.assertEqual(len(self.mine()), 3)
        s.drop("a", "disconnected", "gone")
        self.assertEqual(len(self.mine()), 2)
        s.finish("b")
        s.open("d")
        s.open("e")  # past 3 requests held: b (finished) is evicted
        self.assertEqual(len(self.mine()), 1)
        s.finish("c")
        now[0] = 11.0
        self.assertEqual(s.stats()["files"], 0)  # c expired
        self.assertEqual(self.mine(), [])
        self.assertEqual(s.take("b")["status"], "dropped")

    def test_shared_memory_full_mid_request_goes_on_in_memory(self):
        """A write refused by the kernel (here EFBIG: a file size limit set so that the third row does not fit,
        as a full tmpfs refuses with ENOSPC) sends that save's later rows to the sink's memory; the take reads the
        file's rows back and sends all of them, in order. Another save in the same blocks is untouched."""
        import resource
        import signal
        s = SavesStore(folder=self.dir)
        s.open("a")
        s.open("b")
        rows = [torch.tensor([[float(i), 0.0, 0.0], [float(i), 1.0, 1.0]]) for i in range(4)]
        s.add_rows("h", rows[0], [("a", 0, 1, 0)])
        s.add_rows("h", rows[1], [("a", 0, 1, 1)])
        f = s._records["a"].files["h"]
        limit = f.start + 2 * f.row_bytes  # a's file holds two rows and no more
        old = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
        try:
            s.add_rows("h", rows[2], [("a", 0, 1, 2)])
            s.add_rows("h", rows[3], [("a", 0, 1, 3)])
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old)
            signal.signal(signal.SIGXFSZ, handler)
        self.assertIsNotNone(f.failed())
        with self.assertLogs("fragments.vllm", "WARNING") as logs:
            got = _delivery.tensors(s.take("a", folder=self.dir))
        self.assertIn("went on in memory", logs.output[0])
        self.assertTrue(torch.equal(got["h"], torch.cat([r[:1] for r in rows])))
        self.assertEqual(self.mine(), [])  # a's row file went with the take (its answer, read, too)
        s.add_rows("h", rows[0][1:], [("b", 0, 1, 0)])
        self.assertTrue(torch.equal(_delivery.tensors(s.take("b", folder=self.dir))["h"], rows[0][1:]))

    def test_rows_still_being_copied_wait_for_their_event(self):
        class Event:
            done = False

            def query(self):
                return self.done

            def synchronize(self):
                self.done = True
        s = SavesStore(folder=self.dir)
        s.open("a")
        s.add_rows("h", torch.ones(2, 3), [("a", 0, 2, 0)], pending=True)
        s.flush()
        self.assertEqual(s.stats()["queued"], 1)  # not sealed: not written
        event = Event()
        s.seal_step(event)
        s.flush()
        self.assertEqual(s.stats()["queued"], 1)  # its copy still runs
        s.add_rows("h", torch.zeros(1, 3), [("a", 0, 1, 1)])  # ready: written now, after the room reserved above
        self.assertEqual(s.stats()["queued"], 1)
        event.done = True
        s.flush()
        s.rows.sink.drain()
        self.assertEqual(s.stats()["queued"], 0)
        s.add_rows("h", torch.full((1, 3), 2.0), [("a", 0, 1, 2)], pending=True)
        last = Event()
        s.seal_step(last)
        got = _delivery.tensors(s.take("a", folder=self.dir))  # the take waits for the copy
        self.assertTrue(last.done)  # waited for before the sink read the block
        self.assertEqual(got["h"][:, 0].tolist(), [1.0, 1.0, 0.0, 2.0])

    def test_a_batch_of_requests_is_one_call_to_the_sink(self):
        """A prepared SaveBatch hands a location's block for all its requests to the sink in one put; it stops
        holding when the store's requests change (here one is taken), and a step that would bring a request past
        its cap is left to add_rows, which truncates the requests it would."""
        s = SavesStore(folder=self.dir)
        for key in ("a", "b", "c"):
            s.open(key)
        block = torch.arange(9.0).reshape(3, 3)
        parts = [("a", 0, 1), ("b", 1, 2), ("c", 2, 3)]
        batch = s.batch("h", block, parts)
        puts = counted_puts(s)
        for step in range(3):
            self.assertTrue(s.add_batch(batch, block + step, [[step] * 3], 3))
        self.assertEqual(puts, [3, 3, 3])
        got = _delivery.tensors(s.take("b", folder=self.dir))
        self.assertEqual(got["h"].tolist(), [[3.0 + step, 4.0 + step, 5.0 + step] for step in range(3)])
        self.assertFalse(s.add_batch(batch, block, [[3] * 3], 3))  # b was taken: the batch no longer holds
        batch = s.batch("h", block, parts)
        self.assertEqual(batch.keys, ["a", "c"])
        s.request_bytes = s._records["a"].bytes + 3 * 4  # a and c have room for one more row, not two
        self.assertTrue(s.add_batch(batch, block + 3, [[3] * 3], 3))
        self.assertFalse(s.add_batch(batch, block + 4, [[4] * 3], 3))
        s.add_rows("h", block + 4, [(k, a, b, 4) for k, a, b in parts])  # what the worker does then
        batch = s.batch("h", block, parts)  # made again: a and c truncated, b taken: it keeps nothing
        self.assertEqual(batch.keys, [])
        self.assertTrue(s.add_batch(batch, block + 5, [[5] * 3], 3))
        got = {k: _delivery.tensors(s.take(k, folder=self.dir)) for k in ("a", "c")}
        self.assertEqual(got["a"]["h"][:, 0].tolist(), [0.0, 1.0, 2.0, 3.0])
        self.assertEqual(got["c"]["h"][:, 0].tolist(), [6.0, 7.0, 8.0, 9.0])
        self.assertEqual(self.mine(), [])

    def test_several_steps_of_a_batch_in_one_put(self):
        """A drain's block holds several steps (_drain.SlotDrain): each step's rows of every request one after the
        other; one put hands them all to the sink, and each request's file has its rows in step order, each
        row's step kept (a take's count of steps cuts there). A batch that leaves a request out (taken) reads
        only its kept requests' steps; steps that would bring a request past its cap are refused whole (nothing
        kept), as one step is."""
        s = SavesStore(folder=self.dir)
        for key in ("a", "b", "c"):
            s.open(key)
        block = torch.arange(9.0).reshape(3, 3)  # a step: a's row 0, b's row 1, c's row 2
        parts = [("a", 0, 1), ("b", 1, 2), ("c", 2, 3)]
        batch = s.batch("h", block, parts)
        puts = counted_puts(s)
        four = torch.cat([block + 100.0 * j for j in range(4)])  # steps 10..13 of the three requests
        self.assertTrue(s.add_batch(batch, four, [[10 + j] * 3 for j in range(4)], 3))
        self.assertEqual(puts, [12])  # one put: 4 steps x 3 requests
        got = _delivery.tensors(s.take("b", folder=self.dir))
        self.assertEqual(got["h"][:, 0].tolist(), [3.0, 103.0, 203.0, 303.0])
        batch = s.batch("h", block, parts)  # b taken: a and c
        self.assertEqual((batch.keys, batch.order), (["a", "c"], [0, 2]))
        self.assertTrue(s.add_batch(batch, four + 1000.0, [[20 + j, 50, 30 + j] for j in range(4)], 3))
        s.request_bytes = s._records["a"].bytes + 3 * 3 * 4  # room for three more rows each, not four
        self.assertFalse(s.add_batch(batch, four, [[40 + j] * 3 for j in range(4)], 3))
        got = {k: _delivery.tensors(s.take(k, folder=self.dir)) for k in ("a",)}
        self.assertEqual(got["a"]["h"][:, 0].tolist(), [0.0, 100.0, 200.0, 300.0, 1000.0, 1100.0, 1200.0, 1300.0])
        c = _delivery.tensors(s.take("c", 32, folder=self.dir))  # each row's step kept: steps 30 and later cut
        self.assertEqual(c["h"][:, 0].tolist(), [6.0, 106.0, 206.0, 306.0, 1006.0, 1106.0])
        self.assertEqual(self.mine(), [])

    def test_a_take_that_fails_midway_leaves_no_file_of_its_request(self):
        s, _ = filled(folder=self.dir)
        with mock.patch("fragments.vllm._saves._serialize", side_effect=RuntimeError("boom")):
            with self.assertRaises(RuntimeError):
                s.take("a")  # bytes: the rows were read back from a's files, then the answer failed
        self.assertEqual(len(self.mine()), 4)  # b's and c's
        from fragments.vllm._rowfile import RowFile
        real, sealed = RowFile.seal, []

        def seal(f, steps):  # the first file seals, the second fails
            if sealed:
                raise RuntimeError("boom")
            sealed.append(real(f, steps))
            return sealed[-1]
        with mock.patch.object(RowFile, "seal", seal):
            with self.assertRaises(RuntimeError):
                s.take("b", folder=self.dir)
        self.assertEqual(len(sealed), 1)
        self.assertEqual(len(self.mine()), 2)  # c's: b's sealed file went with its failed answer

    def test_rows_of_another_shape_fail_the_request_not_the_step(self):
        s = SavesStore(folder=self.dir)
        s.open("a")
        s.add_rows("h", torch.ones(1, 3), [("a", 0, 1, 0)])
        s.add_rows("h", torch.ones(1, 4), [("a", 0, 1, 1)])
        entry = s.take("a", folder=self.dir)
        self.assertIn("rows of [4]", entry["error"])
        self.assertEqual(_delivery.tensors(entry)["h"].shape, (1, 3))


if __name__ == "__main__":
    unittest.main(verbosity=2)
