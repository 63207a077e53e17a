"""Tiny reference models built from the kit's layers plus ordinary scriptable torch modules.

Module names follow vLLM / Hugging Face (model.embed_tokens, model.layers.N.self_attn.qkv_proj, ...).
``forward(input_ids int64 [B, T]) -> logits [B, T, org_vocab]`` (gathered, padding dropped).
``LlamaConfig(mlp="plain")`` swaps Llama's gated MLP for a GPT-NeoX style one (``PlainMLP``: up_proj, GELU,
down_proj), whose up_proj output is a plain column shard.
"""
import functools
import json
import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from .distributed import tensor_model_parallel_all_reduce
from .layers import (DEFAULT_VOCAB_PADDING_SIZE, 
    ColumnParallelLinear,
    FusedMoE,
    LogitsProcessor,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    params_on_meta,
)


# --------------------------------------------------------------------------------------------------------
# configs

@dataclass
class LlamaConfig:
    vocab_size: int = 1000  # deliberately not a multiple of 64
    hidden_size: int = 64
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: Optional[int] = 8
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 512
    attention_bias: bool = False  # q/k/v projection bias (Qwen2; Llama's attention_bias sets o_proj_bias too)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # Rotary frequencies: None (base ** (-2i/d)) or a dict as rope_inv_freq takes it.
    rope_scaling: Optional[dict] = None
    dtype: torch.dtype = torch.float32
    # "gated": gate_up_proj (MergedColumnParallelLinear) -> SiLU-and-mul -> down_proj (Llama's MLP).
    # "plain": up_proj (ColumnParallelLinear, gather_output=False) -> GELU -> down_proj (GPT-NeoX / GPT-2 style).
    mlp: str = "gated"
    # The embedding's and LM head's padding_size: the vocabulary is padded to a multiple of it (vLLM's default 64).
    vocab_padding_size: int = 64
    # The LM head is the embedding (one parameter, one record in a rank file).
    tie_word_embeddings: bool = False


LLAMA_MLP_KINDS = ("gated", "plain")


@dataclass
class Qwen2MoeConfig:
    vocab_size: int = 1000
    hidden_size: int = 64
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: Optional[int] = None  # hidden_size // num_attention_heads
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 64
    intermediate_size: int = 128  # dense MLP of mlp_only_layers
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)
    num_hidden_layers: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 512
    rope_scaling: Optional[dict] = None
    dtype: torch.dtype = torch.float32
    tie_word_embeddings: bool = False


@dataclass
class MixtralConfig:
    """Mixtral: Llama attention (no biases) and a sparse MoE block of SiLU experts, all-reduced inside."""
    vocab_size: int = 1000
    hidden_size: int = 64
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: Optional[int] = None
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    intermediate_size: int = 32
    num_hidden_layers: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 512
    rope_scaling: Optional[dict] = None
    dtype: torch.dtype = torch.float32
    tie_word_embeddings: bool = False


def _head_dim(config) -> int:
    return config.head_dim if config.head_dim else config.hidden_size // config.num_attention_heads


ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(rotary_dim: int, base: float, scaling: Optional[dict] = None) -> Tensor:
    """Rotary inverse frequencies [rotary_dim / 2], float32, as Hugging Face computes them.

    ``scaling``: None or {"rope_type": "default"}; {"rope_type": "linear", "factor": f} (positions / f);
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    (Llama 3.1's smooth wavelength-dependent scaling); {"rope_type": "freq_factors", "factors": [...]}
    (GGUF's rope_freqs tensor: each frequency divided by its factor). Other types are refused by name."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError("rope frequency factors: %d given, %d rotary frequencies"
                             % (factors.numel(), inv_freq.numel()))
        return inv_freq / factors
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError("rope scaling of type %r is not supported (supported: %s)"
                              % (kind, ", ".join(ROPE_TYPES)))


# --------------------------------------------------------------------------------------------------------
# ordinary (replicated) modules

class RMSNorm(nn.Module):
    hidden_size: int
    variance_epsilon: float

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = float(eps)
        dtype = params_dtype or torch.get_default_dtype()
        if params_on_meta():  # a rank module a streaming import fills (layers.build_on_meta)
            self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device="meta"), requires_grad=False)
            return
        w = torch.ones(hidden_size, dtype=dtype)
        with torch.no_grad():
            w.add_(0.1 * torch.randn(hidden_size).to(w.dtype))  # not all ones, so copying them is observable
        self.weight = nn.Parameter(w, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        # One op (fragkit/ops.py, runtime/layer_ops.cpp): fused on GPUs, the same kernel in every graph.
        return torch.ops.frag.rms_norm(x, self.weight, self.variance_epsilon)


class SiluAndMul(nn.Module):
    """[g | u] -> silu(g) * u."""

    _fragkit_stable_annotations: int  # a class-level __annotations__ keeps TorchScript types stable

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.frag.silu_and_mul(x)


def cos_sin_table(rotary_dim: int, base: float, max_positions: int, scaling: Optional[dict] = None) -> Tensor:
    """[max_positions, rotary_dim] float32: cos | sin of each position's angles. One tensor per distinct
    argument and default device, shared by every layer that asks (a rank file then stores it once: one
    record, not one per layer; an 8B model's 128k-position table is 64 MB)."""
    key = (rotary_dim, float(base), max_positions, json.dumps(scaling, sort_keys=True, default=str),
           str(torch.get_default_device()))
    table = _COS_SIN_TABLES.get(key)
    if table is None and torch.get_default_device().type == "meta":  # shapes only: the frequencies checked on
        with torch.device("cpu"):                 # the CPU (meta arithmetic would import torch._dynamo, ~1.5 s)
            inv_freq = rope_inv_freq(rotary_dim, base, scaling)
        table = torch.empty(max_positions, 2 * inv_freq.numel(), device="meta")
    elif table is None:
        inv_freq = rope_inv_freq(rotary_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    if key not in _COS_SIN_TABLES:
        if len(_COS_SIN_TABLES) >= 4:  # a few: a process builds one model shape at a time (on meta and not)
            _COS_SIN_TABLES.clear()
        _COS_SIN_TABLES[key] = table
    return table


_COS_SIN_TABLES: dict = {}


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, neox style (rotate halves) or GPT-J style (interleaved pairs)."""

    head_size: int
    rotary_dim: int
    max_position_embeddings: int
    base: float
    is_neox_style: bool

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool = True, scaling: Optional[dict] = None):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = float(base)
        self.is_neox_style = is_neox_style
        self.register_buffer("cos_sin_cache", cos_sin_table(rotary_dim, self.base, max_position_embeddings, scaling),
                             persistent=False)

    def forward(self, positions: Tensor, query: Tensor, key: Tensor) -> Tuple[Tensor, Tensor]:
        # A shape check (no device sync): past the cache, index_select fails deep inside, or asserts on a GPU.
        if positions.size(-1) > self.max_position_embeddings:
            raise ValueError("a sequence of {} tokens is longer than the model's max_position_embeddings ({})"
                             .format(positions.size(-1), self.max_position_embeddings))
        # positions [T] (one sequence) or [B, T] (each row its own, as a KV cache's decode steps give them);
        # query/key [B, T, n * head_size], rotated out of place (q and k are views of the qkv value).
        return torch.ops.frag.rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_size,
                                               self.rotary_dim, self.is_neox_style)


class Attention(nn.Module):
    """Causal GQA attention over this rank's heads: q [B, T, nh*hs], k/v [B, T, nkv*hs] -> [B, T, nh*hs].

    With a KV cache (``kv_cache`` [layers, 2, max_batch, nkv, max_len, hs], this rank's kv heads, allocated
    by ``new_kv_cache``) the new k/v are written at each row's ``positions`` [B, T] (row b's token at position
    p lives in slot p) and q attends to the slots at or before its own position, over the first ``cache_len``
    slots. Rows are independent: a row's slots past its own length hold stale values that the mask hides."""

    num_heads: int
    head_size: int
    scale: float
    num_kv_heads: int
    layer_idx: int

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, layer_idx: int = 0):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.layer_idx = int(layer_idx)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, positions: Optional[Tensor] = None,
                kv_cache: Optional[Tensor] = None, cache_len: int = 0) -> Tensor:
        if kv_cache is not None and positions is not None:
            return self._cached(q, k, v, positions, kv_cache, cache_len).to(q.dtype)
        b = q.shape[0]
        t = q.shape[1]
        qh = q.reshape(b, t, self.num_heads, self.head_size).transpose(1, 2).float()
        kh = k.reshape(b, t, self.num_kv_heads, self.head_size).transpose(1, 2).float()
        vh = v.reshape(b, t, self.num_kv_heads, -1).transpose(1, 2).float()
        if self.num_heads != self.num_kv_heads:
            rep = self.num_heads // self.num_kv_heads
            kh = kh.repeat_interleave(rep, dim=1)
            vh = vh.repeat_interleave(rep, dim=1)
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * self.scale
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), vh)
        return out.transpose(1, 2).reshape(b, t, -1).to(q.dtype)

    def _cached(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, kv_cache: Tensor,
                cache_len: int) -> Tensor:
        b = q.shape[0]
        t = q.shape[1]
        k_cache = kv_cache[self.layer_idx, 0]  # [max_batch, kv heads, max_len, head size]
        v_cache = kv_cache[self.layer_idx, 1]
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(b, t)
        rows = torch.arange(b, dtype=torch.long, device=positions.device).unsqueeze(1).expand(b, t)
        index = torch.jit.annotate(List[Optional[Tensor]], [rows, positions])
        # Written through [B, S, nkv, hs] views: the new tokens land in their slots of every kv head.
        k_cache.transpose(1, 2).index_put_(index, k.reshape(b, t, self.num_kv_heads, self.head_size).to(k_cache.dtype))
        v_cache.transpose(1, 2).index_put_(index, v.reshape(b, t, self.num_kv_heads, -1).to(v_cache.dtype))
        n = cache_len if cache_len > 0 else k_cache.size(2)
        # Attention in the cache's dtype over views of it (no float32 copy of the cache: at batch 32 that copy
        # was most of a decode step on a GPU); SDPA's kernels accumulate in float32 themselves.
        kh = k_cache[:b, :, :n]  # [B, nkv, n, hs]
        vh = v_cache[:b, :, :n]
        # GQA without copying the cache: the rep query heads of a kv head are stacked on the query dim
        # (SDPA's own enable_gqa would repeat the cache's heads on some backends).
        rep = self.num_heads // self.num_kv_heads
        qg = q.reshape(b, t, self.num_heads, self.head_size).transpose(1, 2).to(k_cache.dtype)
        qg = qg.reshape(b, self.num_kv_heads, rep * t, self.head_size)
        # True where a query may attend: the slots at or before its own position (its row's real tokens; a
        # pad or a stale slot is after it). Every query sees at least slot 0, so no row of the mask is empty.
        slots = torch.arange(n, dtype=torch.long, device=positions.device)
        visible = slots.view(1, 1, n) <= positions.unsqueeze(-1)  # [B, t, n]
        mask = visible.unsqueeze(1).expand(b, rep, t, n).reshape(b, 1, rep * t, n)
        out = torch.nn.functional.scaled_dot_product_attention(qg, kh, vh, attn_mask=mask, scale=self.scale)
        # reshape, not view: CUDA's SDPA kernels may return [B, nkv, rep*t, hs] with another layout
        return out.reshape(b, self.num_heads, t, -1).transpose(1, 2).reshape(b, t, -1)


# --------------------------------------------------------------------------------------------------------
# Llama

class LlamaMLP(nn.Module):
    _fragkit_stable_annotations: int

    def __init__(self, hidden_size: int, intermediate_size: int, tp_rank: int, tp_size: int,
                 params_dtype: Optional[torch.dtype] = None, reduce_results: bool = True, prefix: str = "",
                 bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       params_dtype=params_dtype, prefix=prefix + ".gate_up_proj",
                                                       tp_rank=tp_rank, tp_size=tp_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, params_dtype=params_dtype,
                                           reduce_results=reduce_results, prefix=prefix + ".down_proj",
                                           tp_rank=tp_rank, tp_size=tp_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:
        gate_up, _ = self.gate_up_proj(x)
        x = self.act_fn(gate_up)
        x, _ = self.down_proj(x)
        return x


class PlainMLP(nn.Module):
    """up_proj (column, output stays S(-1)) -> GELU -> down_proj (row, input S(-1), all-reduced): GPT-NeoX style.

    The value between the two layers is a plain shard of the whole activation on the last dim."""

    _fragkit_stable_annotations: int

    def __init__(self, hidden_size: int, intermediate_size: int, tp_rank: int, tp_size: int,
                 params_dtype: Optional[torch.dtype] = None, reduce_results: bool = True, prefix: str = ""):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=False, gather_output=False,
                                            params_dtype=params_dtype, prefix=prefix + ".up_proj",
                                            tp_rank=tp_rank, tp_size=tp_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, input_is_parallel=True,
                                           params_dtype=params_dtype, reduce_results=reduce_results,
                                           prefix=prefix + ".down_proj", tp_rank=tp_rank, tp_size=tp_size)
        self.act_fn = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        up, _ = self.up_proj(x)
        x = self.act_fn(up)
        x, _ = self.down_proj(x)
        return x


class LlamaAttention(nn.Module):
    hidden_size: int
    total_num_heads: int
    num_heads: int
    total_num_kv_heads: int
    num_kv_heads: int
    head_dim: int
    q_size: int
    kv_size: int
    scaling: float

    def __init__(self, config, tp_rank: int, tp_size: int, bias: bool = False, prefix: str = ""):
        super().__init__()
        dtype = config.dtype
        self.hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.num_heads = self.total_num_heads // tp_size
        self.total_num_kv_heads = config.num_key_value_heads
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = _head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(self.hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, bias=bias, params_dtype=dtype,
                                          prefix=prefix + ".qkv_proj", tp_rank=tp_rank, tp_size=tp_size)
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, self.hidden_size,
                                        bias=getattr(config, "o_proj_bias", False), params_dtype=dtype,
                                        prefix=prefix + ".o_proj", tp_rank=tp_rank, tp_size=tp_size)
        self.rotary_emb = RotaryEmbedding(self.head_dim, self.head_dim, config.max_position_embeddings,
                                          config.rope_theta, is_neox_style=True,
                                          scaling=getattr(config, "rope_scaling", None))
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads,
                              layer_idx=_layer_index(prefix))

    def forward(self, positions: Tensor, hidden_states: Tensor, kv_cache: Optional[Tensor] = None,
                cache_len: int = 0) -> Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q = qkv[..., :self.q_size]
        k = qkv[..., self.q_size:self.q_size + self.kv_size]
        v = qkv[..., self.q_size + self.kv_size:]
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v, positions, kv_cache, cache_len)
        output, _ = self.o_proj(attn_output)
        return output


class LlamaDecoderLayer(nn.Module):
    hidden_size: int

    def __init__(self, config, tp_rank: int, tp_size: int, prefix: str = ""):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config, tp_rank, tp_size, bias=config.attention_bias,
                                        prefix=prefix + ".self_attn")
        mlp_kind = getattr(config, "mlp", "gated")
        if mlp_kind not in LLAMA_MLP_KINDS:
            raise ValueError("unknown Llama MLP kind %r (one of %s)" % (mlp_kind, ", ".join(LLAMA_MLP_KINDS)))
        if mlp_kind == "plain":
            self.mlp = PlainMLP(config.hidden_size, config.intermediate_size, tp_rank, tp_size,
                                params_dtype=config.dtype, prefix=prefix + ".mlp")
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, tp_rank, tp_size,
                                params_dtype=config.dtype, prefix=prefix + ".mlp",
                                bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def forward(self, positions: Tensor, hidden_states: Tensor, kv_cache: Optional[Tensor] = None,
                cache_len: int = 0) -> Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, cache_len)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


def _layer_index(prefix: str) -> int:
    """The N of "model.layers.N.self_attn": a layer's slot in the KV cache."""
    parts = prefix.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() else 0


def _vocab_padding(config) -> int:
    """The config's vocab padding_size; configs without the field pad as vLLM does by default."""
    return int(getattr(config, "vocab_padding_size", DEFAULT_VOCAB_PADDING_SIZE))


class LlamaModel(nn.Module):
    vocab_size: int

    def __init__(self, config, tp_rank: int, tp_size: int, layer_cls=LlamaDecoderLayer, prefix: str = "model"):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, params_dtype=config.dtype,
                                                   padding_size=_vocab_padding(config),
                                                   prefix=prefix + ".embed_tokens", tp_rank=tp_rank, tp_size=tp_size)
        self.layers = nn.ModuleList([layer_cls(config, tp_rank, tp_size, prefix="%s.layers.%d" % (prefix, i))
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def forward(self, input_ids: Tensor, positions: Optional[Tensor] = None, kv_cache: Optional[Tensor] = None,
                cache_len: int = 0) -> Tensor:
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], dtype=torch.long, device=input_ids.device)
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, kv_cache, cache_len)
        return self.norm(hidden_states)


class _CausalLMBase(nn.Module):
    tp_size: int
    tp_rank: int

    def _init_head(self, config, tp_rank: int, tp_size: int) -> None:
        self.tp_size = int(tp_size)
        self.tp_rank = int(tp_rank)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=config.dtype,
                                      org_num_embeddings=config.vocab_size, padding_size=_vocab_padding(config),
                                      prefix="lm_head",
                                      tp_rank=tp_rank, tp_size=tp_size)
        self.logits_processor = LogitsProcessor(config.vocab_size, config.vocab_size, tp_rank=tp_rank,
                                                tp_size=tp_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Optional[Tensor] = None, kv_cache: Optional[Tensor] = None,
                cache_len: int = 0) -> Tensor:
        """Logits [B, T, vocab]. Without a cache: the whole sequence (positions 0..T-1). With one
        (``new_kv_cache``): ``positions`` [B, T] places each row's new tokens; see ``Attention``."""
        hidden_states = self.model(input_ids, positions, kv_cache, cache_len)
        return self.logits_processor(self.lm_head(hidden_states))

    @torch.jit.export
    def kv_cache_shape(self, max_batch: int, max_len: int) -> List[int]:
        """[layers, 2, max_batch, this rank's kv heads, max_len, head size]: what forward's kv_cache takes."""
        attn = self.model.layers[0].self_attn
        return [len(self.model.layers), 2, max_batch, attn.num_kv_heads, max_len, attn.head_dim]

    @torch.jit.export
    def new_kv_cache(self, max_batch: int, max_len: int) -> Tensor:
        """A zeroed KV cache for ``max_batch`` rows of ``max_len`` tokens, on the model's device and dtype."""
        weight = self.lm_head.weight
        return torch.zeros(self.kv_cache_shape(max_batch, max_len), dtype=weight.dtype, device=weight.device)

    @torch.jit.export
    def max_positions(self) -> int:
        """The longest sequence the rotary table covers."""
        return self.model.layers[0].self_attn.rotary_emb.max_position_embeddings


class LlamaForCausalLM(_CausalLMBase):
    tp_size: int
    tp_rank: int

    def __init__(self, config: Optional[LlamaConfig] = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        config = config or LlamaConfig()
        self.model = LlamaModel(config, tp_rank, tp_size, LlamaDecoderLayer)
        self._init_head(config, tp_rank, tp_size)


# --------------------------------------------------------------------------------------------------------
# The MoE decoder families (Qwen2-MoE, Mixtral): one base; a family subclasses it with what differs.

def _expert_parallelism(tp_rank: int, tp_size: int, enable_expert_parallel: bool) -> dict:
    """FusedMoE's split: experts whole by block over the ranks (EP), or each expert's width split (TP)."""
    if enable_expert_parallel:
        return dict(tp_size=1, tp_rank=0, ep_size=tp_size, ep_rank=tp_rank)
    return dict(tp_size=tp_size, tp_rank=tp_rank, ep_size=1, ep_rank=0)


class MoeDecoderLayer(nn.Module):
    """Llama's residual stream around attention and a feed-forward that may be sparse (experts).

    A family overrides ``attention`` (its q/k/v biases) and ``feed_forward`` (its sparse block, which layers
    have one, the dense MLP of the others). The feed-forward is ``self.mlp``, as most checkpoints name it; a
    family that names it otherwise (Mixtral) sets ``feed_forward_name`` and its own ``forward``."""
    hidden_size: int
    feed_forward_name = "mlp"

    def __init__(self, config, tp_rank: int, tp_size: int, prefix: str = "", enable_expert_parallel: bool = False):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = self.attention(config, tp_rank, tp_size, prefix + ".self_attn")
        name = self.feed_forward_name
        setattr(self, name, self.feed_forward(config, tp_rank, tp_size, prefix, prefix + "." + name,
                                              enable_expert_parallel))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def attention(self, config, tp_rank: int, tp_size: int, prefix: str) -> nn.Module:
        return LlamaAttention(config, tp_rank, tp_size, bias=False, prefix=prefix)

    def feed_forward(self, config, tp_rank: int, tp_size: int, layer_prefix: str, prefix: str,
                     enable_expert_parallel: bool) -> nn.Module:
        raise NotImplementedError

    def forward(self, positions: Tensor, hidden_states: Tensor, kv_cache: Optional[Tensor] = None,
                cache_len: int = 0) -> Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, cache_len)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class MoeForCausalLM(_CausalLMBase):
    """A MoE family's model: Llama's embedding, layers of ``layer_cls`` and head; ``config_cls()`` when no
    config is given. Experts are split by block over the ranks with ``enable_expert_parallel``."""
    tp_size: int
    tp_rank: int
    enable_expert_parallel: bool
    config_cls = None
    layer_cls = MoeDecoderLayer

    def __init__(self, config=None, tp_rank: int = 0, tp_size: int = 1, enable_expert_parallel: bool = False):
        super().__init__()
        config = config or self.config_cls()
        self.enable_expert_parallel = bool(enable_expert_parallel)
        layer_cls = functools.partial(type(self).layer_cls, enable_expert_parallel=enable_expert_parallel)
        self.model = LlamaModel(config, tp_rank, tp_size, layer_cls)
        self._init_head(config, tp_rank, tp_size)


# --------------------------------------------------------------------------------------------------------
# Qwen2-MoE

class Qwen2MoeMLP(LlamaMLP):
    _fragkit_stable_annotations: int


class Qwen2MoeSparseMoeBlock(nn.Module):
    tp_size: int

    def __init__(self, config, tp_rank: int, tp_size: int, enable_expert_parallel: bool = False,
                 prefix: str = ""):
        super().__init__()
        self.tp_size = int(tp_size)
        if tp_size > config.num_experts:
            raise ValueError("tensor parallel size %d is greater than the number of experts %d"
                             % (tp_size, config.num_experts))
        self.experts = FusedMoE(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                                hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size,
                                params_dtype=config.dtype, reduce_results=False,
                                renormalize=config.norm_topk_prob, prefix=prefix + ".experts",
                                **_expert_parallelism(tp_rank, tp_size, enable_expert_parallel))
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False, params_dtype=config.dtype,
                                     prefix=prefix + ".gate", tp_rank=tp_rank, tp_size=tp_size)
        self.shared_expert = Qwen2MoeMLP(config.hidden_size, config.shared_expert_intermediate_size, tp_rank,
                                         tp_size, params_dtype=config.dtype, reduce_results=False,
                                         prefix=prefix + ".shared_expert")
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False, params_dtype=config.dtype,
                                                   prefix=prefix + ".shared_expert_gate",
                                                   tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, hidden_states: Tensor) -> Tensor:
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, orig_shape[-1])
        shared_output = self.shared_expert(hidden_states)
        shared_gate, _ = self.shared_expert_gate(hidden_states)
        shared_output = torch.sigmoid(shared_gate) * shared_output
        router_logits, _ = self.gate(hidden_states)
        final_hidden_states = self.experts(hidden_states, router_logits)
        final_hidden_states = final_hidden_states + shared_output
        if self.tp_size > 1:
            final_hidden_states = tensor_model_parallel_all_reduce(final_hidden_states)
        return final_hidden_states.reshape(orig_shape)


class Qwen2MoeAttention(LlamaAttention):
    hidden_size: int


class Qwen2MoeDecoderLayer(MoeDecoderLayer):
    """q/k/v biases; a sparse block every decoder_sparse_step layers except mlp_only_layers."""

    def attention(self, config, tp_rank: int, tp_size: int, prefix: str) -> nn.Module:
        return Qwen2MoeAttention(config, tp_rank, tp_size, bias=True, prefix=prefix)

    def feed_forward(self, config, tp_rank: int, tp_size: int, layer_prefix: str, prefix: str,
                     enable_expert_parallel: bool) -> nn.Module:
        layer_idx = int(layer_prefix.split(".")[-1]) if layer_prefix else 0
        sparse = (layer_idx not in config.mlp_only_layers and config.num_experts > 0
                  and (layer_idx + 1) % config.decoder_sparse_step == 0)
        if sparse:
            return Qwen2MoeSparseMoeBlock(config, tp_rank, tp_size, enable_expert_parallel, prefix=prefix)
        return Qwen2MoeMLP(config.hidden_size, config.intermediate_size, tp_rank, tp_size,
                           params_dtype=config.dtype, prefix=prefix)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    config_cls = Qwen2MoeConfig
    layer_cls = Qwen2MoeDecoderLayer


# --------------------------------------------------------------------------------------------------------
# Qwen2 (dense): Llama with q/k/v biases (LlamaConfig.attention_bias=True)

class Qwen2ForCausalLM(LlamaForCausalLM):
    tp_size: int
    tp_rank: int


# --------------------------------------------------------------------------------------------------------
# Mixtral

class MixtralSparseMoeBlock(nn.Module):
    """Router (replicated) + FusedMoE that all-reduces itself (vLLM's Mixtral: reduce_results=True)."""

    _fragkit_stable_annotations: int

    def __init__(self, config, tp_rank: int, tp_size: int, enable_expert_parallel: bool = False,
                 prefix: str = ""):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=False,
                                     params_dtype=config.dtype, prefix=prefix + ".gate",
                                     tp_rank=tp_rank, tp_size=tp_size)
        self.experts = FusedMoE(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                                hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                                params_dtype=config.dtype, reduce_results=True, renormalize=True,
                                prefix=prefix + ".experts",
                                **_expert_parallelism(tp_rank, tp_size, enable_expert_parallel))

    def forward(self, hidden_states: Tensor) -> Tensor:
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, orig_shape[-1])
        router_logits, _ = self.gate(hidden_states)
        return self.experts(hidden_states, router_logits).reshape(orig_shape)


class MixtralDecoderLayer(MoeDecoderLayer):
    """Llama attention; every layer sparse, under the checkpoints' name block_sparse_moe."""
    feed_forward_name = "block_sparse_moe"

    def feed_forward(self, config, tp_rank: int, tp_size: int, layer_prefix: str, prefix: str,
                     enable_expert_parallel: bool) -> nn.Module:
        return MixtralSparseMoeBlock(config, tp_rank, tp_size, enable_expert_parallel, prefix=prefix)

    def forward(self, positions: Tensor, hidden_states: Tensor, kv_cache: Optional[Tensor] = None,
                cache_len: int = 0) -> Tensor:
        # The base's, with the block's own name: TorchScript resolves attributes by name.
        residual = hidden_states
        hidden_states = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, cache_len)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.block_sparse_moe(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class MixtralForCausalLM(MoeForCausalLM):
    config_cls = MixtralConfig
    layer_cls = MixtralDecoderLayer


# --------------------------------------------------------------------------------------------------------
# builders for fragkit.export.export

def llama_builder(config: Optional[LlamaConfig] = None):
    config = config or LlamaConfig()
    return lambda tp_rank, tp_size: LlamaForCausalLM(config, tp_rank, tp_size)


def qwen2_moe_builder(config: Optional[Qwen2MoeConfig] = None, enable_expert_parallel: bool = False):
    config = config or Qwen2MoeConfig()
    return lambda tp_rank, tp_size: Qwen2MoeForCausalLM(config, tp_rank, tp_size, enable_expert_parallel)


def qwen2_builder(config: Optional[LlamaConfig] = None):
    config = config or LlamaConfig(attention_bias=True)
    return lambda tp_rank, tp_size: Qwen2ForCausalLM(config, tp_rank, tp_size)


def mixtral_builder(config: Optional[MixtralConfig] = None, enable_expert_parallel: bool = False):
    config = config or MixtralConfig()
    return lambda tp_rank, tp_size: MixtralForCausalLM(config, tp_rank, tp_size, enable_expert_parallel)
