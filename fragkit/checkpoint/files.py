"""What the checkpoint import's writers share (stream.py writes .pt and .pt2 ranks, pt2.py the .pt2 skeleton): the
dtypes an import writes, the file sink PyTorch's zip writer streams a record into, and the one message a failed
write gets.
"""
import io
import os
import shutil
from typing import Optional, Tuple

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def free_bytes(path: str) -> Tuple[str, int]:
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return probe, shutil.disk_usage(probe).free


class FileSink(io.RawIOBase):
    """A file written through PyTorchFileWriter's buffer constructor (a .pt2 rank, and torch.export.save's
    skeleton), which hands each piece to ``write`` as a memoryview of the record: no copy. An error is not
    raised into the C++ writer (an exception through its zip code is not safe there): the first one is kept,
    later writes are dropped, and the caller checks ``error`` after each record. A short write (a full disk)
    is continued until it succeeds or fails, never silently lost."""

    def __init__(self, path: str):
        super().__init__()
        self.fd: Optional[int] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.error: Optional[OSError] = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.error is None:
            try:
                done = 0
                while done < len(view):
                    done += os.write(self.fd, view[done:])
            except OSError as e:
                self.error = e
        return len(view)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return os.lseek(self.fd, offset, whence)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        super().close()


def write_failure(tmp: str, what: str, error: Exception, out_dir: str) -> str:
    _, free = free_bytes(out_dir)
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ("%s: writing %s failed (%s; %d bytes free on the device): nothing is left behind"
            % (tmp[:-4], what, reason, free))
