"""Registration of the frag:: ops exported models call: the collectives ``frag::all_reduce`` and
``frag::all_gather``, and the kit's layer math ``frag::rms_norm``, ``frag::rotary_embedding`` and
``frag::silu_and_mul`` (reference kernels here, the same math as runtime/layer_ops.cpp).

The C++ runtime of *fragments* registers the same ops (same schemas) in C++.  If that library was
loaded into this process before ``fragkit`` is imported, the ops already exist and nothing is registered
here.  Otherwise the ops are defined from Python; the collectives' kernels:

* return ``x.clone()`` when ``torch.distributed`` is not initialized or the world size is 1;
* otherwise run ``torch.distributed.all_reduce`` (sum) / ``all_gather`` + ``cat(dim)`` over the default
  group.  The group names ``"tp"`` and ``"ep"`` both mean the whole world for now.

If the C++ library (``TORCH_LIBRARY(frag, m)``) is loaded *after* these Python definitions, its
registration would clash with them (LibTorch aborts the process). ``import fragments`` therefore calls
``release_python_definitions()`` before it loads its C++ runtime and ``adopt_registered()`` after: the C++
ops become the one definition, whichever package was imported first.
"""
from typing import List

import torch

NAMESPACE = "frag"

# Schemas without the namespace, as given to ``Library.define``.
_DEFS = {
    "all_reduce": "all_reduce(Tensor x, str group) -> Tensor",
    "all_gather": "all_gather(Tensor x, int dim, str group) -> Tensor",
    # The kit's layer math as ops (ir/op_schemas.h, runtime/layer_ops.cpp): one opaque node in every graph,
    # so an export and its rewrite run the same (on GPUs, fused) kernels.
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "rotary_embedding": "rotary_embedding(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, "
                        "int head_size, int rotary_dim, bool is_neox) -> (Tensor, Tensor)",
    "silu_and_mul": "silu_and_mul(Tensor x) -> Tensor",
}

# Full schema strings, as ``str(torch.ops.frag.<op>.default._schema)`` prints them and as the C++
# registration must declare them.
OP_SCHEMAS: List[str] = [NAMESPACE + "::" + s for s in _DEFS.values()]

KNOWN_GROUPS = ("tp", "ep")

# Keeps the Python library (and so the registration) alive for the life of the process.
_LIB = None
# True when the ops were defined by this module (False: they came from elsewhere, e.g. C++).
DEFINED_HERE = False


def _op_registered(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
        return True
    except Exception:  # AttributeError on torch 2.x, RuntimeError on some older versions
        return False


def _world_size() -> int:
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def _check_group(group: str) -> None:
    if group not in KNOWN_GROUPS:
        raise RuntimeError("frag: unknown process group %r (known: %s)" % (group, ", ".join(KNOWN_GROUPS)))


def _needs_fp32_transport(x: torch.Tensor) -> bool:
    # gloo has no reduction for the 16-bit float types on older torch versions.
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return torch.distributed.get_backend() == "gloo"


def _all_reduce_impl(x: torch.Tensor, group: str) -> torch.Tensor:
    _check_group(group)
    if _world_size() == 1:
        return x.clone()
    if _needs_fp32_transport(x):
        y = x.float()  # always a copy for 16-bit inputs
        torch.distributed.all_reduce(y)
        return y.to(x.dtype)
    y = x.clone(memory_format=torch.contiguous_format)
    torch.distributed.all_reduce(y)
    return y


def _all_gather_impl(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    _check_group(group)
    nd = x.dim()
    if dim < -nd or dim >= max(nd, 1):
        raise RuntimeError("frag::all_gather: dim %d out of range for a %d-d tensor" % (dim, nd))
    if dim < 0:
        dim += nd
    ws = _world_size()
    if ws == 1:
        return x.clone()
    src = x.contiguous()
    if _needs_fp32_transport(src):
        src = src.float()
    parts = [torch.empty_like(src) for _ in range(ws)]
    torch.distributed.all_gather(parts, src)
    return torch.cat(parts, dim).to(x.dtype)


def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The reference math, op for op as runtime/layer_ops.cpp (and the kit's layers before the ops existed).
    h = x.float()
    variance = h.pow(2).mean(dim=-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return h.to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, rotary_dim: int,
            is_neox: bool) -> torch.Tensor:
    h = x.reshape(list(x.shape[:-1]) + [-1, head_size]).float()
    rot = h[..., :rotary_dim]
    rest = h[..., rotary_dim:]
    c = cos.unsqueeze(-2)
    s = sin.unsqueeze(-2)
    if is_neox:
        half = rotary_dim // 2
        x1 = rot[..., :half]
        x2 = rot[..., half:]
        rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x1 = rot[..., 0::2]
        x2 = rot[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([rot, rest], dim=-1).to(x.dtype).reshape(x.shape)


def _rotary_embedding_impl(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                           cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int, is_neox: bool):
    cos_sin = cos_sin_cache.index_select(0, positions.reshape(-1))
    if positions.dim() > 1:
        cos_sin = cos_sin.reshape(positions.size(0), positions.size(1), -1)
    half = rotary_dim // 2
    cos = cos_sin[..., :half]
    sin = cos_sin[..., half:]
    return (_rotate(query, cos, sin, head_size, rotary_dim, is_neox),
            _rotate(key, cos, sin, head_size, rotary_dim, is_neox))


def _silu_and_mul_impl(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


_IMPLS = {"all_reduce": _all_reduce_impl, "all_gather": _all_gather_impl, "rms_norm": _rms_norm_impl,
          "rotary_embedding": _rotary_embedding_impl, "silu_and_mul": _silu_and_mul_impl}

# The group size that all_gather's fake kernel assumes when torch.distributed is not initialized: a rank is
# exported (torch.export) in one process, so the kit sets it to the export's tp_size (``tracing_group_size``).
_FAKE_GROUP_SIZE = 1


class tracing_group_size:
    """``with tracing_group_size(tp):`` makes ``frag::all_gather``'s fake kernel gather ``tp`` pieces."""

    def __init__(self, size: int):
        self.size = int(size)

    def __enter__(self):
        global _FAKE_GROUP_SIZE
        self.saved, _FAKE_GROUP_SIZE = _FAKE_GROUP_SIZE, self.size
        return self

    def __exit__(self, *exc):
        global _FAKE_GROUP_SIZE
        _FAKE_GROUP_SIZE = self.saved
        return False


def _fake_group_size() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _FAKE_GROUP_SIZE


def _all_reduce_fake(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_gather_fake(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    nd = x.dim()
    if dim < -nd or dim >= max(nd, 1):
        raise RuntimeError("frag::all_gather: dim %d out of range for a %d-d tensor" % (dim, nd))
    shape = list(x.shape)
    shape[dim % nd] = shape[dim % nd] * _fake_group_size()
    return x.new_empty(shape)


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)


def _rotary_embedding_fake(positions, query, key, cos_sin_cache, head_size: int, rotary_dim: int,
                           is_neox: bool):
    return (torch.empty(query.shape, dtype=query.dtype, device=query.device),
            torch.empty(key.shape, dtype=key.dtype, device=key.device))


def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
    shape = list(x.shape)
    shape[-1] = shape[-1] // 2
    return x.new_empty(shape)


_FAKES = {"all_reduce": _all_reduce_fake, "all_gather": _all_gather_fake, "rms_norm": _rms_norm_fake,
          "rotary_embedding": _rotary_embedding_fake, "silu_and_mul": _silu_and_mul_fake}


def _register() -> None:
    global _LIB, DEFINED_HERE
    missing = [name for name in _DEFS if not _op_registered(name)]
    if not missing:
        return
    try:
        lib = torch.library.Library(NAMESPACE, "DEF")
    except Exception:
        # The namespace already has a DEF library (e.g. C++ defined only one of the ops).
        lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # torch >= 2.0 only
    for name in missing:
        lib.define(_DEFS[name])
        try:
            lib.impl(name, _IMPLS[name], "CompositeExplicitAutograd")
        except Exception:
            lib.impl(name, _IMPLS[name], "CPU")
            lib.impl(name, _IMPLS[name], "CUDA")
    _LIB = lib
    DEFINED_HERE = True


def _register_fakes() -> None:
    """Fake (meta) kernels, which torch.export needs to trace the ops; skipped where one exists (C++)."""
    register_fake = getattr(torch.library, "register_fake", None)
    if register_fake is None:
        return
    for name, fake in _FAKES.items():
        try:
            register_fake(NAMESPACE + "::" + name, fake, lib=_LIB)
        except RuntimeError:
            pass  # already has a fake or meta kernel


def release_python_definitions() -> None:
    """Drops the ops this module defined in Python (nothing if it defined none), so that a C++ registration
    of the frag:: namespace loaded next is the only one."""
    global _LIB, DEFINED_HERE
    if DEFINED_HERE and _LIB is not None:
        _LIB._destroy()  # deregisters the definitions, their kernels and fakes, and torch.ops' cached packets
    _LIB = None
    DEFINED_HERE = False


def adopt_registered() -> None:
    """After a C++ registration: defines what it lacks (nothing, for fragments' runtime) and adds the fake
    kernels torch.export needs where it has none."""
    _register()
    _register_fakes()


def registered_schemas() -> List[str]:
    """The schemas the dispatcher holds now for the frag ops (to compare with ``OP_SCHEMAS``)."""
    out = []
    for name in _DEFS:
        packet = getattr(getattr(torch.ops, NAMESPACE), name)
        out.append(str(packet.default._schema))
    return out


_register()
_register_fakes()
