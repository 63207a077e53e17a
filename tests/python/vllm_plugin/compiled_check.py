"""fragments' plugin on a COMPILED vLLM engine (enforce_eager=False: torch.compile, Inductor) against
transformers' hooks and against plain compiled vLLM: one tapped engine, one plain engine (a child process).

    python compiled_check.py FAMILY TP [--heads H --kv-heads K] [--trace]

A tiny checkpoint of FAMILY (families.py: llama, qwen2, qwen3, qwen2_moe, gemma2, gpt_neox; transformers'
save_pretrained, 4 heads, 2 kv heads), fp32, at tensor_parallel_size TP. The tapped engine declares its taps at
start (additional_config {"fragments_taps": [globs]}: every location of families.Reader — q|k|v, the attention
output projection's input and output, gate|up, the down projection's input and output, for Qwen2-MoE the shared
expert's and the experts' output — in every layer by a `layers.*` glob, the embedding, the logits). Checks,
one line each, exit non-zero on a failure:
  the engine compiled the model (Dynamo traced it) and the taps are the declared locations;
  batch 1 [prompt A plain, prompt A with a read-only plan]: every saved whole value (q|k|v and gate|up in
    logical order, row-layer inputs, all-reduced outputs and partial sums, the MoE output, the embedding)
    equals transformers' forward hooks within 1e-5 relative; the logits at every step and a down projection
    input at every step equal transformers' forward over the prompt plus the generated tokens (vllm_check.
    check_saves); both requests' tokens and logprobs equal (exactly) those of the same batch on a plain
    compiled vLLM engine (no plugin, no taps);
  batch 2 [prompt B with an edit, prompt A plain]: families.Edit (a v head scaled through "segment"/"heads",
    a vector added to layer 1's down projection input at every step) gives transformers' greedy tokens under
    the same hooks, and layer 1's q|k|v and the logits equal transformers' under them (vllm_check.check_edit);
    the plain row is unchanged;
  --trace (Llama): every check of trace_check.py (fragments.vllm.VLLM: saves, head views, logit lens, edits,
    generate with per-step scopes, invokes, .apply, patching within and across prompts) through this
    compiled engine (VLLM(llm=llm); model.norm.output tapped as well, for the logit lens), and a trace naming
    an untapped location refused where it is recorded;
  a plan naming an untapped location is refused at submission (that request alone, the message names the
    location and fragments_taps), and the engine runs on;
  fragments_compile_stats (every rank): Dynamo compiled the model's forward once before the requests and never
    during them (whatever the plans, traces included; vLLM's own helpers compiled on first use are listed),
    vLLM's compile counters unchanged, and every tap's body ran exactly once per forward.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)



def taps_for(locs, trace):
    """The globs declared at start: each location of `locs` with its layer number as `*`, the logits, and for
    --trace the final norm's output (the logit lens)."""
    globs = {re.sub(r"\.layers\.\d+\.", ".layers.*.", loc) for loc in locs} | {"logits_processor.output"}
    return sorted(globs | ({"model.norm.output"} if trace else set()))


def env_for(tp, work):
    import engine_env
    engine_env.setup(tp)
    # a fresh compile cache: the model is traced here (with its taps), not loaded from an earlier run
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(work, "vllm-cache")


def engine(folder, tp, enforce_eager=False, **kw):
    """A compiled engine with vLLM's default CUDA-graph mode on a GPU (FULL_AND_PIECEWISE in vLLM 0.24; at most 8
    sequences: graphs of up to 8 tokens for decode batches, the capture sizes vLLM derives for the rest)."""
    import engine_env
    from vllm import LLM
    return LLM(folder, tensor_parallel_size=tp, enforce_eager=enforce_eager, dtype=engine_env.DTYPE, skip_tokenizer_init=True,
               max_model_len=128, enable_prefix_caching=False, max_num_seqs=8, seed=0, **engine_env.engine_kwargs(), **kw)


def tokens_and_logprobs(r):
    return {"tokens": list(r.outputs[0].token_ids),
            "logprobs": [{str(k): v.logprob for k, v in d.items()} for d in r.outputs[0].logprobs]}


SAMPLING = {"max_tokens": 4, "temperature": 0.0, "logprobs": 2}


def child_plain(args):
    """Plain compiled vLLM (no plugin on the path): batch 1's prompts, printed as JSON."""
    from vllm import SamplingParams
    env_for(args.tp, args.work)
    llm = engine(args.model, args.tp, enforce_eager=args.eager)
    prompt_a = json.loads(args.prompt)
    sampling = dict(SAMPLING, max_tokens=args.max_tokens or SAMPLING["max_tokens"])
    # the batch twice: whether plain vLLM reproduces itself bit for bit (its CPU MoE may not: check_plain)
    runs = [[tokens_and_logprobs(r) for r in llm.generate([{"prompt_token_ids": prompt_a}] * 2,
                                                          SamplingParams(**sampling), use_tqdm=False)]
            for _ in range(2)]
    print("PLAIN " + json.dumps(runs[0] + [runs[0] == runs[1]]), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


def plain_run(tp, folder, work, prompt, eager=False, max_tokens=None, name="plain"):
    """Plain vLLM (compiled, or eager) on [prompt, prompt] (SAMPLING) in a child process without the plugin: its
    tokens and logprobs (None if it failed: a failed check), and the seconds it took. `name`: its folder in
    `work` (its own compile cache)."""
    from vllm_check import check
    env = dict(os.environ)
    env["FRAGMENTS_VLLM"] = "0"  # and no plugin dist on its path: vLLM as it comes, but for its CPU MoE bug:
    # vLLM 0.24's float32 CPU MoE fails without a config context ("Current vLLM config is not set"), plugin or
    # not; a dist-info of its own applies only the plugin's fix (the same math as a plain function) in every
    # vLLM process, so that plain vLLM runs MoE at all. Dense models never reach that code.
    fix = os.path.join(work, "plain-site", "fragments_moe_fix-0.1.dist-info")
    os.makedirs(fix, exist_ok=True)
    with open(os.path.join(fix, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: fragments-moe-fix\nVersion: 0.1\n")
    with open(os.path.join(fix, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nfragments_moe_fix = fragments.vllm._vllm_api:cpu_moe_workaround\n")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and not os.path.isdir(os.path.join(p, "fragments_vllm_plugin-0.1.dist-info"))]
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(fix)] + paths)
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "llama", str(tp), "--child-plain",  # (any family)
                           "--model", folder, "--work", os.path.join(work, name), "--prompt", json.dumps(prompt),
                           "--max-tokens", str(max_tokens or 0)] + (["--eager"] if eager else []),
                          env=env, capture_output=True, text=True, timeout=900)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("PLAIN ")), None)
    seconds = time.time() - t0
    ran = proc.returncode == 0 and line is not None
    check(f"plain {'eager' if eager else 'compiled'} vLLM ran" + ("" if name == "plain" else f" ({name})"), ran,
          f"{seconds:.0f} s" if ran else f"exit {proc.returncode}: {proc.stderr[-3000:]}")
    return (json.loads(line[6:]) if line else None), seconds


def logprob_gap(a, b):
    """The largest |logprob difference| between two requests' tokens_and_logprobs, over the tokens both list."""
    return max((abs(x[k] - y[k]) for x, y in zip(a["logprobs"], b["logprobs"]) for k in x if k in y), default=0.0)


def check_plain(plain, r0, r1, moe=False, what="compiled"):
    """[plain request, read-only plan] on prompt A against plain compiled vLLM's same batch: exactly equal.
    MoE (as vllm_check.py): tokens equal and logprobs within 1e-5. vLLM's CPU experts group the tokens of every
    request in a step, and whether the two requests share a step depends on when they reach the engine-core
    process, so the bits vary with timing, plugin or not (the line says whether plain vLLM reproduced
    itself across two identical batches, and the gap)."""
    from vllm_check import check
    if plain is None:
        return
    plain, reproducible = plain[:2], plain[2]
    got = [tokens_and_logprobs(r0), tokens_and_logprobs(r1)]
    if plain[0] == plain[1] and not moe:
        # within the one engine, where a second compile's own bits cannot enter (plain compiled vLLM need not
        # match itself compiled afresh on a GPU: run36): the plan changes nothing its plain twin does not have
        check("read-only plan: tokens and logprobs equal the plain row's beside it in the same engine (exactly)",
              got[1] == got[0], f"max |dlogprob| {logprob_gap(got[0], got[1]):.2e}")
    for name, i in [(f"read-only plan: tokens and logprobs equal plain {what} vLLM's (no plugin, no taps; exactly"
                     f"{'; MoE: tokens, and logprobs within 1e-5' if moe else ''})", 1),
                    (f"no plan: the plain row beside it equals plain {what} vLLM's (exactly"
                     f"{'; MoE: tokens, and logprobs within 1e-5' if moe else ''})", 0)]:
        exact = got[i] == plain[i]
        ok = exact or (moe and got[i]["tokens"] == plain[i]["tokens"] and logprob_gap(got[i], plain[i]) <= 1e-5)
        check(name, ok, f"{got[i]['tokens']} vs {plain[i]['tokens']}; exact {exact}, max |dlogprob| "
              f"{logprob_gap(got[i], plain[i]):.2e}; plain vLLM bit-reproducible across two identical batches: {reproducible}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("family", choices=("llama", "qwen2", "qwen3", "qwen2_moe", "gemma2", "gpt_neox"))
    ap.add_argument("tp", type=int)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--trace", action="store_true", help="also trace_check.py's checks through this engine (Llama)")
    ap.add_argument("--child-plain", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--work")
    ap.add_argument("--prompt")
    ap.add_argument("--eager", action="store_true", help="--child-plain: an eager engine")
    ap.add_argument("--max-tokens", type=int, default=0, help="--child-plain: tokens per request (0: SAMPLING's)")
    ap.add_argument("--only", help="tap only the locations this regex matches (default: every location)")
    ap.add_argument("--plain-recompiled", action="store_true",
                    help="also compile plain vLLM a second time (a fresh cache) and say whether it matches itself")
    args = ap.parse_args()
    if args.child_plain:
        return child_plain(args)
    if args.trace and args.family != "llama":
        raise SystemExit("compiled_check.py: --trace runs trace_check.py's checks, written for the tiny Llama")

    from vllm_check import (FAILED, check, check_edit, check_saves, down0_input, plugin_dist, read_plan, use_bound,
                            work_folder)
    use_bound(args.family)
    work = work_folder(f"frag-vllm-compiled-{args.family}-tp{args.tp}-")  # the --child-plain's folder inside it
    import torch
    import families

    folder = os.path.join(work, "model")
    families.write_checkpoint(args.family, folder, args.heads, args.kv_heads)
    cfg = families.config(args.family, args.heads, args.kv_heads)
    reader = families.Reader(args.family, cfg)
    locs = reader.locations()
    if args.only:  # fewer taps: which ones change the compiled engine's numerics
        locs = {loc: spec for loc, spec in locs.items() if re.search(args.only, loc)}
    g = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(1, cfg.vocab_size, (7,), generator=g).tolist()
    prompt_b = torch.randint(1, cfg.vocab_size, (5,), generator=g).tolist()
    edit = families.Edit(args.family, cfg, g)
    edit.write(work)
    taps = taps_for(locs, args.trace)
    untapped = f"{reader.layer_prefix(0)}.output"

    # plain compiled vLLM first, in its own process without the plugin (one engine at a time on this machine)
    plain, plain_s = plain_run(args.tp, folder, work, prompt_a)
    if args.plain_recompiled and plain is not None:
        # plain vLLM against itself compiled afresh (a cache of its own): Inductor picks some kernels' launch
        # configs by timing them, so two compiles of one model need not agree to the bit (a note, not a check)
        again, _ = plain_run(args.tp, folder, work, prompt_a, name="plain-again")
        if again is not None:
            same = again[:2] == plain[:2]
            gap = max(logprob_gap(a, b) for a, b in zip(plain[:2], again[:2]))
            print(f"note plain compiled vLLM against itself compiled afresh: exact {same}, max |dlogprob| {gap:.2e}",
                  flush=True)

    site = plugin_dist(os.path.join(work, "site"))
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = site + os.pathsep + os.environ.get("PYTHONPATH", "")
    env_for(args.tp, work)
    from fragments import vllm as fv

    t0 = time.time()
    llm = engine(folder, args.tp, additional_config={"fragments_taps": taps})
    start_s = time.time() - t0
    import engine_env
    print(f"engine start {start_s:.1f} s (compiled, {engine_env.describe()}, taps {taps})", flush=True)

    info = fv.inspect(llm)
    print(f"runner {info.get('runner')}, graphs {info.get('graphs')}", flush=True)
    if engine_env.GPU:
        from fragments.vllm import _tap
        way = _tap.graph_way()  # the plugin's own reading of FRAGMENTS_VLLM_GRAPH_TAPS
        check(f"CUDA graphs kept ({way}): " + ("taps are splitting ops of vLLM's piecewise graphs" if way == "split"
                                               else "taps inside vLLM's pieces, copied to slots in every graph"),
              info.get("graphs") == {"split": "piecewise", "slots": "slots"}.get(way), str(info.get("graphs")))
    want_taps = sorted(set(locs) | {"logits_processor.output"} | ({"model.norm.output"} if args.trace else set()))
    check("inspect: a compiled engine, its taps the declared locations", info["compiled"] and info["taps"] == want_taps,
          f"{info['compiled']} {info['taps']}")
    # locations vLLM runs inside an op torch.compile does not trace: a captured graph would replay them without the
    # plugin, so they are refused (found while vLLM captures its graphs at start; on a GPU: the fused-MoE op's
    # shared expert). The checks below read every other location, and a plan naming one is refused.
    opaque = {loc: why for loc, why in info["refused"].items() if "opaque" in why}
    if engine_env.GPU and args.family == "qwen2_moe" and info.get("graphs") == "piecewise":
        check("the shared expert, run inside vLLM's fused-MoE op, is refused with the reason, not skipped",
              opaque and all(".shared_expert." in loc for loc in opaque), json.dumps(opaque)[:300])
    elif engine_env.GPU and args.family == "qwen2_moe":  # slots: its captured copy serves it like any other tap's
        check("the shared expert, run inside vLLM's fused-MoE op, is served (its slot copy captured), not refused",
              not opaque and any(".shared_expert." in loc for loc in locs), json.dumps(opaque)[:300])
    locs = {loc: spec for loc, spec in locs.items() if loc not in opaque}

    def stats():
        return llm.collective_rpc("fragments_compile_stats")
    before = stats()
    # vLLM 0.24 with torch 2.11 compiles ahead of time (torch.compile's aot_compile, counted by vLLM) unless its
    # compile cache is off; then Dynamo compiles the forward's frame (seen by the bytecode hook)
    check("the engine compiled the model's forward (fresh: not loaded from a cache), once",
          all(s["compiled"] and s["model_code"] and s["vllm_compiles"]["num_aot_artifacts_loaded"] == 0 and
              s["vllm_compiles"]["num_aot_compiles"] + sum(c in s["model_code"] for c in s["dynamo_compiles"]) == 1
              for s in before),
          json.dumps([[s["model_code"], s["vllm_compiles"], s["dynamo_compiles"]] for s in before])[:700])

    try:
        down0_in = down0_input(locs, reader)
    except StopIteration:  # --only left no down projection: layer 0's first tapped location serves instead
        down0_in = min((loc for loc in locs if loc.startswith(f"{reader.layer_prefix(0)}.")), default=min(locs))
    # batch 1: plain and read-only on the same prompt
    r0, r1 = fv.generate(llm, [{"prompt_token_ids": prompt_a}] * 2, [None, {"interventions": read_plan(locs, down0_in)}],
                         **SAMPLING)
    check("no plan error", r1.fragments_error is None, str(r1.fragments_error))
    check_plain(plain, r0, r1, moe=args.family == "qwen2_moe")
    hf = families.hf_model(folder)
    worst = check_saves(hf, reader, locs, prompt_a, r1, down0_in)
    if args.only:  # a diagnostic of which taps change compiled numerics: the read-only checks are the point
        print(json.dumps({"family": args.family, "only": args.only, "graphs": info.get("graphs"), "worst_rel": worst,
                          "failed": FAILED}), flush=True)
        llm.llm_engine.engine_core.shutdown()
        return 1 if FAILED else 0

    # batch 2: an edit beside a plain request (a different plan: no recompile may follow)
    r2, r0b = fv.generate(llm, [{"prompt_token_ids": prompt_b}, {"prompt_token_ids": prompt_a}],
                          [{"interventions": edit.plan(), "base": work}, None], **SAMPLING)
    check("edit: the plain request beside it is unchanged", list(r0b.outputs[0].token_ids) == list(r0.outputs[0].token_ids))
    at_opaque = sorted({st["at"] for st in edit.plan()} & set(opaque))
    if at_opaque:  # the family's edit acts in the shared expert: refused at submission, the reason named
        check("edit: a plan acting at an opaque location is refused with the reason", isinstance(r2, fv.Refused) and
              at_opaque[0] in r2.fragments_error and "opaque" in r2.fragments_error, repr(r2)[:300])
    else:
        check("edit: no plan error", r2.fragments_error is None, str(r2.fragments_error))
        worst = max(worst, check_edit(hf, edit, prompt_b, r2, SAMPLING["max_tokens"]))

    if args.trace:  # the Python trace API through this compiled engine (more plans, still no recompile)
        from fragments import FragmentsError
        from fragments.vllm import VLLM
        from trace_check import trace_checks
        model = VLLM(llm=llm)
        trace_checks(model, folder, cfg, prompt_a, prompt_b, torch.Generator().manual_seed(2))
        try:
            with model.trace(prompt_a):
                model.model.layers[0].output.save()
            check("trace: an untapped location refused where it is recorded", False, "no error")
        except FragmentsError as err:
            check("trace: an untapped location refused where it is recorded",
                  "model.layers.0.output is not tapped" in str(err) and "fragments_taps" in str(err), str(err)[:300])

    # a plan at an untapped location: refused at submission, alone
    err = fv.generate(llm, [{"prompt_token_ids": prompt_a}], [[{"at": untapped, "do": "save", "as": "x"}]],
                      max_tokens=2, temperature=0.0)[0]
    check("untapped location refused at submission", isinstance(err, fv.Refused) and untapped in err.fragments_error
          and "fragments_taps" in err.fragments_error, repr(err)[:300])
    # batch 3: yet another plan (decode steps only), then the stats
    down1_out = down0_in.replace(f"{reader.layer_prefix(0)}.", f"{reader.layer_prefix(1)}.").replace(".input", ".output")
    r4 = fv.generate(llm, [{"prompt_token_ids": prompt_b}], [[{"at": down1_out, "do": "save", "as": "d", "step": "decode"}]],
                     **SAMPLING)[0]
    check("engine runs on after the refusal; a decode-only save has one row per decode step",
          r4.fragments_error is None and "d" in r4.fragments and r4.fragments["d"].shape[0] == SAMPLING["max_tokens"] - 1,
          str(r4.fragments.get("d", torch.empty(0)).shape))
    after = stats()
    for b, a in zip(before, after):
        rank = a["rank"]
        # vLLM compiles small helpers of its own on first use (the sampler's logprob ranks): listed, not counted
        new = a["dynamo_compiles"][len(b["dynamo_compiles"]):]
        check(f"rank {rank}: no recompile of the model across requests with different plans",
              not any(c in a["model_code"] for c in new) and a["vllm_compiles"] == b["vllm_compiles"],
              f"model {a['model_code']}; compiled meanwhile: {new}; vLLM {b['vllm_compiles']}->{a['vllm_compiles']}")
        forwards = a["forwards"] - b["forwards"]
        calls = {loc: a["tap_calls"][loc] - b["tap_calls"].get(loc, 0) for loc in a["tap_calls"]}
        # an opaque location's body runs only in forwards no captured graph replays (refused above for that reason)
        check(f"rank {rank}: every tap's body ran once per forward with a plan", forwards > 0 and
              set(calls) == set(want_taps) and all(n == forwards for loc, n in calls.items() if loc not in opaque)
              and all(n <= forwards for loc, n in calls.items() if loc in opaque),
              f"{forwards} forwards; calls {sorted(set(calls.values()))}; opaque "
              f"{sorted({n for loc, n in calls.items() if loc in opaque})}")

    print(json.dumps({"family": args.family, "tp": args.tp, "platform": engine_env.describe(),
                      "runner": info.get("runner"), "graphs": info.get("graphs"), "engine_start_s": round(start_s, 1),
                      "plain_engine_s": round(plain_s, 1), "worst_rel": worst, "failed": FAILED}), flush=True)
    # The engine's processes end here, not at exit: after the traces (--trace) its engine core outlived
    # os._exit, holding the caller's output pipes open (test_vllm_plugin's subprocess.run then never returned).
    llm.llm_engine.engine_core.shutdown()
    return 1 if FAILED else 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    from vllm_check import remove_work
    remove_work()  # os._exit skips the exit hooks; main shut the engine down
    os._exit(rc)  # vLLM's engine processes end with this one
