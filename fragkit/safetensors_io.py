"""Read and write .safetensors files (the tensors `frag run --out` writes, the values plans add or set).

Uses the `safetensors` package when it is installed (pip); Debian has no package for it, so otherwise a
minimal reader/writer of the format (8-byte little-endian header length, JSON header, raw bytes) is used.
"""
import json
import struct
from typing import Dict

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def save_file(tensors: Dict[str, torch.Tensor], path: str) -> None:
    try:
        from safetensors.torch import save_file as real_save
        real_save({k: v.contiguous() for k, v in tensors.items()}, path)
        return
    except ImportError:
        pass
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        data = t.view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def load_file(path: str) -> Dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file as real_load
        return real_load(path)
    except ImportError:
        pass
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = torch.frombuffer(bytearray(body[begin:end]), dtype=torch.uint8)
        out[name] = raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"]).clone()
    return out
