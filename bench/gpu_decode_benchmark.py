#!/usr/bin/env python3
"""GPU decode from a KV cache: fragments (CUDA-graph replayed decode steps) against transformers' generate.

One process, one GPU, the same config and weights on every side (random, bf16; default 8B-shaped, 4 layers):

  fragments            fragments.load of the rank file, program::Decoder with a static cache of --cache tokens
                       a row: each decode step attends over the whole cache, so its shapes never change and
                       ShardedModel replays it from a CUDA graph (captured on the third step); nothing
                       registered, then saves at 4 locations every step
  plain PyTorch        the kit's eager LlamaForCausalLM (the same weights, the same cache layout) with its
                       decode step captured in a torch.cuda.CUDAGraph: the floor for a captured step
  independent plain    bench/peer_models.PlainLlama (nn.Linear, SDPA with a mask over a static cache of
                       the same layout and length, nobody's numerics here), the same weights, its decode step
                       captured in a torch.cuda.CUDAGraph; its logits are checked against the kit model's
                       (prefill and decode steps) before anything is timed, and a failed check exits 1
  transformers dynamic LlamaForCausalLM.generate, DynamicCache
  transformers static  LlamaForCausalLM.generate(cache_implementation="static"), which compiles its decode step

It first prints which attention over the cache the rank file runs (read from its code: SDPA in the cache's
dtype, or an older export's float32 matmul/softmax). Per batch size (--batches, default 1 and 32): ms per decode
step (median over --iterations after warm-up) and tokens/s = batch / step time, then the ratios: saves at 4
locations / nothing registered, fragments / transformers static cache (tokens/s), fragments / independent. For transformers the step time is (generate(N) - generate(1)) / (N - 1), the
prompt of --prompt tokens prefilled in both. Goals (issue 28): fragments >= 2x transformers static at batch 1,
>= 1.2x at batch 32 with nothing registered, >= 0.9x of that with the 4 saves; the captured step <= 1.3x
the independent plain model's captured step with the same cache (printed as a ratio).

    bash tools/device/decode_run.sh     (on the GPU machine: builds the extension, exports, runs this)
    PYTHONPATH=build/device/python:. python3 bench/gpu_decode_benchmark.py FILE.pt [--batches 1 32]

--device cpu --layers 1 --hidden 64 ... runs the same code on a CPU (no graphs), as a smoke test
(tests/python/frontend:decode_benchmark_test); --json FILE writes the rows, ratios and checks.
"""
import argparse
import json
import os
import statistics
import sys
import time

import fragments  # noqa: E402  (before fragkit: the C++ runtime registers the frag:: ops)
import torch  # noqa: E402
from fragments import _C  # noqa: E402
from fragments.core.step import Step  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fragkit.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_models import PlainLlama  # noqa: E402


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

        return captured_ms(lambda: kit(step_ids, step_pos, cache, args.cache), device, args.iterations)


def captured_ms(step, device, iterations):
    """Median ms of `step` replayed from a torch.cuda.CUDAGraph (eager on a CPU)."""
    if device.type != "cuda":
        return timed(step, device, iterations)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return timed(graph.replay, device, iterations)


def independent_step_ms(plain, batch, args, device):
    """bench/peer_models.PlainLlama with its own static cache of --cache tokens, its decode step captured."""
    cache = plain.new_static_cache(batch, args.cache)
    ids = torch.full((batch, args.prompt), 5, dtype=torch.long, device=device)
    positions = torch.arange(args.prompt, device=device).unsqueeze(0).expand(batch, -1).contiguous()
    with torch.no_grad():
        plain.decode(ids, positions, cache)
        step_ids = torch.full((batch, 1), 7, dtype=torch.long, device=device)
        step_pos = torch.full((batch, 1), args.prompt, dtype=torch.long, device=device)
        return captured_ms(lambda: plain.decode(step_ids, step_pos, cache), device, args.iterations)


def check_independent(kit, plain, args, device, dtype):
    """The independent model's logits against the kit model's: a ragged prefill (rows of different lengths,
    each at its own positions) and 4 greedy decode steps from a cache of --cache tokens. Returns the check."""
    batch, lengths = 3, [args.prompt, max(1, args.prompt // 2), max(1, args.prompt - 3)]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (batch, args.prompt), generator=gen).to(device)
    positions = torch.arange(args.prompt, device=device).unsqueeze(0).expand(batch, -1).contiguous()
    kit_cache, plain_cache = kit.new_kv_cache(batch, args.cache), plain.new_static_cache(batch, args.cache)
    worst, scale = 0.0, 0.0
    with torch.no_grad():
        a = kit(ids, positions, kit_cache, args.cache)[..., :args.vocab]
        b = plain.decode(ids, positions, plain_cache)
        last = torch.tensor(lengths, device=device) - 1
        rows = torch.arange(batch, device=device)
        for step in range(5):
            if step == 0:  # each row's logits at its last prompt token (a row's pads come after it)
                a, b = a[rows, last], b[rows, last]
            worst = max(worst, (a.float() - b.float()).abs().max().item())
            scale = max(scale, a.float().abs().max().item())
            tokens = a.argmax(-1, keepdim=True)
            step_pos = (last + 1 + step).unsqueeze(1)
            a = kit(tokens, step_pos, kit_cache, args.cache)[:, 0, :args.vocab]
            b = plain.decode(tokens, step_pos, plain_cache)[:, 0]
    tolerance = (1e-4 if dtype == torch.float32 else 0.05) * scale
    return {"what": "independent plain model (static cache) vs kit model, prefill and 4 decode steps",
            "max_abs_diff": worst, "tolerance": tolerance, "ok": worst <= tolerance}


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


def cached_attention(module):
    """Which attention over the KV cache the rank file (`module`, loaded) runs: read from its attention module's
    code, so a run on an export made by older kit code says so (tools/device/bench_common.sh re-exports when
    the kit changes)."""
    try:
        attn = getattr(module.model.layers, "0").self_attn.attn  # a loaded ModuleList has no []
        code = attn._cached.code
    except Exception as e:  # not a kit TorchScript file of a cached model
        return "unknown (%s)" % ((str(e).strip().splitlines() or [type(e).__name__])[0][:120])
    if "scaled_dot_product_attention" in code:
        return "SDPA in the cache's dtype (boolean mask, no float32 copy of the cache)"
    return "explicit float32 matmul/softmax over a float32 copy of the cache (an export by older kit code)"


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
    p.add_argument("--json", help="write the rows, ratios and the independent model's check here")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    scripted = torch.jit.load(args.file, map_location="cpu")
    attention = cached_attention(scripted)
    print("attention over the cache in %s: %s" % (args.file, attention))
    model = fragments.load(args.file, device=str(device))
    saves = ["model.layers.0.output", "model.layers.%d.output" % (args.layers - 1),
             "model.layers.0.mlp.down_proj.input", "model.layers.0.self_attn.o_proj.input"]
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         num_hidden_layers=args.layers, max_position_embeddings=args.max_positions, dtype=dtype)
    kit = LlamaForCausalLM(config).eval()
    # The rank file also holds the rotary tables (buffers the kit's module makes itself): weights only.
    wanted = kit.state_dict().keys()
    kit.load_state_dict({k: v for k, v in scripted.state_dict().items() if k in wanted})
    del scripted
    kit.to(device)
    plain = PlainLlama(args.vocab, args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads,
                       args.head_dim, eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                       max_positions=args.max_positions).to(device, dtype).eval()
    plain.load_kit({k: v.to(device) for k, v in kit.state_dict().items()}, args.vocab)
    check = check_independent(kit, plain, args, device, dtype)
    print("check %s: max |diff| %.3g, tolerance %.3g: %s" % (check["what"], check["max_abs_diff"],
                                                            check["tolerance"], "ok" if check["ok"] else "FAILED"))
    report = {"dtype": args.dtype, "device": str(device), "attention": attention, "checks": [check],
              "batches": {}}
    if not check["ok"]:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return 1
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
                ("plain PyTorch (kit model), CUDA graph", plain_step_ms(kit, batch, args, device)),
                ("independent plain PyTorch, static cache, CUDA graph",
                 independent_step_ms(plain, batch, args, device))]
        if hf is not None:
            rows.append(("transformers generate, dynamic cache", transformers_step_ms(hf, batch, args, device, False)))
            rows.append(("transformers generate, static cache", transformers_step_ms(hf, batch, args, device, True)))
        print("batch %d:" % batch)
        reference = dict(rows).get("transformers generate, static cache")
        for name, ms in rows:
            extra = "   %.2fx transformers static's tokens/s" % (reference / ms) if reference else ""
            print("  %-42s %8.3f ms/step %10.0f tokens/s%s" % (name, ms, batch * 1000 / ms, extra))
        times = dict(rows)
        ratio = times["fragments, nothing registered"] / times["independent plain PyTorch, static cache, CUDA graph"]
        print("  fragments step / independent plain captured step: %.3fx (goal <= 1.3)" % ratio)
        saves_ratio = times["fragments, nothing registered"] / times["fragments, saves at 4 locations"]
        print("  fragments tokens/s, saves at 4 locations / nothing registered: %.3fx (goal >= 0.9)" % saves_ratio)
        entry = {"ms_per_step": times, "fragments_over_independent": ratio, "saves_over_nothing": saves_ratio}
        if reference:
            over_hf = reference / times["fragments, nothing registered"]
            print("  fragments / transformers static cache, tokens/s: %.3fx (goal >= %s)"
                  % (over_hf, "2" if batch == 1 else "1.2"))
            entry["fragments_over_transformers_static"] = over_hf
        report["batches"][str(batch)] = entry
        if device.type == "cuda":
            print("  graphs: %s" % model.graph_stats())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
