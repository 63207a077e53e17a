#!/usr/bin/env python3
"""Export a tiny reference model as one TorchScript file per tensor-parallel rank.

    /usr/bin/python3 tools/export_model.py --model llama --tp 2 --out DIR [--kv-heads K] [--layers L]
                                           [--ep] [--seed S] [--dtype float32|bfloat16|float16]
                                           [--hidden H] [--intermediate I] [--heads N] [--head-dim D]
                                           [--vocab V] [--vocab-padding P] [--mlp gated|plain]
                                           [--format torchscript|export [--kv-cache]]

The size flags override the model config's defaults (tiny: hidden 64, 8 heads of
8, intermediate 128, vocab 1000); without them the export is the tiny model. When
--hidden or --heads is given without --head-dim, the head size is hidden // heads.

--mlp picks the llama MLP: "gated" (the default, Llama's: a MergedColumnParallelLinear
gate_up_proj, SiLU-and-mul, a RowParallelLinear down_proj) or "plain" (GPT-NeoX /
GPT-2 style: a ColumnParallelLinear up_proj with gather_output=False, so its output
is a plain shard on the last dim, GELU, a RowParallelLinear down_proj). The default
exports exactly what an export without the flag does.

Writes DIR/rank{r}.pt for r in 0..tp-1 (tp 1 gives the whole model); --format export writes
DIR/rank{r}.pt2 (torch.export archives) instead; with --kv-cache their forward takes a KV cache
(forward(input_ids, positions, kv_cache, cache_len): cached generation, fragkit/export.py).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root holds fragkit/

import torch  # noqa: E402

from fragkit.export import export  # noqa: E402
from fragkit.models import (LLAMA_MLP_KINDS, LlamaConfig, Qwen2MoeConfig, llama_builder,  # noqa: E402
                            qwen2_moe_builder)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Size flags and the config fields they set (unset flags keep the config's defaults).
CONFIG_FLAGS = {"kv_heads": "num_key_value_heads", "layers": "num_hidden_layers", "hidden": "hidden_size",
                "intermediate": "intermediate_size", "heads": "num_attention_heads", "vocab": "vocab_size",
                "head_dim": "head_dim", "max_positions": "max_position_embeddings"}


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
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 64)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="MLP intermediate size (default 128; qwen2_moe: the dense MLP of mlp_only_layers)")
    p.add_argument("--heads", type=int, default=None, help="number of attention heads (default 8)")
    p.add_argument("--head-dim", type=int, default=None,
                   help="size of one attention head (default 8 for llama; hidden // heads when --hidden "
                        "or --heads is given)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 1000)")
    p.add_argument("--max-positions", type=int, default=None,
                   help="max_position_embeddings: the longest sequence, and KV cache (default 512)")
    p.add_argument("--vocab-padding", type=int, default=None,
                   help="llama: pad the vocabulary to a multiple of this (padding_size; default 64, vLLM's)")
    p.add_argument("--mlp", choices=list(LLAMA_MLP_KINDS), default=None,
                   help="llama only: the MLP, 'gated' (default: gate_up_proj, SiLU-and-mul, down_proj) or "
                        "'plain' (up_proj ColumnParallelLinear with gather_output=False, GELU, down_proj)")
    p.add_argument("--format", choices=["torchscript", "export"], default="torchscript",
                   help="torchscript (rank{r}.pt, the default) or export (torch.export, rank{r}.pt2)")
    p.add_argument("--kv-cache", action="store_true",
                   help="with --format export: the cached forward (input_ids, positions, kv_cache, cache_len)")
    args = p.parse_args(argv)
    if args.kv_cache and args.format != "export":
        p.error("--kv-cache applies to --format export (a TorchScript file always takes a cache)")

    if args.tp < 1:
        p.error("--tp must be >= 1")
    overrides = {"dtype": DTYPES[args.dtype]}
    for flag, field in CONFIG_FLAGS.items():
        if getattr(args, flag) is not None:
            overrides[field] = getattr(args, flag)
    if args.head_dim is None and (args.hidden is not None or args.heads is not None):
        overrides["head_dim"] = None  # hidden_size // num_attention_heads
    try:
        if args.model == "llama":
            if args.ep:
                p.error("--ep applies to --model qwen2_moe only")
            if args.mlp is not None:
                overrides["mlp"] = args.mlp
            if args.vocab_padding is not None:
                overrides["vocab_padding_size"] = args.vocab_padding
            build = llama_builder(LlamaConfig(**overrides))
        else:
            if args.mlp is not None:
                p.error("--mlp applies to --model llama only")
            if args.vocab_padding is not None:
                p.error("--vocab-padding applies to --model llama only")
            build = qwen2_moe_builder(Qwen2MoeConfig(**overrides), enable_expert_parallel=args.ep)
        paths = export(build, args.tp, args.out, seed=args.seed, format=args.format, kv_cache=args.kv_cache)
    except (ValueError, NotImplementedError) as e:
        print("export_model: error: %s" % e, file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
