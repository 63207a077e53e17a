"""``--dry-run``: what an import would write and the memory it would take, from a config alone.

The kit model is built on meta (shapes only, no memory) for each rank, so a 405B-shaped config is planned in
seconds on any machine. Per rank: the bytes of its file (parameters and buffers). The predicted peak memory
of the streaming import is an upper bound: the process itself (Python, PyTorch, the kit: ``BASE_BYTES``)
plus the reader's buffers (stream.TensorReader: the largest kit tensor, and twice the largest one read
ahead), the largest rank slice copied in the target dtype and the largest joined (q_r|k_r|v_r at tp > 1)
(a row slice is written straight from the buffer and needs no copy, so the import often stays below it).
"""
import json
import os
from typing import Dict, Optional

import torch

from .. import layers
from .families import family_for
from .files import DTYPES
from .sources import CheckpointError
from .stream import AHEAD_BYTES, module_bytes

BASE_BYTES = 1_000_000_000  # a fresh `python3 -m fragkit.checkpoint` with torch imported and the skeletons


def config_of(path: Optional[str], like: Optional[str], layers_: Optional[int]) -> (dict, str):
    if like:
        from ..synthetic import like_config

        try:
            return like_config(like, layers_), "--like %s" % like
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    if path is None:
        raise CheckpointError("--dry-run needs --from (a folder or config.json) or --like")
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise CheckpointError("%s: no config.json" % path)
    with open(file) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError("%s: not JSON: %s" % (file, e)) from None
    if layers_ is not None:
        cfg["num_hidden_layers"] = layers_
    return cfg, file


def dry_run(cfg: dict, where: str, tp: int, dtype: Optional[str] = None, enable_expert_parallel: bool = False,
            ignore_config_fields=()) -> Dict:

    declared = cfg.get("torch_dtype", cfg.get("dtype"))
    dtype = dtype or (declared if declared in DTYPES else "float32")
    source_dtype = DTYPES.get(declared, DTYPES[dtype]) if isinstance(declared, str) else DTYPES[dtype]
    family = family_for(cfg, where, DTYPES[dtype], enable_expert_parallel, ignore_config_fields)
    family.check_tp(tp)
    build = family.builder()
    src_size = torch.empty(0, dtype=source_dtype).element_size()
    with layers.build_on_meta(), torch.device("meta"):
        full = dict(build(0, 1).named_parameters())
    ranks = []
    worst_slice: Dict[str, int] = {}
    for r in range(tp):
        with layers.build_on_meta(), torch.device("meta"):
            module = build(r, tp)
        ranks.append(module_bytes(module))
        for name, p in module.named_parameters():
            worst_slice[name] = max(worst_slice.get(name, 0), p.numel() * p.element_size())
        del module
    whole = [full[n].numel() * src_size for n in full]
    ahead = [b for b in whole if b <= AHEAD_BYTES]
    step = max(whole) + 2 * max(ahead, default=0) + 2 * max(worst_slice.values())  # a copied and a joined slice
    largest = max(p.numel() * src_size for p in full.values())
    return {"config": where, "family": family.name, "tp_size": tp, "dtype": dtype,
            "layers": cfg.get("num_hidden_layers"), "rank_bytes": ranks, "total_bytes": sum(ranks),
            "largest_tensor_bytes": largest, "predicted_peak_bytes": BASE_BYTES + step,
            "parameters": sum(p.numel() for p in full.values())}


def describe(plan: Dict) -> str:
    lines = ["%s: %s, %d layers, %.2fB parameters, tp %d, %s (dry run: nothing written)"
             % (plan["config"], plan["family"], plan["layers"], plan["parameters"] / 1e9, plan["tp_size"],
                plan["dtype"])]
    for r, n in enumerate(plan["rank_bytes"]):
        lines.append("  rank%d.pt  %.2f GB" % (r, n / 1e9))
    lines.append("  total      %.2f GB" % (plan["total_bytes"] / 1e9))
    lines.append("  largest checkpoint tensor %.2f GB; predicted peak memory of the import <= %.2f GB"
                 % (plan["largest_tensor_bytes"] / 1e9, plan["predicted_peak_bytes"] / 1e9))
    return "\n".join(lines)
