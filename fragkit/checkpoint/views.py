"""Views: the kit's whole (tp=1) tensors, seen lazily through the checkpoint's own tensors.

A view has ``shape`` and ``dtype`` and turns basic slicing (an int-free tuple of slices) into a tensor,
reading only the part asked for: a leaf view reads a memory-mapped checkpoint tensor (a safetensors slice,
a GGUF memmap); ``Cat``, ``Stack``, ``PadRows`` and ``Unsqueeze0`` put several into the kit's layout (fused
q/k/v rows, stacked experts, the padded vocabulary). The kit layers' ``rank_slice`` slices a view exactly as
it slices a tensor, so the streaming import and ``load_full_weights`` share one layout definition.
"""
import os
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

Index = Tuple[slice, ...]


def normalize(index, shape: Sequence[int]) -> List[Tuple[int, int]]:
    """(start, stop) per dim for a basic index: a slice or a tuple of slices, step 1, padded with whole dims."""
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape):
        raise IndexError("too many indices (%d) for a view of shape %s" % (len(index), tuple(shape)))
    out = []
    for i, n in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        if not isinstance(s, slice):
            raise TypeError("views take slices only, got %r" % (s,))
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError("views take step-1 slices only")
        out.append((start, max(start, stop)))
    return out


def as_slices(bounds: Sequence[Tuple[int, int]]) -> Index:
    return tuple(slice(a, b) for a, b in bounds)


class View:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    where: str = ""  # "file: tensor" for messages

    def read(self, bounds: List[Tuple[int, int]]) -> Tensor:
        raise NotImplementedError

    def __getitem__(self, index) -> Tensor:
        return self.read(normalize(index, self.shape))

    def leaves(self) -> List["View"]:
        return [self]

    def prefetch(self) -> None:
        """Ask the kernel to start reading this view's bytes into the page cache (no wait, no memory here):
        a cold checkpoint is then read ahead of the page faults that slicing its memory map makes."""
        for leaf in self.leaves():
            if leaf is not self:
                leaf.prefetch()

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


def materialize(view: View) -> Tensor:
    return view[tuple(slice(None) for _ in view.shape)]


class TensorView(View):
    """A tensor already in memory (the materializing import reads whole tensors)."""

    def __init__(self, tensor: Tensor, where: str = ""):
        self.tensor, self.shape, self.dtype, self.where = tensor, tuple(tensor.shape), tensor.dtype, where

    def read(self, bounds):
        return self.tensor[as_slices(bounds)]


class FnView(View):
    """A leaf whose reader takes bounds (sources.py makes these for safetensors and GGUF tensors)."""

    def __init__(self, shape, dtype, reader: Callable[[List[Tuple[int, int]]], Tensor], where: str,
                 extent: Optional[Tuple[str, int, int]] = None, raw: bool = False):
        self.shape, self.dtype, self.reader, self.where = tuple(int(d) for d in shape), dtype, reader, where
        self.extent = extent  # (file, first byte, end byte) of the tensor's data, where known
        # The extent holds exactly the tensor, row-major in ``dtype`` (safetensors): read_into preads it.
        self.raw = raw and extent is not None and extent[2] - extent[1] == self.nbytes

    def read(self, bounds):
        return self.reader(bounds)

    def prefetch(self):
        if self.extent is None:
            return
        file, begin, end = self.extent
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


class _Composite(View):
    parts: List[View]

    def leaves(self):
        return [leaf for p in self.parts for leaf in p.leaves()]


def _common_dtype(parts: Sequence[View]) -> torch.dtype:
    dtypes = {p.dtype for p in parts}
    if len(dtypes) != 1:
        raise ValueError("parts of one kit tensor have different dtypes: %s"
                         % ", ".join("%s %s" % (p.where, p.dtype) for p in parts))
    return parts[0].dtype


class Cat(_Composite):
    """Parts concatenated on dim 0 (q|k|v rows, gate|up rows)."""

    def __init__(self, parts: Sequence[View]):
        self.parts = list(parts)
        rest = {tuple(p.shape[1:]) for p in self.parts}
        if len(rest) != 1:
            raise ValueError("cannot concatenate %s: shapes %s" % (", ".join(p.where for p in self.parts),
                                                                   [p.shape for p in self.parts]))
        self.shape = (sum(p.shape[0] for p in self.parts),) + self.parts[0].shape[1:]
        self.dtype = _common_dtype(self.parts)
        self.where = self.parts[0].where

    def read(self, bounds):
        (a, b), rest = bounds[0], bounds[1:]
        out, off = [], 0
        for p in self.parts:
            n = p.shape[0]
            lo, hi = max(a, off), min(b, off + n)
            if lo < hi:
                out.append(p.read([(lo - off, hi - off)] + rest))
            off += n
        if not out:
            return torch.empty([0] + [y - x for x, y in rest], dtype=self.dtype)
        return out[0] if len(out) == 1 else torch.cat(out, 0)


class Stack(_Composite):
    """Parts stacked on a new dim 0 (experts)."""

    def __init__(self, parts: Sequence[View]):
        self.parts = list(parts)
        shapes = {p.shape for p in self.parts}
        if len(shapes) != 1:
            raise ValueError("cannot stack %s: shapes %s" % (self.parts[0].where, sorted(shapes)))
        self.shape = (len(self.parts),) + self.parts[0].shape
        self.dtype = _common_dtype(self.parts)
        self.where = self.parts[0].where

    def read(self, bounds):
        (a, b), rest = bounds[0], bounds[1:]
        if a == b:
            return torch.empty([0] + [y - x for x, y in rest], dtype=self.dtype)
        return torch.stack([self.parts[i].read(rest) for i in range(a, b)])


class PadRows(_Composite):
    """Dim 0 padded with zero rows to ``rows`` (vLLM's padded vocabulary)."""

    def __init__(self, part: View, rows: int):
        self.parts = [part]
        self.shape = (max(rows, part.shape[0]),) + part.shape[1:]
        self.dtype, self.where = part.dtype, part.where

    def read(self, bounds):
        (a, b), rest = bounds[0], bounds[1:]
        part = self.parts[0]
        have = part.shape[0]
        pieces = []
        if a < min(b, have):
            pieces.append(part.read([(a, min(b, have))] + rest))
        if b > max(a, have):
            pieces.append(torch.zeros([b - max(a, have)] + [y - x for x, y in rest], dtype=self.dtype))
        if not pieces:
            return torch.empty([0] + [y - x for x, y in rest], dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)


class Unsqueeze0(_Composite):
    """A new dim 0 of size 1 ([H] stored, [1, H] in the kit)."""

    def __init__(self, part: View):
        self.parts = [part]
        self.shape = (1,) + part.shape
        self.dtype, self.where = part.dtype, part.where

    def read(self, bounds):
        (a, b), rest = bounds[0], bounds[1:]
        t = self.parts[0].read(rest).unsqueeze(0)
        return t[a:b]


class Reshape(_Composite):
    """A whole-tensor reshape (read whole; only used for small tensors)."""

    def __init__(self, part: View, shape: Sequence[int]):
        self.parts = [part]
        self.shape = tuple(torch.empty(part.shape, device="meta").reshape(*shape).shape)
        self.dtype, self.where = part.dtype, part.where

    def read(self, bounds):
        return materialize(self.parts[0]).reshape(self.shape)[as_slices(bounds)]


def read_into(view: View, out: Tensor) -> None:
    """Fill ``out`` (contiguous, ``view``'s shape and dtype) with the whole view. Raw leaves (safetensors)
    are read with pread straight into their place in ``out`` -- parts of a Cat into its rows, experts into
    their slot -- so a kit tensor costs one read of its bytes and no copy; other views are materialized and
    copied."""
    if isinstance(view, FnView) and view.raw:
        _pread_into(view.extent[0], view.extent[1], out, view.where)
    elif isinstance(view, Cat):
        offset = 0
        for part in view.parts:
            read_into(part, out.narrow(0, offset, part.shape[0]))
            offset += part.shape[0]
    elif isinstance(view, Stack):
        for i, part in enumerate(view.parts):
            read_into(part, out[i])
    elif isinstance(view, PadRows):
        have = view.parts[0].shape[0]
        read_into(view.parts[0], out.narrow(0, 0, have))
        out.narrow(0, have, out.shape[0] - have).zero_()
    elif isinstance(view, Unsqueeze0):
        read_into(view.parts[0], out[0])
    else:
        out.copy_(materialize(view))


def _pread_into(file: str, begin: int, out: Tensor, where: str) -> None:
    if out.numel() == 0:
        return
    buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    fd = os.open(file, os.O_RDONLY)
    try:
        done = 0
        while done < len(buffer):
            n = os.preadv(fd, [buffer[done:]], begin + done)
            if n <= 0:
                raise OSError("%s: the file ends %d bytes into the tensor's %d" % (where, done, len(buffer)))
            done += n
        # Read once: the checkpoint's pages need not stay in the page cache (room for the written files).
        os.posix_fadvise(fd, begin, done, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Arena:
    """One reused buffer for whole kit tensors (grown to the largest): no allocation, page faults or
    zeroing per tensor, and the process's memory stays at the largest tensor."""

    def __init__(self):
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def tensor(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        if nbytes > self.buffer.numel():
            self.buffer = torch.empty(0, dtype=torch.uint8)  # the old one freed before the new one is made
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer[:nbytes].view(dtype).view(tuple(shape))
