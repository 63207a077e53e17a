#!/usr/bin/env python3
"""Export a tiny reference model as one TorchScript file per tensor-parallel rank.

    /usr/bin/python3 tools/export_model.py --model llama --tp 2 --out DIR [--kv-heads K] [--layers L]
                                           [--ep] [--seed S] [--dtype float32|bfloat16]

Writes DIR/rank{r}.pt for r in 0..tp-1 (tp 1 gives the whole model).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from fragkit.export import export  # noqa: E402
from fragkit.models import LlamaConfig, Qwen2MoeConfig, llama_builder, qwen2_moe_builder  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=["llama", "qwen2_moe"])
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size (number of rank files)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--kv-heads", type=int, default=None, help="number of key/value heads (default 4)")
    p.add_argument("--layers", type=int, default=None, help="number of decoder layers (default 2)")
    p.add_argument("--ep", action="store_true", help="qwen2_moe: expert parallelism (experts split by block)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = p.parse_args(argv)

    if args.tp < 1:
        p.error("--tp must be >= 1")
    overrides = {"dtype": DTYPES[args.dtype]}
    if args.kv_heads is not None:
        overrides["num_key_value_heads"] = args.kv_heads
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    try:
        if args.model == "llama":
            if args.ep:
                p.error("--ep applies to --model qwen2_moe only")
            build = llama_builder(LlamaConfig(**overrides))
        else:
            build = qwen2_moe_builder(Qwen2MoeConfig(**overrides), enable_expert_parallel=args.ep)
        paths = export(build, args.tp, args.out, seed=args.seed)
    except (ValueError, NotImplementedError) as e:
        print("export_model: error: %s" % e, file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
