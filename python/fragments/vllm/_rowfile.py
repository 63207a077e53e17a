"""One save's rows written into shared memory as the steps run, sealed into a safetensors file at the take.

Why: a take that copies a request's saves into a file when the request ends pays for every byte at once,
while the engine waits (the bench's saving column: a quarter of the requests saving 4 locations, 0.26 s of a
0.9 s round on an H100). Written step by step, each step's rows cost one small write while the GPU runs the
next step, and the take writes a header.

Layout of the file (a valid safetensors file once sealed, one tensor):
  [8-byte header length][JSON header, padded with spaces to `start`][rows in step order]
The header's room is reserved when the file is made (its longest form: the name is known then), so rows
never move. Rows go in with pwrite (_C.RowSink, on its own thread: it reserves each block's room, in order, and
keeps the rows and steps written), not through a mapping: the kernel copies them into the page cache without a
page fault per page (3x faster here than a mapping's first touch), and a full tmpfs answers ENOSPC instead of a
SIGBUS (the sink then keeps that save's later rows in memory: `spilled`). Sealing writes the header over its
reserved room and cuts the file at the last kept row.
"""
from __future__ import annotations

import json
import mmap
import os
from typing import List, Optional, Tuple

import torch

from . import _delivery


class RowFile:
    """The rows of one save of one request (the worker's store: _saves.SavesStore), in a file in `folder`."""

    def __init__(self, sink, folder: str, key: str, name: str, row_shape: Tuple[int, ...], dtype: torch.dtype):
        self.sink, self.name, self.row_shape, self.dtype = sink, name, tuple(row_shape), dtype
        self.row_bytes = int(torch.Size(row_shape).numel()) * dtype.itemsize
        longest = len(self._header(10**15)) + 8  # the header at its longest (digits of the largest counts)
        self.start = -(-longest // mmap.PAGESIZE) * mmap.PAGESIZE  # rows start on a page: mapped when read
        self.fid = None  # the sink's id of this file, once the header's room is written
        self.path, fd = _delivery.new_file(folder, key)
        self.open = True  # until sealed (the caller's then) or discarded
        try:  # the header's room written now: sealing never needs space that a full tmpfs could refuse
            _write_all(fd, b" " * self.start, 0)
            self.fid = sink.open(self.path, self.start, self.row_bytes)
        except BaseException:
            self.discard()
            raise
        finally:
            os.close(fd)

    def fits(self, block: torch.Tensor) -> None:
        """ValueError unless `block` ([n, *row_shape]) has this save's rows."""
        if tuple(block.shape[1:]) != self.row_shape or block.dtype != self.dtype:
            raise ValueError(f"save {self.name!r}: rows of {list(block.shape[1:])} {block.dtype} after rows of "
                             f"{list(self.row_shape)} {self.dtype}")

    @property
    def rows(self) -> int:
        """Rows put for this file (after a refused write: those before it; the rest are `spilled`)."""
        return self.sink.rows(self.fid)

    @property
    def marks(self) -> List[Tuple[int, int]]:
        """(step, rows up to the end of that step), in step order."""
        return self.sink.marks(self.fid)

    def failed(self) -> Optional[str]:
        """Why a write was refused (its rows and the later ones wait in memory: `spilled`), or None."""
        failure = self.sink.failed(self.fid)
        return None if failure is None else failure[1]

    def kept(self, steps: Optional[int]) -> int:
        """Rows of steps before `steps` (all when None): rows are written in step order."""
        if steps is None:
            return self.rows
        return max((end for step, end in self.marks if step < steps), default=0)

    def seal(self, steps: Optional[int]) -> Optional[str]:
        """The file as safetensors holding the kept rows, its path (None, the file gone, when none are kept)."""
        rows = self.kept(steps)
        if rows == 0:
            self.discard()
            return None
        try:
            fd = os.open(self.path, os.O_RDWR)
            try:
                text = self._header(rows)  # padded with spaces to the room reserved (the format allows it)
                _write_all(fd, (self.start - 8).to_bytes(8, "little") + text, 0)
                os.ftruncate(fd, self.start + rows * self.row_bytes)
            finally:
                os.close(fd)
        except BaseException:
            self.discard()
            raise
        self.open = False
        self.sink.close(self.fid)
        return self.path

    def read(self, steps: Optional[int]) -> Optional[torch.Tensor]:
        """The kept rows as a tensor in memory (the caller gets bytes; or a write was refused: the rows the sink
        kept in memory follow the file's); the file goes."""
        rows = self.kept(steps)
        try:
            blocks = [self._read(rows)] if rows else []
            blocks += [t for step, t in self.sink.spilled(self.fid) if steps is None or step < steps]
            return torch.cat(blocks) if len(blocks) > 1 else blocks[0] if blocks else None
        finally:
            self.discard()

    def discard(self) -> None:
        if self.open:
            self.open = False
            if self.fid is not None:
                self.sink.close(self.fid)
            _delivery.remove(self.path)

    def _header(self, rows: int) -> bytes:
        text = json.dumps({self.name: {"dtype": _delivery.DTYPES[self.dtype], "shape": [rows, *self.row_shape],
                                       "data_offsets": [0, rows * self.row_bytes]}}, separators=(",", ":"))
        return text.encode()

    def _read(self, rows: int) -> torch.Tensor:
        out = torch.empty((rows, *self.row_shape), dtype=self.dtype)
        view, offset = memoryview(as_bytes(out)).cast("B"), self.start
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while view:
                n = os.preadv(fd, [view], offset)
                if n <= 0:
                    raise OSError(f"{self.path}: {len(view)} bytes missing at {offset}")
                view, offset = view[n:], offset + n
        finally:
            os.close(fd)
        return out


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"nothing written at {offset}")
        view, offset = view[n:], offset + n


def as_bytes(block: torch.Tensor):
    """A host block [n, ...] as [n, row bytes] uint8 numpy sharing its memory (what a read fills)."""
    block = block.contiguous()
    return block.reshape(block.shape[0], -1).view(torch.uint8).numpy()
