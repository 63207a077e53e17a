"""TorchScript-scriptable tensor-parallel layers laid out exactly like vLLM's.

Each rank's module holds only its slice of the weights (vLLM's per-rank shapes).  Constructor keywords
follow vLLM's, plus keyword-only ``tp_rank`` / ``tp_size`` (and ``ep_rank`` / ``ep_size`` for ``FusedMoE``)
because there is no global parallel state here.

The layer configuration is kept as plain module attributes (int / bool / List[int]); TorchScript keeps them
as attributes of the scripted module, and the fragments C++ pass reads them with ``module.attr(name)``.
Their names are a contract with the C++ side: see ``CONTRACT_ATTRIBUTES``.

``rank_slice(name, full)`` is the one definition of each layer kind's layout: this rank's part of the
parameter ``name`` from the whole tensor ``full``, the way vLLM's weight loaders slice a checkpoint. ``full``
is a tensor, or anything with ``shape`` that basic slicing (a tuple of slices) turns into a tensor, such as a
view of a memory-mapped checkpoint tensor (fragkit.checkpoint.views): the streaming import reads only the
rows and columns this returns. ``load_full_weights(full)`` fills this rank from the same layer built at
tp_size 1 (and ep_size 1) through it.  TorchScript compiles neither (forward does not call them).

``build_on_meta()``: layers (and models.RMSNorm) built inside it get meta parameters, no memory and no
init, for a rank module that a streaming writer fills parameter by parameter.

Layout rules: /work/shared/reference/fragment-rules.md.
"""
import contextlib
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .distributed import (
    expert_parallel_all_reduce,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

DEFAULT_VOCAB_PADDING_SIZE = 64

_LINEAR_ATTRS = [
    "tp_size", "tp_rank", "input_size", "output_size", "input_size_per_partition",
    "output_size_per_partition", "skip_bias_add",
]
_VOCAB_ATTRS = [
    "tp_size", "tp_rank", "num_embeddings", "org_vocab_size", "num_embeddings_padded",
    "num_embeddings_per_partition", "vocab_start_index", "vocab_end_index", "padding_size", "embedding_dim",
]

# Attribute names (and Python types) each layer class exposes to TorchScript.  The C++ pass relies on them.
CONTRACT_ATTRIBUTES: Dict[str, Dict[str, type]] = {
    "ReplicatedLinear": {a: (bool if a == "skip_bias_add" else int) for a in _LINEAR_ATTRS},
    "ColumnParallelLinear": dict({a: (bool if a == "skip_bias_add" else int) for a in _LINEAR_ATTRS},
                                 gather_output=bool),
    "MergedColumnParallelLinear": dict({a: (bool if a == "skip_bias_add" else int) for a in _LINEAR_ATTRS},
                                       gather_output=bool, output_sizes=list),
    "QKVParallelLinear": dict({a: (bool if a == "skip_bias_add" else int) for a in _LINEAR_ATTRS},
                              gather_output=bool, output_sizes=list, hidden_size=int, head_size=int,
                              v_head_size=int, total_num_heads=int, total_num_kv_heads=int, num_heads=int,
                              num_kv_heads=int, num_kv_head_replicas=int),
    "RowParallelLinear": dict({a: (bool if a == "skip_bias_add" else int) for a in _LINEAR_ATTRS},
                              input_is_parallel=bool, reduce_results=bool),
    "VocabParallelEmbedding": {a: int for a in _VOCAB_ATTRS},
    "ParallelLMHead": {a: int for a in _VOCAB_ATTRS},
    "LogitsProcessor": {"vocab_size": int, "org_vocab_size": int, "tp_size": int},
    "FusedMoE": {
        "num_experts": int, "top_k": int, "hidden_size": int, "intermediate_size": int,
        "intermediate_size_per_partition": int, "tp_size": int, "tp_rank": int, "ep_size": int,
        "ep_rank": int, "local_num_experts": int, "expert_start": int, "reduce_results": bool,
        "renormalize": bool,
    },
}


# --------------------------------------------------------------------------------------------------------
# helpers (plain Python, never scripted)

def divide(numerator: int, denominator: int, what: str = "") -> int:
    """numerator / denominator, exactly; `what` ("model.layers.0.mlp.down_proj (RowParallelLinear): input_size")
    names the layer and the size in the error."""
    if denominator <= 0 or numerator % denominator != 0:
        if what:
            raise ValueError("%s %d is not divisible by tp_size %d" % (what, numerator, denominator))
        raise ValueError("%d is not divisible by %d" % (numerator, denominator))
    return numerator // denominator


def _layer_name(layer: nn.Module, prefix: str) -> str:
    """"model.layers.0.mlp.gate_up_proj (MergedColumnParallelLinear)" for errors; the class alone without a prefix."""
    return "%s (%s)" % (prefix, type(layer).__name__) if prefix else type(layer).__name__


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


def _check_rank(name: str, rank: int, size: int) -> None:
    if size < 1 or not (0 <= rank < size):
        raise ValueError("invalid %s rank %d for size %d" % (name, rank, size))


def _check_quant(quant_config) -> None:
    if quant_config is not None:
        raise NotImplementedError("fragkit layers support unquantized weights only")


def _dtype(params_dtype: Optional[torch.dtype]) -> torch.dtype:
    return params_dtype if params_dtype is not None else torch.get_default_dtype()


def _normal_(t: Tensor, std: float) -> None:
    with torch.no_grad():
        t.normal_(0.0, std)


_ON_META = [False]


@contextlib.contextmanager
def build_on_meta():
    """Parameters created inside (kit layers, models.RMSNorm) are meta tensors: shapes and dtypes only."""
    before = _ON_META[0]
    _ON_META[0] = True
    try:
        yield
    finally:
        _ON_META[0] = before


def params_on_meta() -> bool:
    return _ON_META[0]


def _new_param(shape: Sequence[int], dtype: torch.dtype, std: float) -> nn.Parameter:
    if _ON_META[0]:
        return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)
    # Drawn in float32 whatever params_dtype is, so a bfloat16 build is the float32 one rounded.
    t = torch.empty(*shape, dtype=torch.float32)
    _normal_(t, std)
    return nn.Parameter(t.to(dtype), requires_grad=False)


def _check_full(self: nn.Module, full: nn.Module, keys: Sequence[str]) -> None:
    """``full`` must be the same layer class, unsharded, with the same global configuration."""
    if type(full) is not type(self):
        raise TypeError("load_full_weights: expected a %s, got %s" % (type(self).__name__, type(full).__name__))
    if getattr(full, "tp_size", 1) != 1 or getattr(full, "ep_size", 1) != 1:
        raise ValueError("load_full_weights: the source layer must be built with tp_size=1 (and ep_size=1)")
    for k in keys:
        if getattr(full, k) != getattr(self, k):
            raise ValueError("load_full_weights(%s): %s differs (%r here, %r in the full layer)"
                             % (type(self).__name__, k, getattr(self, k), getattr(full, k)))
    if (getattr(full, "bias", None) is None) != (getattr(self, "bias", None) is None):
        raise ValueError("load_full_weights(%s): bias presence differs" % type(self).__name__)


def _whole(full) -> Tensor:
    """The whole tensor (a replicated parameter): every rank holds all of it."""
    return full[tuple(slice(None) for _ in full.shape)]


_JOIN_INTO: List[Optional[object]] = [None]


@contextlib.contextmanager
def rows_joined_into(allocate):
    """Inside, ``_cat_rows`` joins row blocks that are not adjacent (q_r|k_r|v_r, gate_r|up_r at tp > 1) into
    ``allocate(shape, dtype)`` -- the streaming import's reused buffer -- instead of a new tensor: a new one
    per rank and tensor costs fresh pages (page faults, zeroing) for every slice written."""
    before = _JOIN_INTO[0]
    _JOIN_INTO[0] = allocate
    try:
        yield
    finally:
        _JOIN_INTO[0] = before


def _cat_rows(full, rows: Sequence[Tuple[int, int]]) -> Tensor:
    """Rows [a, b) of ``full`` for each (a, b), concatenated in that order (one read, and no copy, when the
    ranges are adjacent: at tp 1 q|k|v and gate|up are the whole tensor)."""
    merged: List[Tuple[int, int]] = []
    for a, b in rows:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    parts = [full[a:b] for a, b in merged]
    if len(parts) == 1:
        return parts[0]
    if _JOIN_INTO[0] is None:
        return torch.cat(parts, 0)
    out = _JOIN_INTO[0]((sum(p.shape[0] for p in parts),) + tuple(parts[0].shape[1:]), parts[0].dtype)
    return torch.cat(parts, 0, out=out)


@torch.no_grad()
def _load_by_rank_slice(self: nn.Module, full: nn.Module, keys: Sequence[str]) -> None:
    """load_full_weights of every kit layer: each parameter from ``rank_slice`` of the full layer's."""
    _check_full(self, full, keys)
    for name, param in self.named_parameters(recurse=False):
        param.copy_(self.rank_slice(name, getattr(full, name)))


# --------------------------------------------------------------------------------------------------------
# linear layers

class _LinearBase(nn.Module):
    """Common construction of the linear layers (vLLM's LinearBase).  Not a kit layer by itself."""

    # Class-level annotations: the attribute contract, and a stable ``__annotations__`` dict per class so
    # TorchScript infers the same module type every time it scripts one (no ``___torch_mangle_N`` names).
    tp_size: int
    tp_rank: int
    input_size: int
    output_size: int
    input_size_per_partition: int
    output_size_per_partition: int
    skip_bias_add: bool

    def _init_linear(self, input_size: int, output_size: int, input_size_per_partition: int,
                     output_size_per_partition: int, bias: bool, skip_bias_add: bool,
                     params_dtype: Optional[torch.dtype], quant_config, tp_rank: int, tp_size: int,
                     bias_size: int) -> None:
        _check_quant(quant_config)
        _check_rank("tp", tp_rank, tp_size)
        self.tp_size = int(tp_size)
        self.tp_rank = int(tp_rank)
        self.input_size = int(input_size)
        self.output_size = int(output_size)
        self.input_size_per_partition = int(input_size_per_partition)
        self.output_size_per_partition = int(output_size_per_partition)
        self.skip_bias_add = bool(skip_bias_add)
        dtype = _dtype(params_dtype)
        # Init scaled by the *whole* fan-in, so the sharded and full layers agree in scale.
        self.weight = _new_param((self.output_size_per_partition, self.input_size_per_partition), dtype,
                                 1.0 / math.sqrt(self.input_size))
        if bias:
            self.bias = _new_param((bias_size,), dtype, 0.1)
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return "in=%d, out=%d, in_p=%d, out_p=%d, tp=%d/%d, bias=%s" % (
            self.input_size, self.output_size, self.input_size_per_partition, self.output_size_per_partition,
            self.tp_rank, self.tp_size, self.bias is not None)


class ReplicatedLinear(_LinearBase):
    """Every rank holds the whole weight.  Never fragmented."""

    tp_size: int

    def __init__(self, input_size: int, output_size: int, bias: bool = True, skip_bias_add: bool = False,
                 params_dtype: Optional[torch.dtype] = None, quant_config=None, prefix: str = "",
                 *, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self._init_linear(input_size, output_size, input_size, output_size, bias, skip_bias_add,
                          params_dtype, quant_config, tp_rank, tp_size, output_size)

    def forward(self, x: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        bias = self.bias
        if self.skip_bias_add:
            out = F.linear(x, self.weight)
            return out, bias
        out = F.linear(x, self.weight, bias)
        return out, None

    def rank_slice(self, name: str, full) -> Tensor:
        return _whole(full)

    def load_full_weights(self, full: "ReplicatedLinear") -> None:
        _load_by_rank_slice(self, full, ["input_size", "output_size"])


class ColumnParallelLinear(_LinearBase):
    """Weight [N, K]; rank r holds rows [r*N/P, (r+1)*N/P) and that bias slice.  Output S(-1)."""

    gather_output: bool

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, params_dtype: Optional[torch.dtype] = None, quant_config=None,
                 output_sizes: Optional[List[int]] = None, prefix: str = "",
                 *, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if output_sizes is not None:
            for s in output_sizes:
                divide(s, tp_size, "%s: output_sizes entry" % _layer_name(self, prefix))
        out_p = divide(output_size, tp_size, "%s: output_size" % _layer_name(self, prefix))
        self._init_linear(input_size, output_size, input_size, out_p, bias, skip_bias_add, params_dtype,
                          quant_config, tp_rank, tp_size, out_p)
        self.gather_output = bool(gather_output)

    def forward(self, x: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        bias = self.bias
        if self.skip_bias_add:
            out = F.linear(x, self.weight)
        else:
            out = F.linear(x, self.weight, bias)
        if self.gather_output and self.tp_size > 1:
            out = tensor_model_parallel_all_gather(out, -1)
        if self.skip_bias_add:
            return out, bias
        return out, None

    # Config that the full (tp_size 1) layer must share with this one.
    _full_keys = ("input_size", "output_size")

    def _row_slices(self) -> List[Tuple[int, int]]:
        """(start, stop) rows of the full weight that make up this rank's, in this rank's order."""
        n, r = self.output_size_per_partition, self.tp_rank
        return [(r * n, (r + 1) * n)]

    def rank_slice(self, name: str, full) -> Tensor:
        """weight [N, K] and bias [N]: the rows of ``_row_slices``, in that order."""
        return _cat_rows(full, self._row_slices())

    def load_full_weights(self, full: "ColumnParallelLinear") -> None:
        _load_by_rank_slice(self, full, list(self._full_keys))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column layer of several outputs fused on the output dim (e.g. gate_up = [I, I]).

    Rank r holds cat_k(sub_k[r*s_k/P : (r+1)*s_k/P]), i.e. [gate_r | up_r]."""

    output_sizes: List[int]

    def __init__(self, input_size: int, output_sizes: List[int], bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, params_dtype: Optional[torch.dtype] = None, quant_config=None,
                 prefix: str = "", *, tp_rank: int = 0, tp_size: int = 1):
        sizes = [int(s) for s in output_sizes]
        super().__init__(input_size, sum(sizes), bias=bias, gather_output=gather_output,
                         skip_bias_add=skip_bias_add, params_dtype=params_dtype, quant_config=quant_config,
                         output_sizes=sizes, prefix=prefix, tp_rank=tp_rank, tp_size=tp_size)
        self.output_sizes: List[int] = sizes

    _full_keys = ("input_size", "output_size", "output_sizes")

    def _row_slices(self) -> List[Tuple[int, int]]:
        """(start, stop) rows of the full weight, in this rank's order."""
        out, off, r, p = [], 0, self.tp_rank, self.tp_size
        for s in self.output_sizes:
            sp = s // p
            out.append((off + r * sp, off + (r + 1) * sp))
            off += s
        return out



class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection.  Rank r holds [q_r | k_r | v_r]; kv heads replicated when tp > kv heads."""

    hidden_size: int
    head_size: int
    v_head_size: int
    total_num_heads: int
    total_num_kv_heads: int
    num_heads: int
    num_kv_heads: int
    num_kv_head_replicas: int
    output_sizes: List[int]

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: Optional[int] = None, bias: bool = True, skip_bias_add: bool = False,
                 params_dtype: Optional[torch.dtype] = None, quant_config=None, prefix: str = "",
                 v_head_size: Optional[int] = None, *, tp_rank: int = 0, tp_size: int = 1):
        if total_num_kv_heads is None:
            total_num_kv_heads = total_num_heads
        if v_head_size is None:
            v_head_size = head_size
        layer = _layer_name(self, prefix)
        num_heads = divide(total_num_heads, tp_size, "%s: total_num_heads" % layer)
        if tp_size >= total_num_kv_heads:
            num_kv_heads = 1
            if tp_size % total_num_kv_heads != 0:
                raise ValueError("%s: tp_size %d is not a multiple of total_num_kv_heads %d (kv heads are "
                                 "replicated over whole groups of ranks)" % (layer, tp_size, total_num_kv_heads))
            num_kv_head_replicas = tp_size // total_num_kv_heads
        else:
            num_kv_heads = divide(total_num_kv_heads, tp_size, "%s: total_num_kv_heads" % layer)
            num_kv_head_replicas = 1
        # vLLM's output_size counts the kv replicas (it is NOT the whole width when replicas > 1).
        output_size = (num_heads * head_size + num_kv_heads * head_size + num_kv_heads * v_head_size) * tp_size
        super().__init__(hidden_size, output_size, bias=bias, gather_output=False, skip_bias_add=skip_bias_add,
                         params_dtype=params_dtype, quant_config=quant_config, prefix=prefix,
                         tp_rank=tp_rank, tp_size=tp_size)
        self.hidden_size = int(hidden_size)
        self.head_size = int(head_size)
        self.v_head_size = int(v_head_size)
        self.total_num_heads = int(total_num_heads)
        self.total_num_kv_heads = int(total_num_kv_heads)
        self.num_heads = int(num_heads)
        self.num_kv_heads = int(num_kv_heads)
        self.num_kv_head_replicas = int(num_kv_head_replicas)
        self.output_sizes: List[int] = [
            num_heads * head_size * tp_size,
            num_kv_heads * head_size * tp_size,
            num_kv_heads * v_head_size * tp_size,
        ]

    _full_keys = ("hidden_size", "head_size", "v_head_size", "total_num_heads", "total_num_kv_heads")

    def _row_slices(self) -> List[Tuple[int, int]]:
        """(start, stop) rows of the whole [Q | K | V] weight that make up this rank's [q_r | k_r | v_r]."""
        r, hs, vs = self.tp_rank, self.head_size, self.v_head_size
        nh, nkv = self.num_heads, self.num_kv_heads
        kv_shard = r // self.num_kv_head_replicas
        k_off = self.total_num_heads * hs
        v_off = k_off + self.total_num_kv_heads * hs
        return [
            (r * nh * hs, (r + 1) * nh * hs),
            (k_off + kv_shard * nkv * hs, k_off + (kv_shard + 1) * nkv * hs),
            (v_off + kv_shard * nkv * vs, v_off + (kv_shard + 1) * nkv * vs),
        ]


class RowParallelLinear(_LinearBase):
    """Weight [N, K]; rank r holds columns [r*K/P, (r+1)*K/P) and the whole bias (added on rank 0 only)."""

    input_is_parallel: bool
    reduce_results: bool

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, params_dtype: Optional[torch.dtype] = None,
                 reduce_results: bool = True, quant_config=None, prefix: str = "",
                 *, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        in_p = divide(input_size, tp_size, "%s: input_size" % _layer_name(self, prefix))
        self._init_linear(input_size, output_size, in_p, output_size, bias, skip_bias_add, params_dtype,
                          quant_config, tp_rank, tp_size, output_size)
        self.input_is_parallel = bool(input_is_parallel)
        self.reduce_results = bool(reduce_results)

    def forward(self, x: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        if self.input_is_parallel:
            x_parallel = x
        else:
            x_parallel = x.narrow(-1, self.tp_rank * self.input_size_per_partition,
                                  self.input_size_per_partition)
        bias = self.bias
        if bias is not None and not self.skip_bias_add and self.tp_rank == 0:
            out = F.linear(x_parallel, self.weight, bias)
        else:
            out = F.linear(x_parallel, self.weight)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        if self.skip_bias_add:
            return out, bias
        return out, None

    def rank_slice(self, name: str, full) -> Tensor:
        if name == "bias":
            return _whole(full)  # whole bias on every rank, as vLLM loads it
        k, r = self.input_size_per_partition, self.tp_rank
        return full[:, r * k:(r + 1) * k]

    def load_full_weights(self, full: "RowParallelLinear") -> None:
        _load_by_rank_slice(self, full, ["input_size", "output_size"])


# --------------------------------------------------------------------------------------------------------
# vocab-parallel embedding / lm head / logits

class VocabParallelEmbedding(nn.Module):
    """Vocab split in padded ranges: rank r owns padded ids [r*Vp/P, (r+1)*Vp/P); padded rows are zero."""

    tp_size: int
    tp_rank: int
    num_embeddings: int
    org_vocab_size: int
    num_embeddings_padded: int
    num_embeddings_per_partition: int
    vocab_start_index: int
    vocab_end_index: int
    padding_size: int
    embedding_dim: int

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: Optional[torch.dtype] = None,
                 org_num_embeddings: Optional[int] = None, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
                 quant_config=None, prefix: str = "", *, tp_rank: int = 0, tp_size: int = 1,
                 init_std: float = 1.0):
        super().__init__()
        _check_quant(quant_config)
        _check_rank("tp", tp_rank, tp_size)
        org = int(org_num_embeddings or num_embeddings)
        if num_embeddings != org:
            # vLLM shards added (LoRA) vocab separately after the padded org vocab; not supported here.
            raise NotImplementedError("fragkit: added vocabulary (num_embeddings != org_num_embeddings) "
                                      "is not supported")
        self.tp_size = int(tp_size)
        self.tp_rank = int(tp_rank)
        self.num_embeddings = int(num_embeddings)
        self.org_vocab_size = org
        self.padding_size = int(padding_size)
        org_padded = pad_vocab_size(org, self.padding_size)
        self.num_embeddings_padded = pad_vocab_size(org_padded + self.num_embeddings - org, self.padding_size)
        if self.num_embeddings_padded % self.tp_size != 0:
            raise ValueError("%s: padded vocab size %d (vocab %d padded to a multiple of padding_size %d) is not "
                             "divisible by tp_size %d" % (_layer_name(self, prefix), self.num_embeddings_padded,
                                                          org, self.padding_size, self.tp_size))
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.embedding_dim = int(embedding_dim)
        self.weight = _new_param((self.num_embeddings_per_partition, self.embedding_dim), _dtype(params_dtype),
                                 init_std)
        self._zero_padding_rows()

    @torch.no_grad()
    def _zero_padding_rows(self) -> None:
        n_valid = min(max(self.org_vocab_size - self.vocab_start_index, 0), self.num_embeddings_per_partition)
        self.weight[n_valid:].zero_()
        bias = getattr(self, "bias", None)
        if bias is not None:
            bias[n_valid:].zero_()

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp_size > 1:
            mask = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
            masked_ids = (input_ids - self.vocab_start_index).masked_fill(~mask, 0)
            out = F.embedding(masked_ids, self.weight)
            out = out.masked_fill(~mask.unsqueeze(-1), 0.0)
            return tensor_model_parallel_all_reduce(out)
        return F.embedding(input_ids, self.weight)

    def rank_slice(self, name: str, full) -> Tensor:
        """weight [Vp, H] (and the LM head's bias [Vp]): padded ids [start, end), padding rows zero."""
        part = full[self.vocab_start_index:self.vocab_end_index]
        n_valid = min(max(self.org_vocab_size - self.vocab_start_index, 0), self.num_embeddings_per_partition)
        if n_valid < part.shape[0] and bool(part[n_valid:].any()):
            part = part.clone()
            part[n_valid:] = 0
        return part

    def load_full_weights(self, full: "VocabParallelEmbedding") -> None:
        _load_by_rank_slice(self, full, ["num_embeddings", "org_vocab_size", "num_embeddings_padded",
                                         "embedding_dim", "padding_size"])

    def extra_repr(self) -> str:
        return "V=%d, V0=%d, Vp=%d, per_rank=%d, range=[%d, %d), dim=%d, tp=%d/%d" % (
            self.num_embeddings, self.org_vocab_size, self.num_embeddings_padded,
            self.num_embeddings_per_partition, self.vocab_start_index, self.vocab_end_index,
            self.embedding_dim, self.tp_rank, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection.  forward returns this rank's logits shard [..., Vp/P]."""

    tp_size: int
    tp_rank: int
    num_embeddings: int
    org_vocab_size: int
    num_embeddings_padded: int
    num_embeddings_per_partition: int
    vocab_start_index: int
    vocab_end_index: int
    padding_size: int
    embedding_dim: int

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, org_num_embeddings: Optional[int] = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE, quant_config=None, prefix: str = "",
                 *, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype,
                         org_num_embeddings=org_num_embeddings, padding_size=padding_size,
                         quant_config=quant_config, prefix=prefix, tp_rank=tp_rank, tp_size=tp_size,
                         init_std=1.0 / math.sqrt(embedding_dim))
        if bias:
            self.bias = _new_param((self.num_embeddings_per_partition,), _dtype(params_dtype), 0.1)
        else:
            self.register_parameter("bias", None)
        self._zero_padding_rows()

    def forward(self, hidden_states: Tensor) -> Tensor:
        return F.linear(hidden_states, self.weight, self.bias)


class LogitsProcessor(nn.Module):
    """Gathers the vocab shards (AG(-1), only if tp_size > 1) and drops the padding: [..., :org_vocab_size].

    Positional arguments follow vLLM's (vocab_size, org_vocab_size, scale); tp_size is keyword-only."""

    vocab_size: int
    org_vocab_size: int
    tp_size: int
    scale: float

    def __init__(self, vocab_size: int, org_vocab_size: Optional[int] = None, scale: float = 1.0,
                 *, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        _check_rank("tp", tp_rank, tp_size)
        self.vocab_size = int(vocab_size)
        self.org_vocab_size = int(org_vocab_size or vocab_size)
        self.tp_size = int(tp_size)
        self.scale = float(scale)

    def forward(self, logits: Tensor) -> Tensor:
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, -1)
        logits = logits[..., :self.org_vocab_size]
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def load_full_weights(self, full: "LogitsProcessor") -> None:
        _check_full(self, full, ["vocab_size", "org_vocab_size"])


# --------------------------------------------------------------------------------------------------------
# mixture of experts

class FusedMoE(nn.Module):
    """Experts with softmax top-k routing and SiLU-gated MLPs.

    TP (ep_size == 1): each rank holds a slice [r*I/P, (r+1)*I/P) of every expert's intermediate dim.
    EP (tp_size == 1 for the layer): each rank holds a contiguous block of whole experts
    (base = E // ep, the first E % ep ranks get one more).  The output per rank is a partial sum; with
    reduce_results it is all-reduced over group "ep" (ep_size > 1) else "tp"."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    intermediate_size_per_partition: int
    tp_size: int
    tp_rank: int
    ep_size: int
    ep_rank: int
    local_num_experts: int
    expert_start: int
    reduce_results: bool
    renormalize: bool

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 params_dtype: Optional[torch.dtype] = None, reduce_results: bool = False,
                 renormalize: bool = True, use_grouped_topk: bool = False, num_expert_group: Optional[int] = None,
                 topk_group: Optional[int] = None, quant_config=None, tp_size: Optional[int] = None,
                 ep_size: Optional[int] = None, dp_size: Optional[int] = None, prefix: str = "",
                 custom_routing_function=None, scoring_func: str = "softmax", e_score_correction_bias=None,
                 apply_router_weight_on_input: bool = False, activation: str = "silu",
                 *, tp_rank: int = 0, ep_rank: int = 0):
        super().__init__()
        _check_quant(quant_config)
        if use_grouped_topk or custom_routing_function is not None or e_score_correction_bias is not None:
            raise NotImplementedError("fragkit FusedMoE: only plain softmax top-k routing is supported")
        if scoring_func != "softmax" or activation != "silu" or apply_router_weight_on_input:
            raise NotImplementedError("fragkit FusedMoE: only softmax scoring and SiLU experts are supported")
        if dp_size not in (None, 1):
            raise NotImplementedError("fragkit FusedMoE: data parallelism (dp_size > 1) is not supported")
        tp_size = 1 if tp_size is None else int(tp_size)
        ep_size = 1 if ep_size is None else int(ep_size)
        _check_rank("tp", tp_rank, tp_size)
        _check_rank("ep", ep_rank, ep_size)
        if ep_size > num_experts:
            raise ValueError("ep_size %d > num_experts %d" % (ep_size, num_experts))
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.intermediate_size_per_partition = divide(intermediate_size, tp_size,
                                                      "%s: intermediate_size" % _layer_name(self, prefix))
        self.tp_size = tp_size
        self.tp_rank = int(tp_rank)
        self.ep_size = ep_size
        self.ep_rank = int(ep_rank)
        base, rem = divmod(self.num_experts, ep_size)
        self.local_num_experts = base + (1 if self.ep_rank < rem else 0)
        self.expert_start = self.ep_rank * base + min(self.ep_rank, rem)
        self.reduce_results = bool(reduce_results)
        self.renormalize = bool(renormalize)
        dtype = _dtype(params_dtype)
        ip = self.intermediate_size_per_partition
        self.w13_weight = _new_param((self.local_num_experts, 2 * ip, self.hidden_size), dtype,
                                     1.0 / math.sqrt(self.hidden_size))
        self.w2_weight = _new_param((self.local_num_experts, self.hidden_size, ip), dtype,
                                    1.0 / math.sqrt(self.intermediate_size))

    def forward(self, hidden_states: Tensor, router_logits: Tensor) -> Tensor:
        orig_shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        logits = router_logits.reshape(-1, self.num_experts)
        probs = torch.softmax(logits.float(), dim=-1)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        ip = self.intermediate_size_per_partition
        out = torch.zeros_like(x)
        for i in range(self.local_num_experts):
            sel = topk_ids == (self.expert_start + i)
            tokens = torch.nonzero(sel.any(dim=-1)).squeeze(-1)
            # Skipping an idle expert is a data-dependent branch that torch.export cannot trace; the loop
            # body is exact for zero tokens too, so only TorchScript and eager runs skip.
            if torch.jit.is_scripting():
                if tokens.numel() == 0:
                    continue
            elif not torch.compiler.is_compiling():
                if tokens.numel() == 0:
                    continue
            weight = (topk_weights * sel.to(topk_weights.dtype)).sum(dim=-1).index_select(0, tokens)
            xe = x.index_select(0, tokens)
            gate_up = F.linear(xe, self.w13_weight[i])
            act = torch.ops.frag.silu_and_mul(gate_up)  # [gate | up] of width 2 * ip: the kit's one SiLU·mul
            ye = F.linear(act, self.w2_weight[i])
            out.index_add_(0, tokens, ye * weight.to(ye.dtype).unsqueeze(-1))
        if self.reduce_results and self.tp_size * self.ep_size > 1:
            if self.ep_size > 1:
                out = expert_parallel_all_reduce(out)
            else:
                out = tensor_model_parallel_all_reduce(out)
        return out.reshape(orig_shape)

    def rank_slice(self, name: str, full) -> Tensor:
        """w13 [E, 2I, H] (rows [gate | up] per expert) and w2 [E, H, I]: this rank's experts, and of each
        its intermediate slice (of gate and of up)."""
        e0, ne = self.expert_start, self.local_num_experts
        ip, r, inter = self.intermediate_size_per_partition, self.tp_rank, self.intermediate_size
        if name == "w2_weight":
            return full[e0:e0 + ne, :, r * ip:(r + 1) * ip]
        if ip == inter:
            return full[e0:e0 + ne]
        return torch.cat([full[e0:e0 + ne, r * ip:(r + 1) * ip], full[e0:e0 + ne, inter + r * ip:inter + (r + 1) * ip]],
                         dim=1)

    def load_full_weights(self, full: "FusedMoE") -> None:
        _load_by_rank_slice(self, full, ["num_experts", "top_k", "hidden_size", "intermediate_size"])

    def extra_repr(self) -> str:
        return "E=%d, top_k=%d, H=%d, I=%d, I_p=%d, tp=%d/%d, ep=%d/%d, experts=[%d, %d)" % (
            self.num_experts, self.top_k, self.hidden_size, self.intermediate_size,
            self.intermediate_size_per_partition, self.tp_rank, self.tp_size, self.ep_rank, self.ep_size,
            self.expert_start, self.expert_start + self.local_num_experts)


# Layer classes whose weights export loads with ``load_full_weights`` (subclasses included).
KIT_LAYERS = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
              LogitsProcessor, FusedMoE)
