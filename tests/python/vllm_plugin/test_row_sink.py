"""fragments._C.RowSink (python/fragments/_C_rowsink.cpp) without vLLM: saved rows put as blocks of parts, written
into their files by the sink's writer thread. Checks the bytes in the files, rows and marks (steps merged), blocks
that wait for a release (and ready ones written past them), refused puts that change nothing, failing writes
(/dev/full: ENOSPC; a file-size limit: EFBIG) cutting the file and keeping the rest in memory in put order (rows
written ahead of the failed part too), closed files, blocks dropped by Python after put, and drain letting other
Python threads run.

    PYTHONPATH=python python tests/python/vllm_plugin/test_row_sink.py
"""
import os
import resource
import shutil
import signal
import tempfile
import threading
import unittest

import numpy as np
import torch

from fragments import _C

START = 4096  # where rows begin in each file (a header's room, as _rowfile.py's RowFile keeps)


def row_bytes(block):
    return block[0].numel() * block.element_size()


def raw(tensor):
    """A tensor's bytes (bfloat16 too: numpy has no bfloat16)."""
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


class RowSinkTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="row_sink_test_")
        self.sink = _C.RowSink()

    def tearDown(self):
        del self.sink  # the writer joined before the files go
        shutil.rmtree(self.dir)

    def new_file(self, name, size=START + (1 << 16)):
        path = os.path.join(self.dir, name)
        with open(path, "wb") as f:
            f.truncate(size)
        return path

    def read(self, path, rows, width):
        with open(path, "rb") as f:
            f.seek(START)
            return f.read(rows * width)

    def open_files(self, blocks):
        """Three files: two of bfloat16 rows [2, 3], one of float32 rows [5]."""
        paths = [self.new_file(f"f{i}") for i in range(3)]
        widths = [row_bytes(blocks[0]), row_bytes(blocks[0]), row_bytes(blocks[1])]
        return paths, widths, [self.sink.open(p, START, w) for p, w in zip(paths, widths)]

    def test_interleaved_parts_land_in_put_order(self):
        torch.manual_seed(0)
        bf16 = [torch.randn(6, 2, 3).to(torch.bfloat16) for _ in range(3)]
        f32 = [torch.randn(4, 5) for _ in range(3)]
        paths, widths, (a, b, c) = self.open_files([bf16[0], f32[0]])
        expected = {a: [], b: [], c: []}
        for i in range(3):  # per step: a, b, a again (same step: one mark) from the bf16 block; c from the f32 one
            self.sink.put(bf16[i], [a, b, a], [0, 2, 4], [2, 4, 6], [i, i, i], True)
            self.sink.put(f32[i], [c, c], [0, 1], [1, 4], [i, i + 10], True)
            expected[a] += [bf16[i][0:2], bf16[i][4:6]]
            expected[b] += [bf16[i][2:4]]
            expected[c] += [f32[i][0:1], f32[i][1:4]]
        self.sink.drain()
        self.assertEqual(self.sink.pending, 0)
        self.assertEqual(self.sink.last, 6)
        for fid, path, width in zip((a, b, c), paths, widths):
            want = torch.cat(expected[fid])
            self.assertEqual(self.sink.rows(fid), want.shape[0])
            self.assertEqual(self.read(path, want.shape[0], width), raw(want))
        self.assertEqual(self.sink.marks(a), [(0, 4), (1, 8), (2, 12)])
        self.assertEqual(self.sink.marks(b), [(0, 2), (1, 4), (2, 6)])
        self.assertEqual(self.sink.marks(c), [(0, 1), (10, 4), (1, 5), (11, 8), (2, 9), (12, 12)])
        self.assertIsNone(self.sink.failed(a))
        self.assertEqual(self.sink.spilled(a), [])

    def test_numpy_int64_arrays_and_empty_parts(self):
        block = torch.arange(12, dtype=torch.float32).reshape(6, 2)
        path = self.new_file("f")
        fid = self.sink.open(path, START, 8)
        idx = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
        self.sink.put(block, idx(fid, fid), idx(1, 3), idx(3, 3), idx(7, 8), True)  # the second part has no rows
        small = np.array([fid, 4, 6, 9], dtype=np.int32)  # not int64: read item by item
        self.sink.put(block, small[:1], small[1:2], small[2:3], small[3:], True)
        self.sink.drain()
        self.assertEqual(self.sink.rows(fid), 4)
        self.assertEqual(self.sink.marks(fid), [(7, 2), (9, 4)])
        self.assertEqual(self.read(path, 4, 8), raw(block[1:3]) + raw(block[4:6]))

    def test_unreleased_blocks_wait_for_release(self):
        ready, later = torch.full((3, 4), 1.0), torch.full((3, 4), 2.0)
        path, other = self.new_file("f"), self.new_file("g")
        fid, gid = self.sink.open(path, START, 16), self.sink.open(other, START, 16)
        self.sink.put(ready, [fid], [0], [3], [0], True)
        seq = self.sink.put(later, [fid], [0], [3], [1], False)
        past = self.sink.put(ready, [fid], [0], [1], [2], True)  # ready: written now, past the unreleased rows
        self.sink.put(later, [gid], [0], [2], [1], True)
        self.sink.drain()
        self.assertEqual(self.sink.pending, 1)
        self.assertEqual(self.read(path, 7, 16), raw(ready) + bytes(3 * 16) + raw(ready[:1]))
        self.assertEqual(self.read(other, 2, 16), raw(later[:2]))
        self.assertEqual(self.sink.rows(fid), 7)  # reserved at put
        self.sink.release(seq)
        self.sink.drain()
        self.assertEqual(self.sink.pending, 0)
        self.assertEqual(self.read(path, 7, 16), raw(ready) + raw(later) + raw(ready[:1]))
        self.assertEqual(self.sink.marks(fid), [(0, 3), (1, 6), (2, 7)])
        self.assertEqual(past, seq + 1)

    def test_release_before_put_does_not_release_later_blocks(self):
        path = self.new_file("f")
        fid = self.sink.open(path, START, 16)
        self.sink.release(100)
        self.sink.put(torch.ones(2, 4), [fid], [0], [2], [0], False)
        self.sink.drain()
        self.assertEqual(self.sink.pending, 1)
        self.assertEqual(self.read(path, 2, 16), bytes(32))
        self.sink.release(self.sink.last)
        self.sink.drain()
        self.assertEqual(self.read(path, 2, 16), raw(torch.ones(2, 4)))

    def test_refused_puts_change_nothing(self):
        block = torch.ones(4, 4)
        fid = self.sink.open(self.new_file("f"), START, 16)
        narrow = self.sink.open(self.new_file("g"), START, 8)
        self.sink.put(block, [fid], [0], [1], [0], True)
        closed = self.sink.open(self.new_file("h"), START, 16)
        self.sink.close(closed)
        cases = [
            ((block, [fid, fid], [0], [1, 2], [0, 0]), "differ|entries"),
            ((block, [fid, 99], [0, 0], [1, 1], [0, 0]), "part 1: file id 99 is not open"),
            ((block, [fid, closed], [0, 0], [1, 1], [0, 0]), f"part 1: file id {closed} is not open"),
            ((block, [fid, fid], [1, -1], [2, 1], [0, 0]), r"part 1: rows \[-1, 1\), expected 0 <= lo <= hi <= 4"),
            ((block, [fid], [3], [2], [0]), r"part 0: rows \[3, 2\)"),
            ((block, [fid], [0], [5], [0]), r"part 0: rows \[0, 5\), expected 0 <= lo <= hi <= 4"),
            ((block, [fid, narrow], [0, 0], [1, 1], [0, 0]), "part 1: the block's rows are 16 bytes.*rows of 8 bytes"),
            ((block.t(), [fid], [0], [1], [0]), "not contiguous"),
            ((torch.ones(()), [fid], [0], [0], [0]), "0-d"),
            ((torch.ones(4, 4, device="meta"), [fid], [0], [1], [0]), "meta.*expected a strided CPU tensor"),
        ]
        for args, message in cases:
            with self.subTest(message=message):
                with self.assertRaisesRegex(ValueError, message):
                    self.sink.put(*args, True)
        self.assertEqual(self.sink.rows(fid), 1)
        self.assertEqual(self.sink.marks(fid), [(0, 1)])
        self.assertEqual(self.sink.rows(narrow), 0)
        self.assertEqual(self.sink.last, 1)
        self.sink.drain()
        self.assertEqual(self.sink.pending, 0)
        for bad in ("rows", "marks", "failed", "spilled", "close"):
            with self.assertRaisesRegex(ValueError, f"file id {closed} is not open"):
                getattr(self.sink, bad)(closed)

    def test_open_refusals(self):
        with self.assertRaises(OSError) as caught:
            self.sink.open(os.path.join(self.dir, "missing"), 0, 4)
        self.assertEqual(caught.exception.errno, 2)
        self.assertIn("missing", str(caught.exception))
        path = self.new_file("f")
        with self.assertRaisesRegex(ValueError, "row_bytes > 0"):
            self.sink.open(path, 0, 0)
        with self.assertRaisesRegex(ValueError, "start >= 0"):
            self.sink.open(path, -1, 4)

    def test_failed_write_spills_in_order(self):
        full = self.sink.open("/dev/full", 0, 16)
        path = self.new_file("f")
        fid = self.sink.open(path, START, 16)
        blocks = [torch.randn(4, 4) for _ in range(3)]
        for i, block in enumerate(blocks):
            self.sink.put(block, [fid, full, full], [0, 1, 3], [2, 3, 4], [i, i, i + 10], True)
            if i == 0:
                self.sink.drain()  # the failure happens before the later blocks are put
        self.sink.drain()
        self.assertEqual(self.sink.failed(fid), None)
        row, message = self.sink.failed(full)
        self.assertEqual(row, 0)
        self.assertIn("No space", message)
        self.assertEqual(self.sink.rows(full), 0)
        self.assertEqual(self.sink.marks(full), [])
        spilled = self.sink.spilled(full)
        want = [(i + d, rows) for i, b in enumerate(blocks) for d, rows in ((0, b[1:3]), (10, b[3:4]))]
        self.assertEqual([step for step, _ in spilled], [step for step, _ in want])
        for (_, got), (_, rows) in zip(spilled, want):
            self.assertTrue(torch.equal(got, rows))
        self.assertEqual(self.read(path, 6, 16), raw(torch.cat([b[0:2] for b in blocks])))
        self.assertEqual(self.sink.marks(fid), [(0, 2), (1, 4), (2, 6)])

    def test_failure_mid_file_cuts_rows_and_marks(self):
        path = self.new_file("f")
        fid = self.sink.open(path, START, 16)
        block = torch.randn(9, 4)
        limit = START + 6 * 16 + 4  # a file-size limit inside row 6: the part of rows 5..8 writes short, then EFBIG
        with self.limited(limit):
            self.sink.put(block, [fid, fid], [0, 3], [3, 5], [0, 1], True)
            self.sink.put(block, [fid, fid], [5, 8], [8, 9], [1, 2], True)
        row, message = self.sink.failed(fid)
        self.assertEqual(row, 5)
        self.assertIn("too large", message)
        self.assertEqual(self.sink.rows(fid), 5)
        self.assertEqual(self.sink.marks(fid), [(0, 3), (1, 5)])  # (1, 8) clipped, (2, 9) dropped
        spilled = self.sink.spilled(fid)
        self.assertEqual([step for step, _ in spilled], [1, 2])
        self.assertTrue(torch.equal(spilled[0][1], block[5:8]))
        self.assertTrue(torch.equal(spilled[1][1], block[8:9]))
        self.assertEqual(self.read(path, 5, 16), raw(block[:5]))

    def limited(self, limit):
        """Writes past byte `limit` of any file fail with EFBIG (a file-size limit) until the context ends."""
        test = self

        class Limit:
            def __enter__(self):
                self.old = resource.getrlimit(resource.RLIMIT_FSIZE)
                self.handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, self.old[1]))

            def __exit__(self, *exc):
                test.sink.drain()  # the writer's writes under the limit
                resource.setrlimit(resource.RLIMIT_FSIZE, self.old)
                signal.signal(signal.SIGXFSZ, self.handler)

        return Limit()

    def test_failure_behind_rows_written_ahead(self):
        path = self.new_file("f")
        fid = self.sink.open(path, START, 16)
        x, y, z, w = (torch.full((2, 4), float(i)) for i in range(4))
        self.sink.put(x, [fid], [0], [2], [0], True)
        seq = self.sink.put(y, [fid], [0], [2], [1], False)  # rows 2..3, written after z's
        self.sink.put(z, [fid], [0], [2], [2], True)  # rows 4..5, written at once
        self.sink.drain()
        self.assertEqual(self.read(path, 6, 16), raw(x) + bytes(32) + raw(z))
        with self.limited(START + 2 * 16 + 4):  # y's write fails: the file is cut at row 2, before z's rows
            self.sink.release(seq)
        self.sink.put(w, [fid], [0], [2], [3], True)  # past the cut: kept in memory at once
        self.sink.drain()
        row, message = self.sink.failed(fid)
        self.assertEqual((row, self.sink.rows(fid), self.sink.marks(fid)), (2, 2, [(0, 2)]))
        self.assertIn("too large", message)
        spilled = self.sink.spilled(fid)
        self.assertEqual([step for step, _ in spilled], [1, 2, 3])
        for (_, got), want in zip(spilled, (y, z, w)):
            self.assertTrue(torch.equal(got, want))

    def test_failure_moves_to_an_earlier_row(self):
        path = self.new_file("f")
        fid = self.sink.open(path, START, 16)
        x, y, z = (torch.full((2, 4), float(i + 1)) for i in range(3))
        seq = self.sink.put(x, [fid], [0], [2], [0], False)  # rows 0..1, released last
        with self.limited(START + 3 * 16):  # y (rows 2..3) fails at row 3: its part, from row 2, is cut
            self.sink.put(y, [fid], [0], [2], [1], True)
        self.assertEqual(self.sink.failed(fid)[0], 2)
        self.sink.put(z, [fid], [0], [2], [2], True)
        with self.limited(START + 8):  # then x fails too: the file is cut at row 0
            self.sink.release(seq)
        self.assertEqual(self.sink.failed(fid)[0], 0)
        self.assertEqual((self.sink.rows(fid), self.sink.marks(fid)), (0, []))
        spilled = self.sink.spilled(fid)
        self.assertEqual([step for step, _ in spilled], [0, 1, 2])
        for (_, got), want in zip(spilled, (x, y, z)):
            self.assertTrue(torch.equal(got, want))

    def test_close_with_queued_parts(self):
        path, other = self.new_file("f"), self.new_file("g")
        fid, gid = self.sink.open(path, START, 16), self.sink.open(other, START, 16)
        block = torch.randn(4, 4)
        seq = self.sink.put(block, [fid, gid, fid], [0, 1, 3], [1, 3, 4], [0, 0, 0], False)
        self.sink.close(fid)
        self.sink.release(seq)
        self.sink.drain()
        self.assertEqual(self.sink.pending, 0)
        self.assertEqual(self.read(other, 2, 16), raw(block[1:3]))
        self.assertEqual(self.read(path, 4, 16), bytes(64))
        closed_only = self.sink.put(block, [gid], [0], [1], [1], False)
        self.sink.close(gid)  # the block held rows for gid alone: nothing is left to write
        self.assertEqual(self.sink.pending, 0)
        self.assertEqual(closed_only, seq + 1)

    def test_block_dropped_after_put(self):
        path = self.new_file("f", START + (64 << 20))
        fid = self.sink.open(path, START, 4096)
        expected = []
        for i in range(64):
            block = torch.full((256, 1024), float(i))  # 1 MiB; gone from Python right after put
            self.sink.put(block, [fid], [0], [256], [i], True)
            expected.append(raw(block[:1]))
            del block
        self.sink.drain()
        with open(path, "rb") as f:
            for i, first in enumerate(expected):
                f.seek(START + i * (1 << 20))
                self.assertEqual(f.read(4096), first, f"block {i}")
                f.seek(START + (i + 1) * (1 << 20) - 4096)
                self.assertEqual(f.read(4096), first, f"block {i}'s last row")

    def test_drain_releases_the_gil(self):
        path = os.path.join(self.dir, "f")
        open(path, "wb").close()  # empty: it grows as the writer goes
        fid = self.sink.open(path, 0, 1 << 16)
        block = torch.ones(32, 1 << 14)  # 2 MiB: 100 blocks of 200 MB, all written during the drain
        for i in range(100):
            self.sink.put(block, [fid], [0], [32], [i], False)
        total, midway, stop = 200 << 20, [0], threading.Event()

        def watch():  # can see the file part-written only while the main thread is in drain without the GIL
            while not stop.is_set():
                midway[0] += 0 < os.stat(path).st_size < total

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            self.sink.release(self.sink.last)
            self.sink.drain()
        finally:
            stop.set()
            watcher.join()
        self.assertGreater(midway[0], 0)
        self.assertEqual(self.sink.pending, 0)
        self.assertEqual(os.stat(path).st_size, total)
        with open(path, "rb") as f:
            f.seek(total - (1 << 16))
            self.assertEqual(f.read(1 << 16), raw(block[:1]))

if __name__ == "__main__":
    unittest.main()
