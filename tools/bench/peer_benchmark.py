#!/usr/bin/env python3
"""fragments beside the eager torch.distributed peer, in one process per GPU (issue 17, item 5; target (d)).

The peer is what vLLM runs without CUDA graphs: the kit's eager Llama (tools/fragkit) with the weights of
the rank file, its tensor-parallel collectives plain ``torch.distributed`` NCCL calls (all_reduce in place,
all_gather), and the same forward captured in a ``torch.cuda.CUDAGraph``. Beside it, in the same process,
interleaved in a rotating order, CUDA-synchronised, rank 0 printing medians:

  peer eager          the eager model
  peer captured       its forward replayed from a CUDA graph (captured after two warm-up forwards)
  fragments eager     fragments.load of the same file, nothing registered, ``cuda_graphs = False``
                      (the original computation op by op, through the Python trace API)
  fragments replayed  the same with CUDA graphs (the default): replayed from its graph cache
  original (LibTorch) the rank file under plain torch.jit.load (LibTorch's fusers on)

Ratios: fragments eager / peer eager (target (d): <= 1.1), fragments replayed / peer captured (<= 1.2 for
the decode step). fragments uses its own NCCL communicator (FRAGMENTS_BACKEND=nccl), the peer
torch.distributed's; at world 1 both are a single GPU.

  python3 tools/export_model.py --model llama --tp 1 --layers 4 --hidden 4096 --intermediate 14336 \\
    --heads 32 --kv-heads 8 --head-dim 128 --vocab 32000 --dtype bfloat16 --out /tmp/l8b1
  PYTHONPATH=build/device/python:tools python3 tools/bench/peer_benchmark.py /tmp/l8b1/rank{rank}.pt \\
    --layers 4 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --head-dim 128 --vocab 32000 \\
    --dtype bfloat16 --tokens 1 --iterations 30
  (two GPUs: the same under torchrun --nproc-per-node 2, or RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* per process)
"""
import argparse
import datetime
import os
import statistics
import sys
import time

os.environ.setdefault("FRAGMENTS_BACKEND", "nccl")
import fragments  # noqa: E402  (before fragkit: the C++ runtime registers the frag:: ops)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fragkit.layers as kit_layers  # noqa: E402
import fragkit.models as kit_models  # noqa: E402
from fragkit.models import LlamaConfig, LlamaForCausalLM  # noqa: E402


def peer_all_reduce(x):
    dist.all_reduce(x)  # x is a fresh matmul output: in place, as vLLM's eager path
    return x


def peer_all_gather(x, dim=-1):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file", help="rank file; {rank} is replaced by the rank")
    for flag, default in (("layers", 4), ("hidden", 4096), ("intermediate", 14336), ("heads", 32),
                          ("kv-heads", 8), ("head-dim", 128), ("vocab", 32000), ("tokens", 128),
                          ("iterations", 30)):
        p.add_argument("--" + flag, type=int, default=default)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    path = args.file.replace("{rank}", str(rank))

    # fragments first: its own context (single rank, or its own NCCL communicator from the environment).
    frag_eager = fragments.load(path, device=str(device))
    frag_eager.cuda_graphs = False
    frag_graphs = fragments.load(path, device=str(device))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun: the agent's store
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:  # fragments' rendezvous holds MASTER_PORT: the peer meets on the port after it
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29573"))
        store = dist.TCPStore(addr, port + 1, world, rank == 0, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)

    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.head_dim, vocab_size=args.vocab, num_hidden_layers=args.layers, dtype=dtype)
    for module in (kit_layers, kit_models):  # plain torch.distributed collectives, not the frag:: ops
        if hasattr(module, "tensor_model_parallel_all_reduce"):
            module.tensor_model_parallel_all_reduce = peer_all_reduce
        if hasattr(module, "tensor_model_parallel_all_gather"):
            module.tensor_model_parallel_all_gather = peer_all_gather
    with torch.device(device):
        peer = LlamaForCausalLM(config, tp_rank=rank, tp_size=world)
    original = torch.jit.load(path, map_location=device)
    missing, unexpected = peer.load_state_dict(original.state_dict(), strict=False)
    missing = [k for k in missing if k in dict(peer.named_parameters())]
    if missing:
        raise SystemExit(f"peer_benchmark: the rank file lacks the peer's parameters {missing[:5]}")
    peer = peer.to(device=device, dtype=dtype).eval()

    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (1, args.tokens), device=device)
    static_ids = ids.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                peer(static_ids)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            static_logits = peer(static_ids)

    def fragments_forward(model):
        with model.trace(ids):
            out = model.output.save()
        return out.value

    def peer_replayed():
        static_ids.copy_(ids)
        graph.replay()
        return static_logits.clone()

    variants = {
        "peer eager (torch.distributed NCCL)": lambda: peer(ids),
        "peer captured (torch.cuda.CUDAGraph)": peer_replayed,
        "fragments, nothing registered, eager": lambda: fragments_forward(frag_eager),
        "fragments, nothing registered, replayed": lambda: fragments_forward(frag_graphs),
        "original export under torch.jit.load (fused)": lambda: original(ids),
    }
    names = list(variants)
    times = {name: [] for name in names}
    logits = {}
    with torch.no_grad():
        for i in range(args.iterations + 3):
            for k in range(len(names)):
                name = names[(i + k) % len(names)]
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = variants[name]()
                torch.cuda.synchronize()
                if i >= 3:
                    times[name].append((time.perf_counter() - start) * 1e3)
                logits[name] = out[0] if isinstance(out, tuple) else out
    if rank != 0:
        return 0
    med = {name: statistics.median(times[name]) for name in names}
    base = logits[names[0]].float()
    print(f"file {path}  tokens {args.tokens}  iterations {args.iterations}  world {world}  dtype {args.dtype}  "
          f"GPU {torch.cuda.get_device_name(device)}  torch {torch.__version__}")
    print(f"{'forward (median ms, rank 0)':<48} {'ms':>8}  logits vs peer eager")
    for name in names:
        diff = (logits[name].float() - base).abs().max().item()
        print(f"{name:<48} {med[name]:8.3f}  {'equal' if diff == 0 else f'max |diff| {diff:.3g}'}")
    print(f"fragments replayed: {frag_graphs.graph_stats()}")
    print(f"(d) fragments eager / peer eager: {med[names[2]] / med[names[0]]:.3f} (target <= 1.1); "
          f"fragments replayed / peer captured: {med[names[3]] / med[names[1]]:.3f} (target <= 1.2 for a decode "
          f"step); peer captured / peer eager: {med[names[1]] / med[names[0]]:.3f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
