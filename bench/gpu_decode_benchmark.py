#!/usr/bin/env python3
"""GPU decode from a KV cache: fragments (CUDA-graph replayed decode steps) against transformers' generate.

One process, one GPU, the same config and weights on every side (random, bf16; default 8B-shaped, 4 layers):

  fragments            fragments.load of the rank file, program::Decoder with a static cache of --cache tokens
                       a row: each decode step attends over the whole cache, so its shapes never change and
                       ShardedModel replays it from a CUDA graph (captured on the third step); nothing
                       registered, then saves at 4 locations every step
  plain PyTorch        the kit's eager LlamaForCausalLM (the same weights, the same cache layout) with its
                       decode step captured in a torch.cuda.CUDAGraph: the floor for a captured step
  transformers dynamic LlamaForCausalLM.generate, DynamicCache
  transformers static  LlamaForCausalLM.generate(cache_implementation="static"), which compiles its decode step

Per batch size (--batches, default 1 and 32): ms per decode step (median over --iterations after warm-up) and
tokens/s = batch / step time. For transformers the step time is (generate(N) - generate(1)) / (N - 1), the
prompt of --prompt tokens prefilled in both. Goals (issue 28): fragments >= 2x transformers static at batch 1,
>= 1.2x at batch 32 with nothing registered, >= 0.9x of that with the 4 saves; the captured step <= 1.3x
plain PyTorch's captured step.

    bash tools/device/decode_run.sh     (on the GPU machine: builds the extension, exports, runs this)
    PYTHONPATH=build/device/python:. python3 bench/gpu_decode_benchmark.py FILE.pt [--batches 1 32]

--device cpu --layers 1 --hidden 64 ... runs the same code on a CPU (no graphs), as a smoke test.
"""
import argparse
import os
import statistics
import sys
import time

import fragments  # noqa: E402  (before fragkit: the C++ runtime registers the frag:: ops)
import torch  # noqa: E402
from fragments import _C  # noqa: E402
from fragments._model import Step  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fragkit.models import LlamaConfig, LlamaForCausalLM  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, iterations, warmup=3):
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def fragments_step_ms(model, batch, args, device, saves):
    """Median ms of a decode step of `batch` rows after a --prompt-token prefill, cache of --cache tokens."""
    c = model._c
    records = [Step(at=at, do="save", as_="s%d" % i) for i, at in enumerate(saves)]
    c.prepare(records, [])
    decoder = _C.Decoder(c, batch, args.cache)
    prompts = [[(13 * i + r) % args.vocab for i in range(args.prompt)] for r in range(batch)]
    tokens = decoder.prefill(prompts).argmax(-1)
    state = {"tokens": tokens}
    budget = args.cache - args.prompt - 1

    def step():
        if decoder.lengths[0] >= args.cache - 1:
            raise RuntimeError("--cache too small for the iterations")
        state["tokens"] = decoder.decode(state["tokens"]).argmax(-1)
        c.finish(False)  # drop the saves kept so far (a server would hand them out each step)

    if args.iterations + 3 > budget:
        raise SystemExit("--cache %d leaves %d decode steps after the prompt: raise it" % (args.cache, budget))
    ms = timed(step, device, args.iterations)
    c.finish(False)
    return ms


def plain_step_ms(kit, batch, args, device):
    """The kit's eager model, its decode step captured in a CUDA graph (eager on a CPU)."""
    cache = kit.new_kv_cache(batch, args.cache)
    ids = torch.full((batch, args.prompt), 5, dtype=torch.long, device=device)
    positions = torch.arange(args.prompt, device=device).unsqueeze(0).expand(batch, -1).contiguous()
    with torch.no_grad():
        kit(ids, positions, cache, args.prompt)
        step_ids = torch.full((batch, 1), 7, dtype=torch.long, device=device)
        step_pos = torch.full((batch, 1), args.prompt, dtype=torch.long, device=device)

        def eager():
            return kit(step_ids, step_pos, cache, args.cache)

        if device.type != "cuda":
            return timed(eager, device, args.iterations)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                eager()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        return timed(graph.replay, device, args.iterations)


def transformers_step_ms(hf, batch, args, device, static):
    ids = torch.full((batch, args.prompt), 5, dtype=torch.long, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    n = args.new_tokens

    def generate(tokens):
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)

    iterations = max(3, args.iterations // 10)
    full = timed(lambda: generate(n), device, iterations, warmup=2)
    one = timed(lambda: generate(1), device, iterations, warmup=2)
    return (full - one) / (n - 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file", help="rank file (tp 1) of the shape below, e.g. from tools/export_model.py")
    for flag, default in (("layers", 4), ("hidden", 4096), ("intermediate", 14336), ("heads", 32),
                          ("kv-heads", 8), ("head-dim", 128), ("vocab", 32000), ("prompt", 64), ("cache", 512),
                          ("iterations", 100), ("new-tokens", 64), ("max-positions", 1024)):
        p.add_argument("--" + flag, type=int, default=default)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--skip-transformers", action="store_true")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = fragments.load(args.file, device=str(device))
    saves = ["model.layers.0.output", "model.layers.%d.output" % (args.layers - 1),
             "model.layers.0.mlp.down_proj.input", "model.layers.0.self_attn.o_proj.input"]
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         num_hidden_layers=args.layers, max_position_embeddings=args.max_positions, dtype=dtype)
    kit = LlamaForCausalLM(config).eval()
    # The rank file also holds the rotary tables (buffers the kit's module makes itself): weights only.
    wanted = kit.state_dict().keys()
    kit.load_state_dict({k: v for k, v in torch.jit.load(args.file).state_dict().items() if k in wanted})
    kit.to(device)
    hf = None
    if not args.skip_transformers:
        import transformers

        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
            num_hidden_layers=args.layers, max_position_embeddings=args.max_positions)).to(device, dtype).eval()
    print("Llama %d layers, hidden %d, %d heads of %d (%d kv), vocab %d, %s, %s; prompt %d, cache %d tokens a row"
          % (args.layers, args.hidden, args.heads, args.head_dim, args.kv_heads, args.vocab, args.dtype,
             torch.cuda.get_device_name() if device.type == "cuda" else "cpu", args.prompt, args.cache))
    for batch in args.batches:
        rows = [("fragments, nothing registered", fragments_step_ms(model, batch, args, device, [])),
                ("fragments, saves at 4 locations", fragments_step_ms(model, batch, args, device, saves)),
                ("plain PyTorch (kit model), CUDA graph", plain_step_ms(kit, batch, args, device))]
        if hf is not None:
            rows.append(("transformers generate, dynamic cache", transformers_step_ms(hf, batch, args, device, False)))
            rows.append(("transformers generate, static cache", transformers_step_ms(hf, batch, args, device, True)))
        print("batch %d:" % batch)
        reference = dict(rows).get("transformers generate, static cache")
        for name, ms in rows:
            extra = "   %.2fx transformers static's tokens/s" % (reference / ms) if reference else ""
            print("  %-42s %8.3f ms/step %10.0f tokens/s%s" % (name, ms, batch * 1000 / ms, extra))
        if device.type == "cuda":
            print("  graphs: %s" % model.graph_stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
