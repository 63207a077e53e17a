"""One save's rows written into shared memory as the steps run, sealed into a safetensors file at the take.

Why: a take that copies a request's saves into a file when the request ends pays for every byte at once,
while the engine waits (the bench's saving column: a quarter of the requests saving 4 locations, 0.26 s of a
0.9 s round on an H100). Written step by step, each step's rows cost one small write while the GPU runs the
next step, and the take writes a header.

Layout of the file (a valid safetensors file once sealed, one tensor):
  [8-byte header length][JSON header, padded with spaces to `start`][rows in step order]
The header's room is reserved when the file is made (its longest form: the name is known then), so rows
never move. Rows go in with pwrite, not through a mapping: the kernel copies them into the page cache without
a page fault per page (3x faster here than a mapping's first touch), and a full tmpfs answers ENOSPC instead of
a SIGBUS. Sealing writes the header over its reserved room and cuts the file at the last kept row.
"""
from __future__ import annotations

import json
import mmap
import os
from collections import OrderedDict
from typing import List, Optional, Tuple

import torch

from . import _delivery


class _Descriptors:
    """Open descriptors of row files, the least recently used closed past `limit` (reopened by path when
    needed): a worker may hold thousands of saves (requests x locations), more than its descriptor limit."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._open: "OrderedDict[str, int]" = OrderedDict()

    def get(self, path: str) -> int:
        fd = self._open.get(path)
        if fd is not None:
            self._open.move_to_end(path)
            return fd
        fd = os.open(path, os.O_RDWR)
        self._open[path] = fd
        while len(self._open) > self.limit:
            os.close(self._open.popitem(last=False)[1])
        return fd

    def add(self, path: str, fd: int) -> None:
        self._open[path] = fd
        while len(self._open) > self.limit:
            os.close(self._open.popitem(last=False)[1])

    def close(self, path: str) -> None:
        fd = self._open.pop(path, None)
        if fd is not None:
            os.close(fd)


descriptors = _Descriptors()


class RowFile:
    """The rows of one save of one request (the worker's store: _saves.SavesStore), in a file in `folder`."""

    def __init__(self, folder: str, key: str, name: str, row_shape: Tuple[int, ...], dtype: torch.dtype):
        self.name, self.row_shape, self.dtype = name, tuple(row_shape), dtype
        self.row_bytes = int(torch.Size(row_shape).numel()) * torch.empty((), dtype=dtype).element_size()
        longest = len(self._header(10**15)) + 8  # the header at its longest (digits of the largest counts)
        self.start = -(-longest // mmap.PAGESIZE) * mmap.PAGESIZE  # rows start on a page: mapped when read
        self.rows = 0
        self.marks: List[Tuple[int, int]] = []  # (step, rows written up to the end of that step), in step order
        self.path, fd = _delivery.new_file(folder, key)
        descriptors.add(self.path, fd)
        self.open = True
        try:  # the header's room written now: sealing never needs space that a full tmpfs could refuse
            self._write_all(b" " * self.start, 0)
        except BaseException:
            self.discard()
            raise

    def fits(self, block: torch.Tensor) -> None:
        """ValueError unless `block` ([n, *row_shape]) has this save's rows."""
        if tuple(block.shape[1:]) != self.row_shape or block.dtype != self.dtype:
            raise ValueError(f"save {self.name!r}: rows of {list(block.shape[1:])} {block.dtype} after rows of "
                             f"{list(self.row_shape)} {self.dtype}")

    def append(self, rows, step: int) -> None:
        """One step's rows as bytes ([n, row_bytes] uint8 numpy on the host, ready to read: `as_bytes`).
        OSError: shared memory is full (the file keeps the rows before these)."""
        self._write_all(rows, self.start + self.rows * self.row_bytes)
        self.reserve(rows.shape[0], step)

    def reserve(self, n: int, step: int) -> int:
        """Room for `n` rows of `step` after those before: the byte offset where they go (a writer thread
        writes them there: _C.write_rows)."""
        offset = self.start + self.rows * self.row_bytes
        self.rows += n
        if self.marks and self.marks[-1][0] == step:
            self.marks[-1] = (step, self.rows)
        else:
            self.marks.append((step, self.rows))
        return offset

    def cut(self, offset: int) -> None:
        """Rows from byte `offset` on were not written (a write refused): the file ends before them."""
        self.rows = (offset - self.start) // self.row_bytes
        marks: List[Tuple[int, int]] = []
        for step, end in self.marks:
            if min(end, self.rows) > (marks[-1][1] if marks else 0):
                marks.append((step, min(end, self.rows)))
        self.marks = marks

    def kept(self, steps: Optional[int]) -> int:
        """Rows of steps before `steps` (all when None): rows are written in step order."""
        if steps is None:
            return self.rows
        return max((end for step, end in self.marks if step < steps), default=0)

    def blocks(self) -> List[Tuple[int, torch.Tensor]]:
        """(step, its rows) in memory: where the file cannot go on (shared memory full)."""
        out, begin, rows = [], 0, self._read(self.rows)
        for step, end in self.marks:
            out.append((step, rows[begin:end]))
            begin = end
        return out

    def seal(self, steps: Optional[int]) -> Optional[str]:
        """The file as safetensors holding the kept rows, its path (None, the file gone, when none are kept)."""
        rows = self.kept(steps)
        if rows == 0:
            self.discard()
            return None
        try:
            text = self._header(rows)  # padded with spaces to the room reserved (the format allows it)
            self._write_all((self.start - 8).to_bytes(8, "little") + text, 0)
            os.ftruncate(descriptors.get(self.path), self.start + rows * self.row_bytes)
        except BaseException:
            self.discard()
            raise
        descriptors.close(self.path)
        self.open = False
        return self.path

    def read(self, steps: Optional[int]) -> Optional[torch.Tensor]:
        """The kept rows as a tensor in memory (the caller gets bytes); the file goes."""
        rows = self.kept(steps)
        try:
            return self._read(rows) if rows else None
        finally:
            self.discard()

    def discard(self) -> None:
        if self.open:
            descriptors.close(self.path)
            self.open = False
            _delivery.remove(self.path)

    def _header(self, rows: int) -> bytes:
        text = json.dumps({self.name: {"dtype": _delivery.DTYPES[self.dtype], "shape": [rows, *self.row_shape],
                                       "data_offsets": [0, rows * self.row_bytes]}}, separators=(",", ":"))
        return text.encode()

    def _write_all(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(descriptors.get(self.path), view, offset)
            if n <= 0:
                raise OSError(f"{self.path}: nothing written at {offset}")
            view, offset = view[n:], offset + n

    def _read(self, rows: int) -> torch.Tensor:
        out = torch.empty((rows, *self.row_shape), dtype=self.dtype)
        view, offset = memoryview(as_bytes(out)).cast("B"), self.start
        while view:
            n = os.preadv(descriptors.get(self.path), [view], offset)
            if n <= 0:
                raise OSError(f"{self.path}: {len(view)} bytes missing at {offset}")
            view, offset = view[n:], offset + n
        return out


def as_bytes(block: torch.Tensor):
    """A host block [n, ...] as [n, row bytes] uint8 numpy sharing its memory: RowFile.append's rows."""
    block = block.contiguous()
    return block.reshape(block.shape[0], -1).view(torch.uint8).numpy()
