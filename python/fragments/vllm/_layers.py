"""vLLM's parallel layers as fragments' classification sees them.

Each vLLM layer module is described by its kind and config (vLLM's own attribute names, which are the
names fragments' classification reads: tp_size, output_sizes, total_num_kv_heads, …) and handed to the
C++ classification (passes::classify_parallel_layers through fragments._C.classify_layers): the same
rules and table as the TorchScript and .pt2 paths. Nothing here decides a layout.

vLLM-specific facts kept here (fragment-rules.md):
- `QKVParallelLinear.output_size` counts replicated kv heads: the classification reads head counts instead.
- vLLM's `LogitsProcessor` takes hidden states (whole) and computes and gathers the logits itself, so it
  is not the kit's LogitsProcessor (whose input is the vocab shard): its input and output are whole.
  The vocab-shard rule lives on `ParallelLMHead` (whose forward vLLM never calls).
- FusedMoE (vLLM 0.24: a MoE runner module): its output is whole when the layer reduces, else a partial
  sum over tp·ep.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

import torch.nn as nn

from .. import _C
from . import _vllm_api


def _kind(module: nn.Module) -> Optional[str]:
    """The known layer kind of a vLLM module (by class, most derived first), or None."""
    from vllm.model_executor.layers import linear, vocab_parallel_embedding as vpe
    for cls, kind in ((linear.QKVParallelLinear, "QKVParallelLinear"),
                      (linear.MergedColumnParallelLinear, "MergedColumnParallelLinear"),
                      (linear.ColumnParallelLinear, "ColumnParallelLinear"),
                      (linear.RowParallelLinear, "RowParallelLinear"),
                      (linear.ReplicatedLinear, "ReplicatedLinear"),
                      (vpe.ParallelLMHead, "ParallelLMHead"),
                      (vpe.VocabParallelEmbedding, "VocabParallelEmbedding")):
        if isinstance(module, cls):
            return kind
    if _is_fused_moe(module):
        return "FusedMoE"
    return None


def _is_fused_moe(module: nn.Module) -> bool:
    """vLLM 0.24's FusedMoE(...) is a factory returning a MoE runner module; older releases had a class."""
    cls = _vllm_api.fused_moe_class()
    return isinstance(cls, type) and isinstance(module, cls)


_ATTRIBUTES = {
    "ColumnParallelLinear": ("tp_size", "tp_rank", "output_size", "gather_output"),
    "MergedColumnParallelLinear": ("tp_size", "tp_rank", "output_size", "output_sizes", "gather_output"),
    "QKVParallelLinear": ("tp_size", "tp_rank", "gather_output", "total_num_heads", "total_num_kv_heads",
                          "head_size", "v_head_size"),
    "RowParallelLinear": ("tp_size", "tp_rank", "input_size", "output_size", "input_is_parallel",
                          "reduce_results"),
    "ReplicatedLinear": ("tp_size", "tp_rank"),
    "VocabParallelEmbedding": ("tp_size", "num_embeddings_padded", "org_vocab_size"),
    "ParallelLMHead": ("tp_size", "num_embeddings_padded", "org_vocab_size"),
}


def _moe_attributes(module: nn.Module) -> Dict[str, object]:
    """FusedMoE's config from vLLM 0.24's MoE runner (its FusedMoEConfig and parallel config). The runner
    all-reduces routed plus shared output itself unless sequence parallel: then its output is whole."""
    cfg = getattr(module, "moe_config", None)
    par = getattr(cfg, "moe_parallel_config", None) if cfg is not None else None
    if cfg is None or par is None:
        raise RuntimeError(f"fragments: this vLLM's FusedMoE ({type(module).__name__}) has no moe_config; "
                           "its layout cannot be read")
    if getattr(par, "dp_size", 1) != 1 or getattr(cfg, "is_sequence_parallel", False):
        raise RuntimeError("fragments: FusedMoE with data or sequence parallelism is not supported "
                           f"(dp_size {par.dp_size}); run with data_parallel_size 1")
    return {"tp_size": int(par.tp_size), "tp_rank": int(par.tp_rank), "ep_size": int(par.ep_size),
            "ep_rank": int(par.ep_rank), "intermediate_size": int(cfg.intermediate_size),
            "hidden_size": int(cfg.hidden_dim), "reduce_results": True}


def describe(model: nn.Module) -> List[dict]:
    """Every known layer of `model` in pre-order, as _C.classify_layers takes them."""
    described = []
    for path, module in model.named_modules():
        kind = _kind(module)
        if kind is None:
            continue
        if kind == "FusedMoE":
            attributes = _moe_attributes(module)
            parameters = {}
        else:
            attributes = {}
            for name in _ATTRIBUTES[kind]:
                value = getattr(module, name)
                attributes[name] = [int(v) for v in value] if isinstance(value, (list, tuple)) else value
            if "tp_rank" not in attributes and kind != "ReplicatedLinear":
                from vllm.distributed import get_tensor_model_parallel_rank
                attributes["tp_rank"] = get_tensor_model_parallel_rank() if attributes["tp_size"] > 1 else 0
            weight = getattr(module, "weight", None)
            parameters = {"weight": list(weight.shape)} if weight is not None and weight.dim() == 2 else {}
        described.append({"path": path, "class": kind, "attributes": attributes, "parameters": parameters})
    return described


def classify(model: nn.Module, source: str) -> dict:
    """The fragment table of a vLLM model (fragments.table/1 JSON, as `frag inspect` prints it)."""
    return json.loads(_C.classify_layers(describe(model), source))


def qkv_attributes(described: List[dict]) -> Dict[str, Dict[str, int]]:
    """Integer attributes of the QKV layers, for the head layouts ("segment"/"heads" in plans)."""
    return {d["path"]: {k: int(v) for k, v in d["attributes"].items() if isinstance(v, int) and not isinstance(v, bool)}
            for d in described if d["class"] == "QKVParallelLinear"}


def locations(model: nn.Module, table: dict) -> Tuple[Dict[str, dict], Dict[str, str]]:
    """Which module boundaries a plan may name, at this model's tp size.

    Returns (fragmented, refused): fragmented maps a location to its rule (JSON) from the table; refused
    maps a location to the reason no rank holds its value whole. Every other `<module>.input/.output` is
    whole. Rank-local values are those of modules inside a block that holds a column layer with a
    fragmented output (attention internals, q/k norms, rotary, act_fn) and of a container whose value is
    a partial sum (a shared expert whose down projection does not reduce).
    """
    fragmented: Dict[str, dict] = {}
    refused: Dict[str, str] = {}
    layers = {entry["path"]: entry for entry in table.get("layers", [])}
    for path, entry in layers.items():
        for side in ("input", "output"):
            if entry.get(side):
                fragmented[f"{path}.{side}"] = entry[side]["rule"]
    if table.get("tp_size", 1) <= 1:
        return fragmented, refused
    modules = dict(model.named_modules())
    sharded_parents = set()
    for path, entry in layers.items():
        if entry.get("output") and entry["kind"] in ("ColumnParallelLinear", "MergedColumnParallelLinear",
                                                      "QKVParallelLinear"):
            sharded_parents.add(path.rsplit(".", 1)[0] if "." in path else "")
    for path in modules:
        if path in layers or not path:
            continue
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if parent in sharded_parents:
            hint = ""
            siblings = [p for p in layers if p.startswith(parent + ".") and layers[p]["kind"] == "RowParallelLinear"]
            if siblings:
                hint = f"; its whole counterpart after the block's gather is {siblings[0]}.input"
            reason = (f"rank-local value: {path} runs between a column-parallel layer and a row-parallel layer "
                      f"of {parent or 'the model'}, so every rank holds its own piece and no fragment rule "
                      f"covers it{hint}")
            for side in ("input", "output"):
                refused[f"{path}.{side}"] = reason
        # A container whose last row layer leaves a partial sum: its output is partial too.
        for p, entry in layers.items():
            if p.startswith(path + ".") and entry.get("output") and entry["output"]["rule"]["kind"] == "partial_sum" \
                    and p.rsplit(".", 1)[0] == path:
                refused[f"{path}.output"] = (f"partial sum: {path}'s output is {p}'s (reduce_results=False), summed "
                                            f"later by the enclosing block; read {p}.output (gathered by "
                                            f"all-reduce) instead")
    return fragmented, refused


def widths(modules: Dict[str, nn.Module], hidden_size: int) -> Dict[str, int]:
    """The whole width (last dim) of the locations whose width the module's config fixes, so a plan's value
    that cannot fit is refused at submission (_plan.py): linear layers' inputs and outputs (vLLM's
    input_size/output_size are whole; q|k|v from head counts, since output_size counts replicated kv heads),
    the embedding's and the logits' outputs, norms, and decoder layers' outputs (the hidden state; vLLM's
    layers return it first). Other locations are left out: a value there is checked when it runs."""
    from vllm.model_executor.layers import layernorm, linear, logits_processor, vocab_parallel_embedding as vpe
    out: Dict[str, int] = {}
    for path, m in modules.items():
        if not path:
            continue
        sides = ()
        if isinstance(m, linear.QKVParallelLinear):
            sides = ((m.input_size, m.total_num_heads * m.head_size
                      + m.total_num_kv_heads * (m.head_size + getattr(m, "v_head_size", m.head_size))),)
        elif isinstance(m, linear.LinearBase):
            sides = ((m.input_size, m.output_size),)
        elif isinstance(m, vpe.VocabParallelEmbedding) and not isinstance(m, vpe.ParallelLMHead):
            sides = ((None, m.embedding_dim),)
        elif isinstance(m, logits_processor.LogitsProcessor):
            sides = ((None, m.org_vocab_size),)
        elif isinstance(m, (layernorm.RMSNorm, layernorm.GemmaRMSNorm)) and m.weight.dim() == 1:
            sides = ((m.weight.shape[0], m.weight.shape[0]),)
        elif isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
            sides = ((m.normalized_shape[0], m.normalized_shape[0]),)
        elif type(m).__name__.endswith("DecoderLayer"):
            sides = ((None, hidden_size),)
        for width_in, width_out in sides:
            if width_in is not None:
                out[f"{path}.input"] = int(width_in)
            out[f"{path}.output"] = int(width_out)
    return out


def rules(fragmented: Dict[str, dict]) -> Dict[str, object]:
    """Each fragmented location's rule parsed once (_C.Rule: no JSON at every step), left out where one rank's
    piece is the whole (tp 1): there the worker has nothing to gather or cut."""
    parsed = {loc: _C.Rule(json.dumps(rule)) for loc, rule in fragmented.items()}
    return {loc: r for loc, r in parsed.items() if not r.piece_is_whole}


def partial_sums(rules: Dict[str, object]) -> frozenset:
    """The locations whose rank values are partial sums (an all_reduce makes the whole; the others gather): read
    from the rules once, so a step tests a set, not a collective's name."""
    return frozenset(loc for loc, r in rules.items() if r.collective == "all_reduce")
