"""fragments' plugin on a COMPILED vLLM engine (enforce_eager=False: torch.compile, Inductor) against
transformers' hooks and against plain compiled vLLM: one tapped engine, one plain engine (a child process).

    python compiled_check.py TP

A tiny Llama (transformers' save_pretrained; 4 heads, 2 kv heads), fp32, at tensor_parallel_size TP. The
tapped engine declares its taps at start (additional_config {"fragments_taps": [globs]}: every qkv, o_proj,
gate_up and down_proj boundary of both layers, the embedding, the logits). Checks, one line each, exit
non-zero on a failure:
  the engine compiled the model (Dynamo traced it) and the taps are the declared locations;
  batch 1 [prompt A plain, prompt A with a read-only plan]: every saved whole value (q|k|v and gate|up in
    logical order, row-layer inputs, all-reduced outputs, the embedding) equals transformers' forward hooks
    within 1e-5 relative; the logits at every step and a down projection input at every step equal
    transformers' forward over the prompt plus the generated tokens; both requests' tokens and logprobs
    equal (exactly) those of the same batch on a plain compiled vLLM engine (no plugin, no taps);
  batch 2 [prompt B with an edit, prompt A plain]: a v head scaled through "segment"/"heads" and a vector
    added to layer 1's down projection input at every step give transformers' greedy tokens under the same
    hooks, and layer 1's q|k|v and the logits equal transformers' under them; the plain row is unchanged;
  a plan naming an untapped location is refused at submission (that request alone, the message names the
    location and fragments_taps), and the engine runs on;
  fragments_compile_stats (every rank): Dynamo compiled the model's forward once before the requests and never
    during them (whatever the plans; vLLM's own helpers compiled on first use are listed), vLLM's compile
    counters unchanged, and every tap's body ran exactly once per forward.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TAPS = ["model.embed_tokens.output", "model.layers.*.self_attn.qkv_proj.output", "model.layers.*.self_attn.o_proj.*",
        "model.layers.*.mlp.gate_up_proj.output", "model.layers.*.mlp.down_proj.*", "logits_processor.output"]
UNTAPPED = "model.layers.0.output"


def env_for(tp, work):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cores = max(os.cpu_count() or 1, 1)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp)) \
        if tp > 1 else f"0-{cores - 1}"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # a fresh compile cache: the model is traced here (with its taps), not loaded from an earlier run
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(work, "vllm-cache")


def engine(folder, tp, **kw):
    from vllm import LLM
    return LLM(folder, tensor_parallel_size=tp, enforce_eager=False, dtype="float32", skip_tokenizer_init=True,
               max_model_len=64, enable_prefix_caching=False, max_num_seqs=8, seed=0, **kw)


def tokens_and_logprobs(r):
    return {"tokens": list(r.outputs[0].token_ids),
            "logprobs": [{str(k): v.logprob for k, v in d.items()} for d in r.outputs[0].logprobs]}


SAMPLING = {"max_tokens": 4, "temperature": 0.0, "logprobs": 2}


def child_plain(args):
    """Plain compiled vLLM (no plugin on the path): batch 1's prompts, printed as JSON."""
    from vllm import SamplingParams
    env_for(args.tp, args.work)
    llm = engine(args.model, args.tp)
    prompt_a = json.loads(args.prompt)
    outs = llm.generate([{"prompt_token_ids": prompt_a}] * 2, SamplingParams(**SAMPLING), use_tqdm=False)
    print("PLAIN " + json.dumps([tokens_and_logprobs(r) for r in outs]), flush=True)
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tp", type=int)
    ap.add_argument("--child-plain", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--work")
    ap.add_argument("--prompt")
    args = ap.parse_args()
    if args.child_plain:
        return child_plain(args)

    from vllm_check import FAILED, TOL, check, plugin_dist, rel
    work = tempfile.mkdtemp(prefix=f"frag-vllm-compiled-tp{args.tp}-")
    import torch
    from safetensors.torch import save_file
    import families

    folder = os.path.join(work, "model")
    families.write_checkpoint("llama", folder)
    cfg = families.config("llama")
    reader = families.Reader("llama", cfg)
    locs = reader.locations()
    g = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(1, cfg.vocab_size, (7,), generator=g).tolist()
    prompt_b = torch.randint(1, cfg.vocab_size, (5,), generator=g).tolist()
    steer = (torch.randn(cfg.intermediate_size, generator=g) * 0.5).float()
    save_file({"v": steer}, os.path.join(work, "steer.safetensors"))

    # plain compiled vLLM first, in its own process without the plugin (one engine at a time on this machine)
    env = dict(os.environ)
    env["FRAGMENTS_VLLM"] = "0"  # and no plugin dist on its path: vLLM as it comes
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(args.tp), "--child-plain", "--model", folder,
                           "--work", os.path.join(work, "plain"), "--prompt", json.dumps(prompt_a)],
                          env=env, capture_output=True, text=True, timeout=900)
    plain_line = next((l for l in proc.stdout.splitlines() if l.startswith("PLAIN ")), None)
    check("plain compiled vLLM ran", proc.returncode == 0 and plain_line is not None,
          f"{time.time() - t0:.0f} s" if plain_line else proc.stderr[-3000:])
    plain = json.loads(plain_line[6:]) if plain_line else None

    site = plugin_dist(os.path.join(work, "site"))
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = site + os.pathsep + os.environ.get("PYTHONPATH", "")
    env_for(args.tp, work)
    from fragments import vllm as fv

    t0 = time.time()
    llm = engine(folder, args.tp, additional_config={"fragments_taps": TAPS})
    start_s = time.time() - t0
    print(f"engine start {start_s:.1f} s (compiled, taps {TAPS})", flush=True)

    info = fv.inspect(llm)
    want_taps = sorted(set(locs) | {"logits_processor.output"})
    check("inspect: a compiled engine, its taps the declared locations", info["compiled"] and info["taps"] == want_taps,
          f"{info['compiled']} {info['taps']}")

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

    down0_in = "model.layers.0.mlp.down_proj.input"
    plan_read = [{"at": loc, "do": "save", "as": loc, "step": 0} for loc in locs]
    plan_read += [{"at": "logits_processor.output", "do": "save", "as": "final_logits"},
                  {"at": down0_in, "do": "save", "as": "down0_all"}]
    vhead = cfg.num_key_value_heads - 1
    qkv0, qkv1, down1 = ("model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.qkv_proj",
                         "model.layers.1.mlp.down_proj")
    plan_edit = [{"at": f"{qkv0}.output", "do": "scale", "by": 0.5, "segment": "v", "heads": [vhead]},
                 {"at": f"{down1}.input", "do": "add", "value": "steer.safetensors:v"},
                 {"at": f"{qkv1}.output", "do": "save", "as": "qkv1", "step": 0},
                 {"at": "logits_processor.output", "do": "save", "as": "final_logits"}]

    # batch 1: plain and read-only on the same prompt
    r0, r1 = fv.generate(llm, [{"prompt_token_ids": prompt_a}] * 2, [None, {"interventions": plan_read}], **SAMPLING)
    check("no plan error", r1.fragments_error is None, str(r1.fragments_error))
    if plain is not None:
        got = [tokens_and_logprobs(r0), tokens_and_logprobs(r1)]
        check("read-only plan: tokens and logprobs equal plain compiled vLLM's (no plugin, no taps; exactly)",
              got[1] == plain[1], f"{got[1]['tokens']} vs {plain[1]['tokens']}")
        check("taps without a plan: the plain row equals plain compiled vLLM's (exactly)", got[0] == plain[0],
              f"{got[0]['tokens']} vs {plain[0]['tokens']}")
    hf = families.hf_model(folder)
    modules = sorted({m for spec in locs.values() for m in (spec[1] if isinstance(spec[1], list) else [spec[1]])})
    with torch.no_grad():
        captured, _ = families.capture(hf, modules, lambda: hf(torch.tensor([prompt_a])).logits[0])
    worst = 0.0
    for loc, spec in locs.items():
        got = r1.fragments.get(loc)
        e = rel(got, reader.read(spec, captured)) if got is not None else float("inf")
        worst = max(worst, e)
        check(f"whole value {loc}", e <= TOL, f"rel {e:.2e} shape {tuple(got.shape) if got is not None else None}")
    t1_ids = list(r1.outputs[0].token_ids)
    with torch.no_grad():
        cap_full, logits_full = families.capture(hf, modules, lambda: hf(torch.tensor([prompt_a + t1_ids[:-1]])).logits[0])
    e = rel(r1.fragments.get("final_logits", torch.empty(0)), logits_full[len(prompt_a) - 1:])
    worst = max(worst, e)
    check("logits at every step (prefill + decode)", e <= TOL, f"rel {e:.2e}")
    e = rel(r1.fragments.get("down0_all", torch.empty(0)), reader.read(locs[down0_in], cap_full))
    worst = max(worst, e)
    check("decode steps: down projection input rows of every step", e <= TOL, f"rel {e:.2e}")

    # batch 2: an edit beside a plain request (a different plan: no recompile may follow)
    r2, r0b = fv.generate(llm, [{"prompt_token_ids": prompt_b}, {"prompt_token_ids": prompt_a}],
                          [{"interventions": plan_edit, "base": work}, None], **SAMPLING)
    check("edit: no plan error", r2.fragments_error is None, str(r2.fragments_error))
    check("edit: the plain request beside it is unchanged", list(r0b.outputs[0].token_ids) == list(r0.outputs[0].token_ids))
    named = dict(hf.named_modules())
    hs = cfg.hidden_size // cfg.num_attention_heads

    def scale_v(m, a, out):
        out = out.clone()
        out[..., vhead * hs:(vhead + 1) * hs] *= 0.5
        return out
    h1 = named[qkv0.replace("qkv_proj", "v_proj")].register_forward_hook(scale_v)
    h2 = named[down1].register_forward_pre_hook(lambda m, a: (a[0] + steer,))
    q1 = [qkv1.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt_b]), max_new_tokens=SAMPLING["max_tokens"], do_sample=False,
                          attention_mask=torch.ones(1, len(prompt_b), dtype=torch.long))
        hf_b = gen[0, len(prompt_b):].tolist()
        cap_b, logits_b = families.capture(hf, q1, lambda: hf(gen[:, :-1]).logits[0])
    h1.remove()
    h2.remove()
    t2_ids = list(r2.outputs[0].token_ids)
    check("edit: tokens equal transformers' greedy under the same edits", t2_ids == hf_b, f"{t2_ids} vs {hf_b}")
    e = rel(r2.fragments.get("qkv1", torch.empty(0)), reader.read(("cat", q1), cap_b)[:len(prompt_b)])
    worst = max(worst, e)
    check("edit: downstream whole value equals transformers' under the same edits", e <= TOL, f"rel {e:.2e}")
    e = rel(r2.fragments.get("final_logits", torch.empty(0)), logits_b[len(prompt_b) - 1:])
    worst = max(worst, e)
    check("edit: logits at every step equal transformers'", e <= TOL, f"rel {e:.2e}")

    # a plan at an untapped location: refused at submission, alone
    try:
        fv.generate(llm, [{"prompt_token_ids": prompt_a}], [[{"at": UNTAPPED, "do": "save", "as": "x"}]],
                    max_tokens=2, temperature=0.0)
        check("untapped location refused at submission", False, "no error")
    except ValueError as err:
        check("untapped location refused at submission", UNTAPPED in str(err) and "fragments_taps" in str(err),
              str(err)[:300])
    # batch 3: yet another plan (decode steps only), then the stats
    r4 = fv.generate(llm, [{"prompt_token_ids": prompt_b}],
                     [[{"at": "model.layers.1.mlp.down_proj.output", "do": "save", "as": "d", "step": "decode"}]],
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
        check(f"rank {rank}: every tap's body ran once per forward", forwards > 0 and
              set(calls) == set(want_taps) and all(n == forwards for n in calls.values()),
              f"{forwards} forwards; calls {sorted(set(calls.values()))}")

    print(json.dumps({"tp": args.tp, "engine_start_s": round(start_s, 1), "worst_rel": worst, "failed": FAILED}),
          flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)  # vLLM's engine processes end with this one
