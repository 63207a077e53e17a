"""fragments.vllm.VLLM (tracing over vLLM's LLM in nnsight's manner) against transformers' hooks: one engine.

    python trace_check.py TP

A tiny Llama (transformers' save_pretrained; 4 heads, 2 kv heads) at tensor_parallel_size TP, fp32, eager (vLLM's CPU
build, or its CUDA build on the GPU machine: engine_env.py):
  trace: whole q|k|v at layer 0, one v head (`.v.heads[1]`), the embedding, the logits (`model.output`), a logit
    lens over every position (`model.lm_head(model.model.norm.output)`) and one over layer 0's MLP output
    (`model.lm_head(model.model.norm(h))`);
  trace with edits: `.v.heads[1] *= 0.5` at layer 0 and `down_proj.output[...] += 0.25` at layer 1: layer 1's
    q|k|v and the logits equal transformers' under the same edits;
  generate with per-step plans: a vector added to layer 1's down_proj input at decode steps only (`gen.iter[1:]`),
    the logits at every step and the tokens equal transformers' greedy generation with the same hook (decode
    steps only); two prompts give two values;
  invokes (nnsight's `with tr.invoke(prompt):`): two prompts in one trace, each invoke's saves are its own prompt's
    rows (q|k|v, logits, an expression `(down_proj.output * 2).save()`), equal to transformers' on that prompt;
  `.apply(fn)`: a function on layer 1's down_proj output (a save recorded after it sees its result; one that
    returns None changes nothing): the logits equal transformers' with the same function in a hook;
  patching within one forward: layer 0's v (times 0.5) written into layer 1's v of the same prompt; and across
    prompts, nnsight's activation patching: invoke 0's (clean) values read in invoke 1 (another prompt, another
    length): its last row of layer 0's down_proj output set to the clean one, half the clean last q|k|v row
    added at layer 1 (a fragmented location: gathered, edited whole, cut back) — the patched logits and
    layer 1's MLP output equal transformers' hooks doing the same with the clean run's captures;
  misuse is refused with a message: `gen.rows`, recording outside the invokes of a trace with invokes,
    `model.output` as an edit's value, a value read from a location later in the forward.
Each check prints one line; exits non-zero on a failure (tolerance 1e-5 relative).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def check_invokes_apply_patching(model, hf, folder, cfg, prompt_a, prompt_b, want_qkv_a, hf_logits_a, g):
    import torch
    import families
    from vllm_check import TOL, check, rel
    L = model.model.layers
    named = dict(hf.named_modules())
    a0, a1 = "model.layers.0.self_attn", "model.layers.1.self_attn"
    qkv = lambda cap, a: torch.cat([cap[(f"{a}.{p}_proj", "output")] for p in "qkv"], -1)  # noqa: E731

    def hf_run(prompt, mods, hooks=()):
        handles = [named[m].register_forward_hook(fn) for m, fn in hooks]
        try:
            with torch.no_grad():
                return families.capture(hf, mods, lambda: hf(torch.tensor([prompt], device=hf.device)).logits[0])
        finally:
            for h in handles:
                h.remove()

    # invokes: each invoke's saves are its own prompt's rows
    with model.trace() as tr:
        with tr.invoke(prompt_a):
            qa = L[0].self_attn.qkv_proj.output.save()
            la = model.output.save()
        with tr.invoke(prompt_b):
            qb = L[0].self_attn.qkv_proj.output.save()
            lb = model.output.save()
            twice = (L[1].mlp.down_proj.output * 2).save()
    cap_b, hf_logits_b = hf_run(prompt_b, [f"{a0}.{p}_proj" for p in "qkv"] + ["model.layers.1.mlp.down_proj"])
    check("invoke: two requests in one trace", isinstance(tr.output, list) and len(tr.output) == 2)
    for name, got, want in [("invoke 0's q|k|v (prompt A)", qa, want_qkv_a), ("invoke 0's logits", la, hf_logits_a[-1:]),
                            ("invoke 1's q|k|v (prompt B)", qb, qkv(cap_b, a0)),
                            ("invoke 1's logits", lb, hf_logits_b[-1:]),
                            ("invoke 1's (down_proj.output * 2).save()", twice,
                             2 * cap_b[("model.layers.1.mlp.down_proj", "output")])]:
        e = rel(got.value, want)
        check(f"invoke: {name}", e <= TOL, f"rel {e:.2e} shape {tuple(got.value.shape)}")

    # .apply(fn): runs in the workers on the whole value
    with model.trace(prompt_a):
        L[0].self_attn.qkv_proj.output.apply(lambda t: None)  # None: no change
        L[1].mlp.down_proj.output.apply(lambda t: t * 0.5 + 0.1)
        h_ap = L[1].mlp.down_proj.output.save()
        logits_ap = model.output.save()
    cap, hf_ap = hf_run(prompt_a, ["model.layers.1.mlp.down_proj"],
                        [("model.layers.1.mlp.down_proj", lambda m, i, o: o * 0.5 + 0.1)])
    e = rel(logits_ap.value, hf_ap[-1:])
    check(".apply: logits equal transformers' with the function in a hook", e <= TOL and
          rel(logits_ap.value, hf_logits_a[-1:]) > 1e-3, f"rel {e:.2e}")
    e = rel(h_ap.value, cap[("model.layers.1.mlp.down_proj", "output")])
    check(".apply: a save recorded after it sees its result", e <= TOL, f"rel {e:.2e}")

    # patching within one forward, one prompt: layer 0's v (x 0.5) into layer 1's v
    with model.trace(prompt_a):
        L[1].self_attn.qkv_proj.output.v = L[0].self_attn.qkv_proj.output.v * 0.5
        logits_v = model.output.save()
    kept = {}
    _, hf_v = hf_run(prompt_a, [], [(f"{a0}.v_proj", lambda m, i, o: kept.__setitem__("v", o.clone())),
                                    (f"{a1}.v_proj", lambda m, i, o: kept["v"] * 0.5)])
    e = rel(logits_v.value, hf_v[-1:])
    check("patching: layer 0's v into layer 1's v of the same prompt equals transformers'", e <= TOL and
          rel(logits_v.value, hf_logits_a[-1:]) > 1e-3, f"rel {e:.2e}")

    # activation patching across prompts in one forward (nnsight's clean -> corrupted)
    prompt_c = torch.randint(1, cfg.vocab_size, (len(prompt_a) - 2,), generator=g).tolist()
    with model.trace() as tr:
        with tr.invoke(prompt_a):
            clean_mlp = L[0].mlp.down_proj.output
            clean_qkv = L[1].self_attn.qkv_proj.output
        with tr.invoke(prompt_c):
            L[0].mlp.down_proj.output[-1] = clean_mlp[-1]
            L[1].self_attn.qkv_proj.output[-1] += clean_qkv[-1] * 0.5
            patched = model.output.save()
            patched_h = L[1].mlp.down_proj.output.save()
    clean, _ = hf_run(prompt_a, ["model.layers.0.mlp.down_proj"] + [f"{a1}.{p}_proj" for p in "qkv"])

    def set_last(m, i, o):
        o = o.clone()
        o[:, -1] = clean[("model.layers.0.mlp.down_proj", "output")][-1]
        return o

    def add_last(p):
        def hook(m, i, o):
            o = o.clone()
            o[:, -1] += clean[(f"{a1}.{p}_proj", "output")][-1] * 0.5
            return o
        return hook
    cap_c, hf_c = hf_run(prompt_c, ["model.layers.1.mlp.down_proj"], [("model.layers.0.mlp.down_proj", set_last)] +
                         [(f"{a1}.{p}_proj", add_last(p)) for p in "qkv"])
    _, hf_c_plain = hf_run(prompt_c, [])
    e = rel(patched.value, hf_c[-1:])
    check("patching across invokes: the patched prompt's logits equal transformers' (clean values read from the "
          "other invoke)", e <= TOL and rel(patched.value, hf_c_plain[-1:]) > 1e-3, f"rel {e:.2e}")
    e = rel(patched_h.value, cap_c[("model.layers.1.mlp.down_proj", "output")])
    check("patching across invokes: layer 1's MLP output equals transformers'", e <= TOL, f"rel {e:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tp", type=int)
    args = ap.parse_args()
    from vllm_check import FAILED, plugin_dist, work_folder
    work = work_folder(f"frag-vllm-trace-tp{args.tp}-")
    site = plugin_dist(os.path.join(work, "site"))
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = site + os.pathsep + os.environ.get("PYTHONPATH", "")
    import engine_env  # vLLM's CPU build here, its CUDA build on the GPU machine (float32 without TF32 there)
    engine_env.setup(args.tp)

    import torch
    import families
    from fragments.vllm import VLLM

    folder = os.path.join(work, "model")
    families.write_checkpoint("llama", folder)
    cfg = families.config("llama")
    g = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(1, cfg.vocab_size, (7,), generator=g).tolist()
    prompt_b = torch.randint(1, cfg.vocab_size, (5,), generator=g).tolist()

    model = VLLM(folder, tensor_parallel_size=args.tp, dtype=engine_env.DTYPE, skip_tokenizer_init=True,
                 max_model_len=64, enable_prefix_caching=False, max_num_seqs=8, seed=0, **engine_env.engine_kwargs())
    trace_checks(model, folder, cfg, prompt_a, prompt_b, g)
    model.close()
    print(f"{{\"tp\": {args.tp}, \"failed\": {FAILED}}}", flush=True)
    return 1 if FAILED else 0


def trace_checks(model, folder, cfg, prompt_a, prompt_b, g):
    """Every check of this file's docstring on `model` (fragments.vllm.VLLM over the tiny Llama in `folder`;
    eager, or compiled with taps at every location used here: compiled_check.py)."""
    import torch
    import families
    from fragments import FragmentsError
    from vllm_check import TOL, check, rel
    steer = (torch.randn(cfg.intermediate_size, generator=g) * 0.5).float()
    hs = cfg.hidden_size // cfg.num_attention_heads
    L = model.model.layers

    with model.trace(prompt_a) as tr:
        qkv = L[0].self_attn.qkv_proj.output.save()
        v1 = L[0].self_attn.qkv_proj.output.v.heads[1].save()
        emb = model.model.embed_tokens.output.save()
        logits = model.output.save()
        lens = model.lm_head(model.model.norm.output).save()
        lens0 = model.lm_head(model.model.norm(L[0].mlp.down_proj.output)).save()
    check("trace: output is the request's", len(tr.output.outputs[0].token_ids) == 1)

    hf = families.hf_model(folder)
    a = "model.layers.0.self_attn"
    mods = [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj", "model.embed_tokens", "model.layers.0.mlp.down_proj"]
    with torch.no_grad():
        cap, hf_logits = families.capture(hf, mods,
                                          lambda: hf(torch.tensor([prompt_a], device=hf.device)).logits[0])
        want_lens0 = hf.lm_head(hf.model.norm(cap[("model.layers.0.mlp.down_proj", "output")]))
    want_qkv = torch.cat([cap[(f"{a}.{p}_proj", "output")] for p in "qkv"], -1)
    for name, got, want in [("q|k|v whole", qkv, want_qkv),
                            ("v head 1 (.v.heads[1])", v1, cap[(f"{a}.v_proj", "output")][:, hs:2 * hs]),
                            ("embedding", emb, cap[("model.embed_tokens", "output")]),
                            ("logits (model.output)", logits, hf_logits[-1:]),
                            ("logit lens at every position", lens, hf_logits),
                            ("logit lens of layer 0's MLP output", lens0, want_lens0)]:
        e = rel(got.value, want)
        check(f"trace: {name}", e <= TOL, f"rel {e:.2e} shape {tuple(got.value.shape)}")

    with model.trace(prompt_a):
        L[0].self_attn.qkv_proj.output.v.heads[1] *= 0.5
        L[1].mlp.down_proj.output[...] += 0.25
        qkv1 = L[1].self_attn.qkv_proj.output.save()
        logits_e = model.output.save()
    named = dict(hf.named_modules())

    def scale_v(m, inp, out):
        out = out.clone()
        out[..., hs:2 * hs] *= 0.5
        return out
    hooks = [named[f"{a}.v_proj"].register_forward_hook(scale_v),
             named["model.layers.1.mlp.down_proj"].register_forward_hook(lambda m, i, o: o + 0.25)]
    b = "model.layers.1.self_attn"
    with torch.no_grad():
        cap_e, hf_logits_e = families.capture(hf, [f"{b}.{p}_proj" for p in "qkv"],
                                              lambda: hf(torch.tensor([prompt_a], device=hf.device)).logits[0])
    for h in hooks:
        h.remove()
    e = rel(qkv1.value, torch.cat([cap_e[(f"{b}.{p}_proj", "output")] for p in "qkv"], -1))
    check("edit: layer 1's q|k|v under the edits equals transformers'", e <= TOL, f"rel {e:.2e}")
    e = rel(logits_e.value, hf_logits_e[-1:])
    check("edit: logits under the edits equal transformers'", e <= TOL and rel(logits_e.value, hf_logits[-1:]) > 1e-3,
          f"rel {e:.2e}")

    n = 4
    with model.generate(prompt_b, max_tokens=n) as gen:
        with gen.iter[1:]:
            L[1].mlp.down_proj.input[...] += steer
        step_logits = model.output.save()
        h1 = L[1].mlp.down_proj.output.save()
    tokens = list(gen.output.outputs[0].token_ids)

    def steer_decode(m, args):  # decode steps only: one new position per forward
        return (args[0] + steer.to(args[0].device),) if args[0].shape[1] == 1 else None
    hook = named["model.layers.1.mlp.down_proj"].register_forward_pre_hook(steer_decode)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_b], device=hf.device), max_new_tokens=n, do_sample=False,
                          output_logits=True, return_dict_in_generate=True,
                          attention_mask=torch.ones(1, len(prompt_b), dtype=torch.long, device=hf.device))
    hook.remove()
    hf_tokens = out.sequences[0, len(prompt_b):].tolist()
    check("generate: tokens equal transformers' under a decode-only edit (gen.iter[1:])", tokens == hf_tokens,
          f"{tokens} vs {hf_tokens}")
    e = rel(step_logits.value, torch.cat(out.logits, 0))
    check("generate: logits at every step equal transformers'", e <= TOL, f"rel {e:.2e} shape "
          f"{tuple(step_logits.value.shape)}")
    check("generate: a save at every step has the prompt's rows then one per decode step",
          tuple(h1.value.shape) == (len(prompt_b) + n - 1, cfg.hidden_size), str(tuple(h1.value.shape)))

    with model.generate([prompt_a, prompt_b], max_tokens=2) as gen2:
        e2 = model.model.embed_tokens.output.save()
    check("generate: two prompts give two values", isinstance(e2.value, list) and
          [t.shape[0] for t in e2.value] == [len(prompt_a) + 1, len(prompt_b) + 1] and len(gen2.output) == 2,
          str([tuple(t.shape) for t in e2.value]) if isinstance(e2.value, list) else type(e2.value).__name__)

    check_invokes_apply_patching(model, hf, folder, cfg, prompt_a, prompt_b, want_qkv, hf_logits, g)

    def rows_scope():
        with model.generate([prompt_a, prompt_b], max_tokens=1) as gen3:
            with gen3.rows([0]):
                pass

    def outside_invoke():
        with model.trace() as tr:
            with tr.invoke(prompt_a):
                pass
            L[0].mlp.down_proj.output.save()

    def output_as_value():
        with model.trace(prompt_a):
            L[0].mlp.down_proj.output[...] = model.output

    def later_location():
        with model.trace(prompt_a):
            L[0].mlp.down_proj.output[...] = L[1].mlp.down_proj.output
    for what, body, says in [("gen.rows", rows_scope, "invoke"), ("recording outside the invokes", outside_invoke,
                                                                  "invoke"),
                             ("model.output as an edit's value", output_as_value, "model.output"),
                             ("a value of a later location", later_location, "later location")]:
        try:
            body()
            check(f"refused: {what}", False, "no error")
        except FragmentsError as err:
            check(f"refused: {what}", says in str(err), str(err)[:160])



if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    from vllm_check import remove_work
    remove_work()  # os._exit skips the exit hooks; main shut the engine down
    os._exit(rc)
