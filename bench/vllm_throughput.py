"""vLLM's throughput with fragments' plugin against plain vLLM (and nnsight's VLLM), CPU, one run.

    python bench/vllm_throughput.py [--prompts 64 --prompt-len 32 --max-tokens 32 --rounds 2 --reps 3]
                                    [--nnsight] [--json out.json]

Load: vLLM's offline `LLM.generate` with all prompts at once (continuous batching over --prompts requests,
greedy, ignore_eos: every request makes exactly --max-tokens tokens); tokens/s = generated tokens / wall
time of generate (and, where plans save, of fetching the saves). A Llama written by transformers'
save_pretrained (hidden 512, 8 heads / 4 kv heads of 64, 4 layers, MLP 1536, vocab 4096; fp32), tp 1,
enforce_eager=True in every column (fragments' hooks need eager mode; plain vLLM runs eager too, so the
columns differ only by the plugin). Columns, each an engine in its own process (one engine at a time):
  plain     vLLM without the plugin (no entry points on the path)
  none      the plugin loaded, no request with a plan
  quarter   the plugin loaded, every 4th request saving 4 locations at every step (layer 0's fused qkv
            output, layer 1's MLP down-projection input, layer 2's output, the final norm's output),
            saves fetched with fragments.vllm.take_saves
  nnsight   nnsight 0.8.1's VLLM (bench/nnsight_vllm_shim.py: its CPU worker), the same prompts as
            invokes of one trace: nothing saved (nnsight_none), and every 4th invoke saving the same 4
            locations at every step (nnsight_quarter)
Interleaved: --rounds times (plain engine, plugin engine[, nnsight engine]); inside the plugin engine
none and quarter alternate for --reps repetitions after one warm-up each. The report gives, per column,
the median tokens/s (wall) and the median tokens per CPU second (user + system of the benchmark and the
vLLM processes it starts: steadier than wall time on a shared machine), each as a ratio to plain.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOCATIONS = ("model.layers.0.self_attn.qkv_proj.output", "model.layers.1.mlp.down_proj.input",
             "model.layers.2.output", "model.norm.output")


def write_model(folder):
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4, intermediate_size=1536, max_position_embeddings=256,
                                   torch_dtype="float32")
    transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).save_pretrained(folder)
    # a word-level tokenizer (w0 … w4095): nnsight's VLLM loads one; prompts are token ids
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1",
                                         eos_token="w2").save_pretrained(folder)


def cpu_seconds():
    """User + system CPU seconds of this process and every process it started (vLLM's engine core and
    workers): a rate per CPU second is far less sensitive to other load on a shared machine than wall time."""
    import psutil
    me = psutil.Process()
    total = 0.0
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def timed(fn):
    """(wall seconds, CPU seconds) of fn()."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


def prompts(n, length):
    import random
    rng = random.Random(0)
    return [[rng.randrange(3, 4096) for _ in range(length)] for _ in range(n)]


def child_vllm(args, mode):
    from vllm import LLM, SamplingParams
    llm = LLM(args.model, tensor_parallel_size=1, enforce_eager=True, dtype="float32", max_model_len=256,
              enable_prefix_caching=False, max_num_seqs=args.prompts, seed=0)
    ps = [{"prompt_token_ids": p} for p in prompts(args.prompts, args.prompt_len)]
    sampling = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    tokens = args.prompts * args.max_tokens

    def generate(column):
        if column == "quarter":
            from fragments import vllm as fv
            plan = [{"at": loc, "do": "save", "as": loc, "step": "all"} for loc in LOCATIONS]
            outs = fv.generate(llm, ps, [plan if i % 4 == 0 else None for i in range(len(ps))], **sampling)
            assert all(o.fragments_error is None for o in outs)
            assert all(len(o.fragments) == 4 for o in outs[::4])
        else:
            outs = llm.generate(ps, SamplingParams(**sampling), use_tqdm=False)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == tokens

    def run(column):
        wall, cpu = timed(lambda: generate(column))
        return tokens / wall, tokens / cpu

    columns = ["plain"] if mode == "plain" else ["none", "quarter"]
    for c in columns:
        run(c)  # warm-up
    for _ in range(args.reps):
        for c in columns:
            rate, per_cpu = run(c)
            print(json.dumps({"column": c, "tokens_per_s": rate, "tokens_per_cpu_s": per_cpu}), flush=True)


def child_nnsight(args):
    sys.path.insert(0, HERE)
    import nnsight
    import nnsight_vllm_shim  # noqa: F401  (nnsight's VLLM on vLLM's CPU worker)
    from nnsight.modeling.vllm import VLLM
    model = VLLM(args.model, tensor_parallel_size=1, dtype="float32", dispatch=True, max_model_len=256,
                 enable_prefix_caching=False, max_num_seqs=args.prompts, seed=0)
    from vllm.inputs import TokensPrompt
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(args.prompts, args.prompt_len)]
    tokens = args.prompts * args.max_tokens

    def envoy(loc):
        path, side = loc.rsplit(".", 1)
        e = model
        for part in path.split("."):
            e = e[int(part)] if part.isdigit() else getattr(e, part)
        return e, side

    def run(column):
        out = {}
        wall, cpu = timed(lambda: out.setdefault("n", trace(column)))
        return tokens / wall, tokens / cpu, out["n"]

    def trace(column):
        with model.trace(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True) as tracer:
            # one dict above the invokes: each invoke (its own vLLM request, with its own copy) fills its key,
            # and nnsight merges the copies by key (nnsight/modeling/vllm/collect.py)
            bucket = nnsight.save({})
            for i, p in enumerate(ps):
                with tracer.invoke(p):
                    if column == "nnsight_quarter" and i % 4 == 0:
                        mine = []
                        for _ in tracer.iter[:args.max_tokens]:  # every forward: prefill, then each decode
                            for loc in LOCATIONS:
                                e, side = envoy(loc)
                                v = e.output if side == "output" else e.input
                                mine.append((v[0] if isinstance(v, tuple) else v).clone())
                        bucket[i] = mine
        return sum(len(v) for v in bucket.values())

    expected = (args.prompts + 3) // 4 * len(LOCATIONS) * args.max_tokens
    for c in ("nnsight_none", "nnsight_quarter"):
        run(c)
    for _ in range(args.reps):
        for c in ("nnsight_none", "nnsight_quarter"):
            rate, per_cpu, n = run(c)
            if c == "nnsight_quarter" and n != expected:  # reported, not hidden: then it saved nothing usable
                c = f"nnsight_quarter (INVALID: {n} of {expected} values came back)"
            print(json.dumps({"column": c, "tokens_per_s": rate, "tokens_per_cpu_s": per_cpu, "saved": n}), flush=True)


def spawn(args, mode, site):
    env = dict(os.environ)
    paths = [os.path.join(ROOT, "python")] + ([site] if mode == "plugin" else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model", args.model,
           "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--max-tokens",
           str(args.max_tokens), "--reps", str(args.reps)]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not rows:
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"{mode} engine failed ({proc.returncode})")
    print(f"{mode}: {len(rows)} runs in {time.time() - t0:.0f} s (engine start included)", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nnsight", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--child")
    ap.add_argument("--model")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max((os.cpu_count() or 1) - 1, 0)}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.child == "nnsight":
        return child_nnsight(args)
    if args.child:
        return child_vllm(args, args.child)

    sys.path.insert(0, os.path.join(ROOT, "tests", "python", "vllm_plugin"))
    from vllm_check import plugin_dist
    work = tempfile.mkdtemp(prefix="frag-vllm-bench-")
    args.model = os.path.join(work, "model")
    write_model(args.model)
    site = plugin_dist(os.path.join(work, "site"))
    load_before = os.getloadavg()
    results, per_cpu = {}, {}
    for _ in range(args.rounds):
        for mode in ["plain", "plugin"] + (["nnsight"] if args.nnsight else []):
            for row in spawn(args, mode, site):
                results.setdefault(row["column"], []).append(row["tokens_per_s"])
                per_cpu.setdefault(row["column"], []).append(row["tokens_per_cpu_s"])
    median = {c: statistics.median(v) for c, v in results.items()}
    median_cpu = {c: statistics.median(v) for c, v in per_cpu.items()}
    report = {"settings": {k: getattr(args, k) for k in ("prompts", "prompt_len", "max_tokens", "rounds", "reps")},
              "load_before": load_before, "load_after": os.getloadavg(), "tokens_per_s": results,
              "tokens_per_cpu_s": per_cpu, "median": median, "median_per_cpu_s": median_cpu,
              "ratio_to_plain": {c: m / median["plain"] for c, m in median.items()},
              "ratio_to_plain_per_cpu_s": {c: m / median_cpu["plain"] for c, m in median_cpu.items()}}
    print("| column | median tokens/s (wall) | × plain | median tokens per CPU s | × plain | wall runs |")
    print("|---|---|---|---|---|---|")
    for c, m in median.items():
        print(f"| {c} | {m:.1f} | {m / median['plain']:.3f} | {median_cpu[c]:.1f} | "
              f"{median_cpu[c] / median_cpu['plain']:.3f} | {', '.join(f'{x:.0f}' for x in results[c])} |")
    print(f"load average before {load_before[0]:.1f}, after {report['load_after'][0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()
