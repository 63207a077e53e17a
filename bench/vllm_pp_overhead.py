"""Engine start and per-request cost at pipeline_parallel_size 2 against 1, fragments' plugin beside plain vLLM
(vLLM's CPU build, one run; issue 42).

    python bench/vllm_pp_overhead.py [--requests 8 --max-tokens 8] [--json bench/results/vllm_pp_overhead_cpu.json]

A 4-layer Llama written by transformers (tests/python/vllm_plugin/pp_check.py's, fp32), eager, tp 1. Four
engines, each in its own process, one after another: plain vLLM (no plugin: FRAGMENTS_VLLM=0, no entry point)
and the plugin, each at pp 1 and pp 2 (vLLM's mp executor; at pp 1 the mp executor too, so both columns run
workers in their own processes). Per engine: the seconds from LLM(...) to ready, then --requests rounds of
one request alone (a 16-token prompt, --max-tokens greedy tokens, ignore_eos): a plain request, and (plugin
engines) the same request with a plan saving 4 locations on both stages at every step (layer 0's q|k|v,
layer 1's MLP input, layer 2's output, the logits) and its saves fetched (fv.generate). Reports medians.
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
PLUGIN = os.path.join(ROOT, "tests", "python", "vllm_plugin")
PLAN = [{"at": "model.layers.0.self_attn.qkv_proj.output", "do": "save", "as": "qkv0"},
        {"at": "model.layers.1.mlp.down_proj.input", "do": "save", "as": "down1"},
        {"at": "model.layers.2.output", "do": "save", "as": "h2"},
        {"at": "logits_processor.output", "do": "save", "as": "final_logits"}]


def child(args):
    """One engine: its start and per-request times, as one JSON line on stdout."""
    from fragments import vllm as fv
    from vllm import LLM
    t0 = time.perf_counter()
    llm = LLM(args.model, pipeline_parallel_size=args.pp, enforce_eager=True, dtype="float32",
              skip_tokenizer_init=True, max_model_len=64, enable_prefix_caching=False, max_num_seqs=8, seed=0,
              distributed_executor_backend="mp")
    start = time.perf_counter() - t0
    prompt = {"prompt_token_ids": list(range(3, 19))}
    kw = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    plain, planned = [], []
    for i in range(args.requests + 1):  # the first round warms up
        t = time.perf_counter()
        fv.generate(llm, [prompt], [None], **kw)
        p = time.perf_counter() - t
        if args.plugin:
            t = time.perf_counter()
            out = fv.generate(llm, [prompt], [PLAN], **kw)[0]
            q = time.perf_counter() - t
            assert sorted(out.fragments) == sorted(s["as"] for s in PLAN), out.fragments_error
        if i:
            plain.append(p)
            if args.plugin:
                planned.append(q)
    print(json.dumps({"start_s": start, "plain_ms": 1e3 * statistics.median(plain),
                      "plan_ms": 1e3 * statistics.median(planned) if planned else None}), flush=True)
    llm.llm_engine.engine_core.shutdown()  # the engine's processes end here: they outlive os._exit
    os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "vllm_pp_overhead_cpu.json"))
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--pp", type=int)
    ap.add_argument("--plugin", type=int)
    args = ap.parse_args()
    sys.path[:0] = [os.path.join(ROOT, "python"), PLUGIN]
    if args.child:
        return child(args)
    import pp_check
    from vllm_check import plugin_dist, work_folder
    work = work_folder("frag-pp-bench-")  # removed at exit, whatever the end (FRAG_KEEP_WORK=1 keeps it)
    folder = os.path.join(work, "model")
    pp_check.write_llama(folder)
    site = plugin_dist(os.path.join(work, "site"))
    rows = []
    for pp in (1, 2):
        for plugin in (0, 1):
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
                       VLLM_CPU_OMP_THREADS_BIND="0|1" if pp == 2 else "0-1",
                       PYTHONPATH=os.pathsep.join(([site] if plugin else []) + [os.path.join(ROOT, "python"),
                                                                                os.environ.get("PYTHONPATH", "")]))
            if not plugin:
                env["FRAGMENTS_VLLM"] = "0"
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", folder, "--pp", str(pp),
                   "--plugin", str(plugin), "--requests", str(args.requests), "--max-tokens", str(args.max_tokens)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("{")), None)
            if line is None:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"pp {pp} plugin {plugin}: no result")
            rows.append({"pp": pp, "engine": "plugin" if plugin else "plain", **json.loads(line)})
            print(json.dumps(rows[-1]), flush=True)
    print("| pp | engine | start (s) | plain request (ms) | request with a 4-location plan (ms) |")
    print("|---|---|---|---|---|")
    for r in rows:
        plan = f"{r['plan_ms']:.0f}" if r["plan_ms"] else ""
        print(f"| {r['pp']} | {r['engine']} | {r['start_s']:.1f} | {r['plain_ms']:.0f} | {plan} |")
    with open(args.json, "w") as f:
        json.dump({"requests": args.requests, "max_tokens": args.max_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
