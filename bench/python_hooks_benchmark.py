#!/usr/bin/env python3
"""Saves the way Python users take them today, for comparison with fragments (issue 6, benchmark (c)).

One process per rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, as torchrun sets them). Builds
the kit's eager Llama at tp = WORLD_SIZE (random weights, on cuda:LOCAL_RANK, or on the CPU with --device
cpu), and times, interleaved in a rotating order, CUDA-synchronised:

  plain   the eager forward, no hooks;
  hooks   a hook at each location fragments saves in gpu_forward_benchmark: the output of every QKV, merged
          and column layer and of lm_head, the input of every row layer (a pre-hook). Each all_gathers the
          piece with torch.distributed, assembles the whole by the layer's layout (q/k/v and gate/up parts
          put back in order, vocab padding dropped), keeps it, and hands the model this rank's piece
          re-split from the whole — what an nnsight-style hook that may edit does;
  raw     the same hooks doing only the all_gather and keeping the pieces (no assembly, no re-split).

Prints medians (rank 0) and (hooks - plain) / (raw - plain), to read beside gpu_forward_benchmark's
(frag saves - rewritten) / (raw in fwd - rewritten) and its absolute extra milliseconds for the same saves.

  E="--hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --head-dim 128 --vocab 32000 --layers 4"
  for r in 0 1; do RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29571 \\
    python3 bench/python_hooks_benchmark.py $E --tokens 128 --iterations 40 & done; wait
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fragkit import layers as kit_layers  # noqa: E402
from fragkit.models import LlamaConfig, LlamaForCausalLM  # noqa: E402


def gather(piece):
    pieces = [torch.empty_like(piece) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, piece.contiguous())
    return pieces


def part_widths(module):
    """Widths of the parts of one rank's piece, and whether the parts are q/k/v (kv maybe replicated)."""
    if isinstance(module, kit_layers.QKVParallelLinear):
        return [module.num_heads * module.head_size, module.num_kv_heads * module.head_size,
                module.num_kv_heads * module.v_head_size], module.num_kv_head_replicas
    if isinstance(module, kit_layers.MergedColumnParallelLinear):
        p = dist.get_world_size()
        return [s // p for s in module.output_sizes], 1
    return None, 1


def assemble(pieces, widths, replicas):
    if widths is None:
        return torch.cat(pieces, -1)
    parts = []
    for k, w in enumerate(widths):
        off = sum(widths[:k])
        ranks = range(0, len(pieces), replicas if k > 0 else 1)
        parts += [pieces[r][..., off:off + w] for r in ranks]
    return torch.cat(parts, -1)


def resplit(whole, widths, replicas, rank, world):
    if widths is None:
        return whole.chunk(world, -1)[rank].contiguous()
    parts, off = [], 0
    for k, w in enumerate(widths):
        holders = world if k == 0 else world // replicas
        index = rank if k == 0 else rank // replicas
        parts.append(whole[..., off + index * w: off + (index + 1) * w])
        off += w * holders
    return torch.cat(parts, -1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 4096), ("intermediate", 14336), ("heads", 32), ("kv-heads", 8),
                          ("head-dim", 128), ("vocab", 32000), ("layers", 4), ("tokens", 128), ("iterations", 40)):
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.kv_heads < world:
        p.error("--kv-heads must be >= the world size: each rank draws its own random weights, so kv heads "
                "that vLLM replicates would differ between ranks")
    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        sync = torch.cuda.synchronize
    else:
        device, sync = torch.device("cpu"), (lambda: None)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.head_dim, vocab_size=args.vocab, num_hidden_layers=args.layers, dtype=dtype)
    torch.manual_seed(rank)
    with torch.device(device) if hasattr(torch, "get_default_device") else contextlib.nullcontext():
        model = LlamaForCausalLM(config, tp_rank=rank, tp_size=world)
    model = model.to(device=device, dtype=dtype).eval()

    saved = []
    mode = {"hooks": False, "raw": False}

    def output_hook(module, inputs, output):
        if not (mode["hooks"] or mode["raw"]):
            return None
        out = output[0] if isinstance(output, tuple) else output
        pieces = gather(out)
        if mode["raw"]:
            saved.append(pieces)
            return None
        widths, replicas = module._frag_layout
        whole = assemble(pieces, widths, replicas)
        if isinstance(module, kit_layers.ParallelLMHead):
            whole = whole[..., :args.vocab]
            padded = whole.new_zeros(whole.shape[:-1] + (out.shape[-1] * world,))
            padded[..., :args.vocab] = whole
            saved.append(whole)
            piece = padded.chunk(world, -1)[rank].contiguous()
        else:
            saved.append(whole)
            piece = resplit(whole, widths, replicas, rank, world)
        return (piece,) + tuple(output[1:]) if isinstance(output, tuple) else piece

    def input_hook(module, inputs):
        if not (mode["hooks"] or mode["raw"]):
            return None
        pieces = gather(inputs[0])
        saved.append(pieces)
        if mode["raw"]:
            return None
        whole = torch.cat(pieces, -1)
        saved[-1] = whole
        return (whole.chunk(world, -1)[rank].contiguous(),) + tuple(inputs[1:])

    hooked = 0
    for name, module in model.named_modules():
        if isinstance(module, kit_layers.RowParallelLinear):
            module.register_forward_pre_hook(input_hook)
            hooked += 1
        elif isinstance(module, (kit_layers.ColumnParallelLinear, kit_layers.ParallelLMHead)):
            if isinstance(module, kit_layers.ColumnParallelLinear) and module.gather_output:
                continue
            module._frag_layout = part_widths(module)
            module.register_forward_hook(output_hook)
            hooked += 1

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=g).to(device)

    def timed(name):
        mode["hooks"], mode["raw"] = name == "hooks", name == "raw"
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            model(ids)
        sync()
        saved.clear()
        return (time.perf_counter() - start) * 1e3

    # The hooks' assembly and re-split must be exact: the model then computes what it computes without them.
    with torch.no_grad():
        mode["hooks"], mode["raw"] = False, False
        reference = model(ids)
        mode["hooks"] = True
        hooked_logits = model(ids)
        saved.clear()
    exact = torch.equal(reference, hooked_logits)

    names = ["plain", "hooks", "raw"]
    times = {n: [] for n in names}
    for i in range(args.iterations + 3):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            ms = timed(name)
            if i >= 3:
                times[name].append(ms)
    if rank == 0:
        med = {n: statistics.median(v) for n, v in times.items()}
        print("python hooks: world %d  %s  tokens %d  iterations %d  %d hooked layers  torch %s" % (
            world, args.dtype, args.tokens, args.iterations, hooked, torch.__version__))
        print("  the hooks' gather + re-split leave the logits bit-identical: %s" % ("yes" if exact else "NO"))
        for n, text in (("plain", "eager forward, no hooks"),
                        ("hooks", "hooks: all_gather + assemble + keep + re-split"),
                        ("raw", "hooks: all_gather + keep only")):
            print("  %-48s %9.3f ms" % (text, med[n]))
        if med["raw"] > med["plain"]:
            print("  (hooks - plain) / (raw - plain) = %.3f; extra %.3f ms vs %.3f ms" % (
                (med["hooks"] - med["plain"]) / (med["raw"] - med["plain"]), med["hooks"] - med["plain"],
                med["raw"] - med["plain"]))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
