"""Scriptable collective helpers named like vLLM's ``vllm.distributed`` ones.

All communication of kit models goes through ``torch.ops.frag.all_reduce`` / ``torch.ops.frag.all_gather``
so that the fragments C++ runtime can supply the implementation.  ``dim`` is passed to the op as given
(vLLM's default ``-1`` included): the op normalizes negative dims.
"""
import torch
from torch import Tensor

from . import ops as _ops  # noqa: F401  (registers the ops before anything is scripted)


def tensor_model_parallel_all_reduce(x: Tensor) -> Tensor:
    return torch.ops.frag.all_reduce(x, "tp")


def tensor_model_parallel_all_gather(x: Tensor, dim: int = -1) -> Tensor:
    return torch.ops.frag.all_gather(x, dim, "tp")


def expert_parallel_all_reduce(x: Tensor) -> Tensor:
    return torch.ops.frag.all_reduce(x, "ep")
