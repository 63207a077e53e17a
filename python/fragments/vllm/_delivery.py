"""How a request's saves travel from the worker that holds them to the caller (docs/vllm.md, "Data flow").

vLLM answers `collective_rpc` by pickling the answer through its engine-core process: a few hundred MB of
saves would be copied four or five times (concatenated, serialized, pickled, sent, loaded) while the engine
core waits. So when the caller runs on the worker's machine (the same boot id) and shared memory has room,
the worker writes each request's saves once, as a safetensors file in /dev/shm, and answers with its path;
the caller reads it (safetensors' own loader) and unlinks it. Otherwise (another node, no room) the answer
carries the bytes, as before. Every reader goes through `tensors` or `payload`, so the
two forms are one switch.

Most saves never need that copy: a read-only save's rows are written into a file of their own in shared memory
as the steps run (_rowfile.RowFile), which the take seals; an answer lists its "files" (one per such save, plus
one for the rest) and may carry "data" beside them.
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import mmap
import os
import re
from typing import Dict, List, Optional

import torch

SHM = os.environ.get("FRAGMENTS_VLLM_SHM_DIR", "/dev/shm")
log = logging.getLogger("fragments.vllm")

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


@functools.lru_cache(maxsize=None)
def host_id() -> str:
    """This machine's boot id: equal for processes that share /dev/shm (read once per process)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def route() -> Optional[dict]:
    """What the caller sends with its take: where it can read files, and which machine it is on."""
    return {"dir": SHM, "host": host_id()} if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else None


class Folder:
    """Where this worker writes answers for a caller on its machine: shared memory itself, files named by the
    writer's pid (mode 0600). The reader removes each file; files of writers that died unread are swept at
    the first take of a later worker."""

    def __init__(self):
        self.swept = False

    def get(self, route_: Optional[dict]) -> Optional[str]:
        if not route_ or not route_.get("host") or route_.get("host") != host_id():
            return None  # another machine, or a caller that reads bytes only
        folder = route_["dir"]
        if not self.swept:
            self.swept = True
            _sweep(folder)
        return folder


def _sweep(folder: str) -> None:
    for name in os.listdir(folder):
        m = _NAME.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:  # its writer is gone: nobody will read it
            remove(os.path.join(folder, name))
        except OSError:  # another user's process: alive
            pass


_NAME = re.compile(r"^fragments-saves-(\d+)-")
_count = itertools.count()


def new_file(folder: str, key: str):
    """(path, descriptor) of a new answer file in `folder`: mode 0600, named by this process (swept once it
    dies unread)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:64]
    path = os.path.join(folder, f"fragments-saves-{os.getpid()}-{next(_count)}-{safe}.safetensors")
    return path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)


def rows_folder() -> Optional[str]:
    """Where a worker writes its saves' rows as the steps run (shared memory), or None: kept in memory instead
    (no writable shared memory, or FRAGMENTS_VLLM_ROWS_IN_SHM=0)."""
    if os.environ.get("FRAGMENTS_VLLM_ROWS_IN_SHM", "1") == "0":
        return None
    return SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else None


def write(parts: Dict[str, List[torch.Tensor]], folder: str, key: str) -> Optional[str]:
    """name -> its row blocks, written as one safetensors file (the blocks of a name concatenated in order)
    with one copy each; the path, or None when shared memory has no room for it or cannot be written (the
    caller gets bytes)."""
    try:
        return _write(parts, folder, key)
    except OSError as e:
        log.warning("fragments: the saves of %s go back as bytes: %s could not be written (%s)", key, folder, e)
        return None


def _write(parts: Dict[str, List[torch.Tensor]], folder: str, key: str) -> Optional[str]:
    # larger elements first (as safetensors orders them): every tensor starts aligned to its own element size
    parts = dict(sorted(parts.items(), key=lambda kv: (-kv[1][0].element_size(), kv[0])))
    header, offset = {}, 0
    for name, blocks in parts.items():
        rows = sum(b.shape[0] for b in blocks) if blocks[0].dim() > 0 else len(blocks)
        shape = [rows] + list(blocks[0].shape[1:]) if blocks[0].dim() > 0 else [rows]
        size = rows * (blocks[0][0].numel() if blocks[0].dim() > 0 else 1) * blocks[0].element_size()
        header[name] = {"dtype": DTYPES[blocks[0].dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format's alignment of the data
    start, total = 8 + len(text), 8 + len(text) + offset
    path, fd = new_file(folder, key)
    try:
        try:
            os.posix_fallocate(fd, 0, total)  # tmpfs refuses here when full, not later with a SIGBUS
        except OSError:
            remove(path)
            return None
        try:
            with mmap.mmap(fd, total) as mm:
                mm[:8] = len(text).to_bytes(8, "little")
                mm[8:start] = text
                _fill(mm, start, offset, parts, header)
        except BaseException:
            remove(path)
            raise
    finally:
        os.close(fd)
    return path


def _fill(mm, start: int, size: int, parts: Dict[str, List[torch.Tensor]], header: dict) -> None:
    """Each name's blocks copied to its place in the file (the views on the mapping end with this call, so the
    mapping can close)."""
    if not size:
        return
    data = torch.frombuffer(mm, dtype=torch.uint8, count=size, offset=start)
    for name, blocks in parts.items():  # one cat per name, straight into the file: no copy in between
        lo, hi = header[name]["data_offsets"]
        dest = data[lo:hi].view(blocks[0].dtype).view(header[name]["shape"])
        if blocks[0].dim() > 0:
            torch.cat(blocks, 0, out=dest)
        else:
            torch.stack(blocks, out=dest)


def tensors(entry: dict) -> Dict[str, torch.Tensor]:
    """The saves of a take's answer (files, bytes or both), as tensors; every file is read once and removed."""
    out: Dict[str, torch.Tensor] = {}
    files = entry.get("files") or ()
    try:
        if files:
            from safetensors.torch import load_file
            for path in files:
                out.update(load_file(path))
    finally:
        discard(entry)
    if entry.get("data"):
        from safetensors.torch import load
        out.update(load(entry["data"]))
    return out


def payload(entry: dict) -> bytes:
    """The saves of a take's answer as one safetensors file's bytes (the server's answer); files are read once
    and removed."""
    files = entry.get("files") or ()
    if len(files) == 1 and not entry.get("data"):
        try:
            with open(files[0], "rb") as f:
                return f.read()
        finally:
            discard(entry)
    if not files:
        return entry.get("data") or b""
    from safetensors.torch import save
    return save(tensors(entry))


def discard(entry: dict) -> None:
    """An answer's files go (read, or nobody will read them: a merged or failed take)."""
    for path in entry.get("files") or ():
        remove(path)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
