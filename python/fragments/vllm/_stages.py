"""Pipeline stages: one location table for the whole model, each stage acting at its own modules.

vLLM's pipeline parallelism (pipeline_parallel_size > 1) builds on each stage only its own decoder layers; the
others, and the embedding off the first stage, the final norm and LM head off the last, are `PPMissingLayer`
(an identity). So a worker sees only its stage's modules, and a plan naming another stage's layer would be
"no such location". At load every worker shares its stage's record with the same tensor-parallel rank of
every other stage (vLLM's pipeline group, its CPU side) and merges them: the front end (model.json, written by
global rank 0), fv.inspect and the workers' plan checks all see every stage's locations, and `"stage"` maps each
location to the stage whose workers act there. Then every rank of every stage compares a digest of the merged
table (vLLM's world group): a stage that classified differently stops the engine at start, before any plan runs.

Which stage holds a location: the one stage owning its module; a module owned by several stages whole (a tied
embedding kept beside the LM head) by the first, which calls it; a container spanning stages (`model`) takes its
input on the first stage and gives its output on the last.

Saves stay where they were made: each stage's tensor-parallel rank 0 keeps its stage's saves, answers
fragments_take_saves with them, and the caller merges the answers per request (merge_takes).
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Dict, List, Optional, Set

import torch.nn as nn


def pp_group():
    """vLLM's pipeline group, or None at pipeline_parallel_size 1."""
    from vllm.distributed import get_pp_group
    group = get_pp_group()
    return group if group.world_size > 1 else None


def owned(model: nn.Module) -> Set[str]:
    """Paths of the modules this stage really holds: not a PPMissingLayer, nor inside one."""
    from vllm.model_executor.models.utils import PPMissingLayer
    missing = [p for p, m in model.named_modules() if isinstance(m, PPMissingLayer)]
    return {p for p, _ in model.named_modules()
            if not any(p == q or p.startswith(q + ".") for q in missing)}


def own(record: dict, model: nn.Module) -> dict:
    """A worker's record cut to the modules its stage really holds, with their module order (stage_of reads it)."""
    held = owned(model)
    mine = lambda loc: loc.rpartition(".")[0] in held  # noqa: E731
    out = dict(record, modules=sorted(p for p in held if p),
               logits_modules=[p for p in record["logits_modules"] if p in held],
               order=[p for p, _ in model.named_modules() if p in held and p])
    for key in ("fragmented", "refused", "widths"):
        out[key] = {loc: v for loc, v in record[key].items() if mine(loc)}
    return out


def route_call(where: Dict[str, int], stage: int, modules: List[str]):
    """(whether this stage leaves an ad-hoc module call to another, its answer then): the stage holding every
    module runs it (the logit lens: the last stage); modules on different stages are refused in one line."""
    stages = {where.get(f"{p}.output", stage) for p in modules}
    if len(stages) > 1:
        return True, {"error": f"fragments: {'('.join(modules[::-1])}(...): these modules sit on different "
                      f"pipeline stages ({sorted(stages)}); call each stage's modules on its own", "data": None}
    return bool(stages) and stages != {stage}, None


def stage_of(orders: List[List[str]]) -> Dict[str, int]:
    """location -> the stage acting there, from each stage's owned module paths in module order (module
    docstring). vLLM builds some modules whole on every stage though only one calls them (Qwen2-MoE's and
    GPT-NeoX's final norm, LM head and logits processor; a tied embedding): those registered before the first
    decoder layer act on the first stage holding them (the embedding), the others on the last (norm, head)."""
    holders: Dict[str, List[int]] = {}
    for k, paths in enumerate(orders):
        for p in paths:
            holders.setdefault(p, []).append(k)
    sets = [set(paths) for paths in orders]
    out: Dict[str, int] = {}
    for p, ks in holders.items():
        if not p:
            continue
        if len(ks) == 1:
            out[f"{p}.input"] = out[f"{p}.output"] = ks[0]
            continue
        subtrees = {frozenset(q for q in sets[k] if q.startswith(p + ".")) for k in ks}
        if len(subtrees) > 1:  # a container spanning stages: its input on the first, its output on the last
            out[f"{p}.input"], out[f"{p}.output"] = ks[0], ks[-1]
            continue
        order = orders[ks[0]]
        first_layer = next((i for i, q in enumerate(order) if _LAYER.search(q)), len(order))
        k = ks[0] if order.index(p) < first_layer else ks[-1]
        out[f"{p}.input"] = out[f"{p}.output"] = k
    return out


def merge(records: List[dict]) -> dict:
    """One record for the whole model from each stage's (in stage order)."""
    orders = [r.pop("order") for r in records]
    merged = dict(records[0])
    merged["pp_size"] = len(records)
    merged["modules"] = sorted({p for r in records for p in r["modules"]})
    for key in ("fragmented", "refused", "widths", "qkv_attributes"):
        merged[key] = {k: v for r in records for k, v in (r.get(key) or {}).items()}
    for key in ("logits_modules", "taps"):
        merged[key] = sorted({p for r in records for p in r.get(key) or ()})
    layers, seen = [], set()
    for r in records:
        for entry in r["table"].get("layers", []):
            if entry["path"] not in seen:
                seen.add(entry["path"])
                layers.append(entry)
    merged["table"] = dict(records[0]["table"], layers=layers)
    merged["stage"] = stage_of(orders)
    merged["stages"] = [{"modules": len(r["modules"]), "layers": _layer_span(r["modules"])} for r in records]
    return merged


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


def _layer_span(paths: List[str]) -> Optional[List[int]]:
    """[first, last] decoder layer index a stage holds (modules `....layers.N`), or None."""
    found = sorted({int(m.group(1)) for p in paths for m in [_LAYER.search(p)] if m})
    return [found[0], found[-1]] if found else None


def exchange(local: dict) -> dict:
    """This stage's record merged with every other stage's (a CPU all-gather over vLLM's pipeline group: every
    worker runs load_model, so every rank of every stage reaches it), then the digest agreement (agree)."""
    import torch.distributed as dist
    group = pp_group()
    if group is None:
        return local
    records: List[Optional[dict]] = [None] * group.world_size
    dist.all_gather_object(records, local, group=group.cpu_group)
    merged = merge(records)  # type: ignore[arg-type]
    agree(merged)
    return merged


def digest(record: dict) -> str:
    """What every rank of every stage must hold alike: the locations, their stages, rules and refusals."""
    fields = {k: record.get(k) for k in ("modules", "stage", "fragmented", "refused", "widths", "logits_modules")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def agree(record: dict) -> None:
    """Every rank of every stage (vLLM's world group) holds the same merged table, or the engine stops here."""
    import torch.distributed as dist
    from vllm.distributed import get_world_group
    world = get_world_group()
    mine = digest(record)
    digests: List[Optional[str]] = [None] * world.world_size
    dist.all_gather_object(digests, mine, group=world.cpu_group)
    if len(set(digests)) != 1:
        raise RuntimeError(f"fragments: the workers disagree on the model's location table across pipeline "
                           f"stages (digest per global rank: {digests}); every rank must classify alike")


def merge_takes(answers, keys, cap: Optional[int] = None) -> Dict[str, dict]:
    """fragments_take_saves' answers (one per rank; None from ranks that keep no tensors) merged per key: at
    pipeline_parallel_size > 1 each stage's tensor-parallel rank 0 answers with its own stage's saves. Each stage
    holds at most FRAGMENTS_VLLM_MAX_SAVE_BYTES of a request (`cap`); together they may pass it, so whole saves
    are kept in stage order up to the cap and the others dropped, the reason in the request's error."""
    from safetensors.torch import save
    from . import _delivery
    from ._saves import setting
    answers = [a for a in answers if a is not None]
    if len(answers) <= 1:
        return answers[0] if answers else {}
    cap = cap if cap is not None else setting("FRAGMENTS_VLLM_MAX_SAVE_BYTES")
    out: Dict[str, dict] = {}
    for key in keys:
        entries = [a[key] for a in answers if key in a]
        ok = [e for e in entries if e["status"] == "ok"]
        if not ok:
            out[key] = entries[0]
            continue
        tensors, size, dropped = {}, 0, []
        for e in ok:
            for name, t in _delivery.tensors(e).items():  # a file is read and removed
                n = t.numel() * t.element_size()
                if size + n > cap:
                    dropped.append(name)
                    continue
                tensors[name] = t
                size += n
        errors = [e["error"] for e in entries if e["error"]]
        if dropped:
            errors.append(f"saves truncated: the pipeline stages' saves together would pass {cap} bytes "
                          f"(FRAGMENTS_VLLM_MAX_SAVE_BYTES); {', '.join(dropped)} not kept")
        out[key] = {"status": "ok", "error": "; ".join(dict.fromkeys(errors)) or None,
                    "data": save(tensors) if tensors else None, "bytes": size}
    return out
