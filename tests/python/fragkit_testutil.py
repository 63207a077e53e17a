"""Shared helpers for the fragkit tests (not a test module)."""
import os
import sys

# The repository root holds the fragkit package (in a checkout and in Bazel's runfiles alike).
KIT_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if KIT_ROOT not in sys.path:
    sys.path.insert(0, KIT_ROOT)

import torch  # noqa: E402

torch.set_num_threads(1)


def free_port():
    """A TCP port on 127.0.0.1 that is free now (for a gloo rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def frag_binary():
    """$FRAG_BIN, else cli/frag under $FRAG_TEST_DATA (CMake's build folder) or the current folder
    (Bazel's runfiles, where //cli:frag is a data dependency); None when there is none."""
    if os.environ.get("FRAG_BIN"):
        return os.environ["FRAG_BIN"]
    path = os.path.join(os.environ.get("FRAG_TEST_DATA") or ".", "cli", "frag")
    return os.path.abspath(path) if os.path.isfile(path) and os.access(path, os.X_OK) else None


def submodule(m, path):
    """m.a.b.0.c: works on eager and on scripted/loaded modules (whose ModuleList has no [])."""
    for part in path.split("."):
        m = getattr(m, part)
    return m


def arange_like(t, start=0):
    return torch.arange(start, start + t.numel(), dtype=t.dtype).reshape(t.shape)


@torch.no_grad()
def set_arange(layer):
    """Known weights: every parameter filled with distinct arange values (bias offset by 10000)."""
    for name, p in layer.named_parameters():
        p.copy_(arange_like(p, 10000 if name == "bias" else 0))


def full_and_ranks(make, tp_size, arange=True, **rank_kw):
    """make(tp_rank=..., tp_size=..., **) -> layer.  Returns (full layer, [rank layers loaded from it])."""
    full = make(tp_rank=0, tp_size=1)
    if arange:
        set_arange(full)
    ranks = []
    for r in range(tp_size):
        m = make(tp_rank=r, tp_size=tp_size, **rank_kw)
        m.load_full_weights(full)
        ranks.append(m)
    return full, ranks
