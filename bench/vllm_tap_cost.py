"""What compiled mode's taps cost: compiled vLLM (enforce_eager=False, Inductor) with and without fragments'
taps, CPU, side by side in one run.

    python bench/vllm_tap_cost.py [--prompts 64 --prompt-len 32 --max-tokens 32 --rounds 2 --reps 3] [--json out.json]

The model, prompts and load are bench/vllm_throughput.py's (a Llama written by transformers' save_pretrained:
hidden 512, 8 heads / 4 kv heads, 4 layers, MLP 1536, vocab 4096, fp32; tp 1; `LLM.generate` with all prompts
at once, greedy, ignore_eos), but every engine is compiled. Columns, each engine in its own process:
  plain     compiled vLLM without the plugin (no entry points on the path)
  plugin    the plugin loaded, nothing tapped (its per-step work and logits-processor plugin, no tap)
  taps      the plugin loaded, 4 locations tapped at start (additional_config fragments_taps: layer 0's fused
            qkv output, layer 1's MLP down-projection input, layer 2's output, the final norm's output),
            no request with a plan: what a tap costs when nothing acts
  quarter   the same engine, every 4th request saving those 4 locations at every step (saves fetched)
Interleaved: --rounds times (plain engine, plugin engine, tapped engine); inside the tapped engine taps and quarter
alternate for --reps repetitions after one warm-up each. Per column: the median tokens/s (wall) and
tokens per CPU second (user + system of this process and the vLLM processes it starts), as ratios to plain.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from vllm_throughput import LOCATIONS, prompts, timed, write_model  # noqa: E402  (the same model and load)


def child(args, mode):
    from vllm import LLM, SamplingParams
    extra = {"additional_config": {"fragments_taps": list(LOCATIONS)}} if mode == "tapped" else {}
    llm = LLM(args.model, tensor_parallel_size=1, enforce_eager=False, dtype="float32", max_model_len=256,
              enable_prefix_caching=False, max_num_seqs=args.prompts, seed=0, **extra)
    ps = [{"prompt_token_ids": p} for p in prompts(args.prompts, args.prompt_len)]
    sampling = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    tokens = args.prompts * args.max_tokens
    if mode == "tapped":
        from fragments import vllm as fv
        assert fv.inspect(llm)["taps"] == sorted(LOCATIONS)

    def generate(column):
        if column == "quarter":
            plan = [{"at": loc, "do": "save", "as": loc, "step": "all"} for loc in LOCATIONS]
            outs = fv.generate(llm, ps, [plan if i % 4 == 0 else None for i in range(len(ps))], **sampling)
            assert all(o.fragments_error is None for o in outs)
            assert all(len(o.fragments) == 4 and o.fragments[LOCATIONS[0]].shape[0] == args.prompt_len +
                       args.max_tokens - 1 for o in outs[::4])
        else:
            outs = llm.generate(ps, SamplingParams(**sampling), use_tqdm=False)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == tokens

    columns = {"plain": ["plain"], "plugin": ["plugin"], "tapped": ["taps", "quarter"]}[mode]
    for c in columns:
        generate(c)  # warm-up
    for _ in range(args.reps):
        for c in columns:
            wall, cpu = timed(lambda: generate(c))
            print(json.dumps({"column": c, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu}), flush=True)
    if mode == "tapped":
        stats = llm.collective_rpc("fragments_compile_stats")[0]
        print(json.dumps({"stats": stats}), flush=True)


def spawn(args, mode, site):
    env = dict(os.environ)
    paths = [os.path.join(ROOT, "python")] + ([site] if mode != "plain" else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env["VLLM_CACHE_ROOT"] = os.path.join(args.work, f"cache-{mode}")  # each engine compiles its own graph
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model", args.model, "--work", args.work,
           "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--max-tokens",
           str(args.max_tokens), "--reps", str(args.reps)]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not rows:
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"{mode} engine failed ({proc.returncode})")
    print(f"{mode}: {len(rows)} rows in {time.time() - t0:.0f} s (engine start and compile included)", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--child")
    ap.add_argument("--model")
    ap.add_argument("--work")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max((os.cpu_count() or 1) - 1, 0)}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.child:
        return child(args, args.child)

    sys.path.insert(0, os.path.join(ROOT, "tests", "python", "vllm_plugin"))
    from vllm_check import plugin_dist, remove_work, work_folder
    args.work = work_folder("frag-vllm-tapcost-")  # removed at the end or at exit (a failed engine)
    args.model = os.path.join(args.work, "model")
    write_model(args.model)
    site = plugin_dist(os.path.join(args.work, "site"))
    load_before = os.getloadavg()
    results, per_cpu, stats = {}, {}, []
    for _ in range(args.rounds):
        for mode in ("plain", "plugin", "tapped"):
            for row in spawn(args, mode, site):
                if "stats" in row:
                    stats.append(row["stats"])
                    continue
                results.setdefault(row["column"], []).append(row["tokens_per_s"])
                per_cpu.setdefault(row["column"], []).append(row["tokens_per_cpu_s"])
    median = {c: statistics.median(v) for c, v in results.items()}
    median_cpu = {c: statistics.median(v) for c, v in per_cpu.items()}
    report = {"settings": {k: getattr(args, k) for k in ("prompts", "prompt_len", "max_tokens", "rounds", "reps")},
              "locations": list(LOCATIONS), "load_before": load_before, "load_after": os.getloadavg(),
              "tokens_per_s": results, "tokens_per_cpu_s": per_cpu, "median": median, "median_per_cpu_s": median_cpu,
              "ratio_to_plain": {c: m / median["plain"] for c, m in median.items()},
              "ratio_to_plain_per_cpu_s": {c: m / median_cpu["plain"] for c, m in median_cpu.items()},
              "compile_stats": stats}
    print("| column | median tokens/s (wall) | × plain | median tokens per CPU s | × plain | wall runs |")
    print("|---|---|---|---|---|---|")
    for c, m in median.items():
        print(f"| {c} | {m:.1f} | {m / median['plain']:.3f} | {median_cpu[c]:.1f} | "
              f"{median_cpu[c] / median_cpu['plain']:.3f} | {', '.join(f'{x:.0f}' for x in results[c])} |")
    print(f"load average before {load_before[0]:.1f}, after {report['load_after'][0]:.1f}; "
          f"tapped engines' Dynamo graphs {[s['dynamo_graphs'] for s in stats]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    remove_work()


if __name__ == "__main__":
    main()
