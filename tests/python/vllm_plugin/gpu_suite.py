"""The plugin's vLLM checks on one GPU, several at once (each engine holds a tenth of the GPU: engine_env).

    python gpu_suite.py [--jobs 6] [--only REGEX] [--out DIR] [--timeout S]

Cases (tp 1; every family of families.FAMILIES):
  eager-<runner>-<family>      vllm_check.py    (enforce_eager=True, float32)
  cuda-graphs-<runner>-<family> compiled_check.py (torch.compile, vLLM's default CUDA graphs, float32)
  smollm2-<dtype>-<mode>        smollm2_check.py (the real model: float32 and bfloat16, eager and compiled)
  eager-v2-gemma2-nocap, softcap-probe   Gemma 2's GPU difference traced to vLLM's Triton softcap
  smollm2-bfloat16-compiled-taps-*       fewer taps: which ones change bfloat16 compiled numerics
  split-*                       compiled cases with FRAGMENTS_VLLM_GRAPH_TAPS=split (the way before run33; run33 ran
                                the default way's as slots-*)
  cuda-graphs-v2-gpt_neox-dense-* taps at GPT-NeoX's dense layers' inputs, then outputs (compiled_check --only)
  cuda-graphs-v1-qwen3-recompiled / -deterministic   Qwen3 V1's 1 ulp: plain vLLM against itself compiled afresh,
                                and with TORCHINDUCTOR_DETERMINISTIC=1 (launch configs not chosen by timing)
  server-tp1                    server_check.py 1 (vllm serve with per-request plans)
  trace-eager, trace-cuda-graphs trace_check.py / compiled_check.py --trace (fragments.vllm.VLLM's traces)
  nnsight-<family>              nnsight_compare.py (nnsight's VLLM beside the plugin, values against transformers)
  ray-llama                     vllm_check.py --executor ray (vLLM's ray executor at one GPU; ray from
                                tools/device/vllm_stage.sh pack-ray, the case fails without it)
with <runner> v2 and v1 (VLLM_USE_V2_MODEL_RUNNER 1 / 0; vLLM 0.24 picks V2 for Llama, Qwen3 and Qwen2-MoE by
itself). Each case is its own process (vLLM engines do not share a process cleanly); its output goes to
DIR/<case>.log. Prints one line per case as it ends and a table at the end, writes DIR/summary.json, and
exits non-zero if a case failed. Needs vLLM's CUDA build (tools/device/vllm_stage.sh) and fragments._C.
"""
import argparse
import concurrent.futures as futures
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "gemma2", "gpt_neox")


def cases():
    out = []
    for runner in ("v2", "v1"):
        for family in FAMILIES:
            env = {"FRAG_VLLM_RUNNER": runner}
            out.append((f"eager-{runner}-{family}", ["vllm_check.py", family, "1"], env))
            out.append((f"cuda-graphs-{runner}-{family}", ["compiled_check.py", family, "1"], env))
    # the reason float32 differs from transformers by ~1e-3 under vLLM's defaults: its Triton attention in TF32
    out.append(("eager-v2-llama-tf32", ["vllm_check.py", "llama", "1"], {"FRAG_VLLM_RUNNER": "v2", "FRAG_VLLM_TF32": "1"}))
    # Gemma 2 without attention-score softcapping: what is left once vLLM's Triton softcap is out (softcap-probe)
    out.append(("eager-v2-gemma2-nocap", ["vllm_check.py", "gemma2", "1"], {"FRAG_VLLM_RUNNER": "v2",
                                                                            "FRAG_GEMMA2_SOFTCAP": "0"}))
    out.append(("softcap-probe", [os.path.join("..", "..", "..", "tools", "probes", "softcap_probe.py")], {}))
    for dtype in ("float32", "bfloat16"):
        for mode in ("eager", "compiled"):
            extra = ["--compiled"] if mode == "compiled" else []
            out.append((f"smollm2-{dtype}-{mode}", ["smollm2_check.py", "1", "--max-tokens", "64"] + extra,
                        {"FRAG_VLLM_DTYPE": dtype}))
    # bfloat16 compiled, taps at fewer locations: which taps change the compiled engine's numerics
    for name, only in (("none", "none"), ("proj-outputs", r"proj\.output$")):
        out.append((f"smollm2-bfloat16-compiled-taps-{name}",
                    ["smollm2_check.py", "1", "--max-tokens", "64", "--compiled", "--only", only],
                    {"FRAG_VLLM_DTYPE": "bfloat16"}))
    # the way before run33 (FRAGMENTS_VLLM_GRAPH_TAPS=split: taps are splitting ops of vLLM's piecewise graphs);
    # run33 ran the default way's compiled cases as slots-* (the names then)
    split = {"FRAGMENTS_VLLM_GRAPH_TAPS": "split"}
    for runner in ("v2", "v1"):
        for family in FAMILIES:
            out.append((f"split-cuda-graphs-{runner}-{family}", ["compiled_check.py", family, "1"],
                        dict(split, FRAG_VLLM_RUNNER=runner)))
    out.append(("split-smollm2-bfloat16-compiled", ["smollm2_check.py", "1", "--max-tokens", "64", "--compiled"],
                dict(split, FRAG_VLLM_DTYPE="bfloat16")))
    # GPT-NeoX with taps at its dense layers' inputs only, then outputs only: the outputs keep cuBLAS's addmm
    for side in ("input", "output"):
        out.append((f"cuda-graphs-v2-gpt_neox-dense-{side}s", ["compiled_check.py", "gpt_neox", "1", "--only",
                                                               rf"dense(_4h_to_h)?\.{side}$"], {"FRAG_VLLM_RUNNER": "v2"}))
    # Qwen3 on V1, 1 ulp off plain compiled vLLM (run33, run35). Run35's kernels: a tap at the embedding splits
    # Inductor's embedding + RMSNorm kernel in two, and each reduction kernel gets its launch config by timing
    # (autotuning). Whether plain vLLM matches itself compiled afresh, and whether Inductor's deterministic mode
    # (configs not chosen by timing) makes the tapped engine exact:
    out.append(("cuda-graphs-v1-qwen3-recompiled", ["compiled_check.py", "qwen3", "1", "--plain-recompiled"],
                {"FRAG_VLLM_RUNNER": "v1"}))
    # run36: plain vLLM compiled twice differs by 1 ulp under autotuning, and matches itself under deterministic
    # mode; there, which taps are what is left (the embedding's alone, or not):
    det = {"TORCHINDUCTOR_DETERMINISTIC": "1"}
    for runner in ("v1", "v2"):
        for name, only in (("", None), ("-no-embedding", r"^(?!model\.embed_tokens\.)"),
                           ("-embedding-only", r"^model\.embed_tokens\.")):
            out.append((f"cuda-graphs-{runner}-qwen3-deterministic{name}",
                        ["compiled_check.py", "qwen3", "1", "--plain-recompiled"] + (["--only", only] if only else []),
                        dict(det, FRAG_VLLM_RUNNER=runner)))
    out.append(("server-tp1", ["server_check.py", "1"], {}))  # vllm serve on the GPU, plans per request
    # the Python trace API (fragments.vllm.VLLM): eager, and through a compiled engine with CUDA graphs
    out.append(("trace-eager", ["trace_check.py", "1"], {}))
    out.append(("trace-cuda-graphs", ["compiled_check.py", "llama", "1", "--trace"], {}))
    # nnsight 0.8.1's VLLM (its own GPU worker, unpatched) and the plugin in one engine, both against transformers
    for family in ("llama", "qwen2_moe"):
        out.append((f"nnsight-{family}", ["nnsight_compare.py", family, "1"], {}))
    # issue 42: the plugin through vLLM's ray executor on one GPU (ray staged apart: vllm_stage.sh pack-ray)
    out.append(("ray-llama", ["vllm_check.py", "llama", "1", "--executor", "ray"], {}))
    return out


def run(case, out_dir, timeout):
    name, argv, env = case
    full = dict(os.environ, **env)
    full.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")  # several compiles at once share the CPUs
    log = os.path.join(out_dir, f"{name}.log")
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, argv[0])] + argv[1:], env=full, cwd=HERE,
                              capture_output=True, text=True, timeout=timeout)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or ""), f"timed out after {timeout} s"
    seconds = time.time() - t0
    with open(log, "w") as f:
        f.write(stdout + "\n---- stderr ----\n" + (stderr or ""))
    lines = stdout.splitlines()
    fails = [l for l in lines if l.startswith("FAIL")]
    summary = next((json.loads(l) for l in reversed(lines) if l.startswith("{")), {})
    return {"case": name, "rc": rc, "seconds": round(seconds, 1), "passed": sum(l.startswith("ok") for l in lines),
            "failed": fails, "worst_rel": summary.get("worst_rel"), "runner": summary.get("runner"),
            "graphs": summary.get("graphs"), "engine_start_s": summary.get("engine_start_s"),
            "tail": "" if rc == 0 else (stderr or "")[-1500:]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--only", default=".")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/frag-gpu-suite"))
    ap.add_argument("--timeout", type=int, default=480)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    chosen = [c for c in cases() if re.search(args.only, c[0])]
    results = []
    with futures.ThreadPoolExecutor(args.jobs) as pool:
        for done in futures.as_completed([pool.submit(run, c, args.out, args.timeout) for c in chosen]):
            r = done.result()
            results.append(r)
            ok = r["rc"] == 0
            print(f"{'PASS' if ok else 'FAIL'} {r['case']:<28} {r['seconds']:6.1f} s  {r['passed']} ok, "
                  f"{len(r['failed'])} failed  runner {r['runner']} graphs {r['graphs']} worst {r['worst_rel']}"
                  + ("" if ok else "\n    " + "\n    ".join(r["failed"][:6]) + "\n    " + r["tail"][-600:].replace("\n", "\n    ")),
                  flush=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    bad = [r["case"] for r in results if r["rc"] != 0]
    print(f"{len(results) - len(bad)} passed, {len(bad)} failed{': ' + ', '.join(bad) if bad else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
