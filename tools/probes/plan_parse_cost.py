"""What parsing one request's plan costs the vLLM worker (_plan.RequestPlan.parse, as _worker._plan_of calls it
for every new request with a plan), without vLLM: the model record of an N-layer Llama (8B-shaped layers: q|k|v,
o_proj, gate|up, down_proj), its fragment table made by fragments' own classifier, the throughput bench's plan
(4 saves). Prints microseconds a plan; also checks that a plan naming heads still resolves them.

    python tools/probes/plan_parse_cost.py [--layers 8 32] [--plans 200]

Run39 (H200 host, vLLM's profiler): 16 plans a run of the bench's quarter column took ~0.6 ms each, most of it
the C++ parser reading the model's whole table for every plan. Here, before and after the table became lazy
(read only for "segment"/"heads"): 200 -> 37 us a plan at 8 layers, 606 -> 38 us at 32.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(ROOT, "python"))  # after PYTHONPATH

from fragments import _C  # noqa: E402
from fragments.vllm import _plan  # noqa: E402

LOCATIONS = ("model.layers.0.self_attn.qkv_proj.output", "model.layers.1.mlp.down_proj.input",
             "model.layers.2.output", "model.norm.output")


def described(layers: int) -> list:
    """The layers _layers.describe would give for an 8B-shaped Llama at tp 1."""
    out = []
    for i in range(layers):
        p = f"model.layers.{i}"
        linear = dict(tp_size=1, tp_rank=0)
        out += [{"path": f"{p}.self_attn.qkv_proj", "class": "QKVParallelLinear", "parameters": {"weight": [6144, 4096]},
                 "attributes": dict(linear, gather_output=False, total_num_heads=32, total_num_kv_heads=8,
                                    head_size=128, v_head_size=128)},
                {"path": f"{p}.self_attn.o_proj", "class": "RowParallelLinear", "parameters": {"weight": [4096, 4096]},
                 "attributes": dict(linear, input_size=4096, output_size=4096, input_is_parallel=True,
                                    reduce_results=True)},
                {"path": f"{p}.mlp.gate_up_proj", "class": "MergedColumnParallelLinear",
                 "parameters": {"weight": [28672, 4096]},
                 "attributes": dict(linear, output_size=28672, output_sizes=[14336, 14336], gather_output=False)},
                {"path": f"{p}.mlp.down_proj", "class": "RowParallelLinear", "parameters": {"weight": [4096, 14336]},
                 "attributes": dict(linear, input_size=14336, output_size=4096, input_is_parallel=True,
                                    reduce_results=True)}]
    return out


def record(layers: int) -> dict:
    d = described(layers)
    modules = ["model", "model.norm"] + [f"model.layers.{i}" for i in range(layers)] + [x["path"] for x in d]
    return {"table": json.loads(_C.classify_layers(d, "vLLM model")), "refused": {}, "modules": modules,
            "logits_modules": [], "widths": {}, "compiled": False,
            "qkv_attributes": {x["path"]: {k: v for k, v in x["attributes"].items() if not isinstance(v, bool)}
                               for x in d if x["class"] == "QKVParallelLinear"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--plans", type=int, default=200)
    args = ap.parse_args()
    plan = [{"at": at, "do": "save", "as": at, "step": "all"} for at in LOCATIONS]
    for layers in args.layers:
        rec = record(layers)
        modules = set(rec["modules"])
        for _ in range(3):
            _plan.RequestPlan.parse(plan, "r", rec, modules)
        t0 = time.perf_counter()
        for _ in range(args.plans):
            parsed = _plan.RequestPlan.parse(plan, "r", rec, modules)
        us = (time.perf_counter() - t0) / args.plans * 1e6
        heads = _plan.RequestPlan.parse([{"at": LOCATIONS[0], "do": "zero", "segment": "k", "heads": [1]}], "r", rec,
                                        modules)
        if parsed.error or heads.error or heads.steps[0].step.index != "...,4224:4352":
            print(f"plan_parse_cost: a plan did not parse as expected: {parsed.error or heads.error or heads.steps[0].step.index}",
                  file=sys.stderr)
            return 1
        print(f"plan_parse_cost: {layers} layers (table {len(json.dumps(rec['table'])):,} bytes of JSON): {us:.0f} us "
              f"a plan of {len(plan)} saves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
