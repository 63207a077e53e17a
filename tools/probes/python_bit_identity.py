"""The Python API's values, byte for byte, from two checkouts: saves, edits and generated tokens of the three
backends (in-process ranks, the LanguageModel session, fragments.vllm at tp 2 on vLLM's CPU build).

    PY=$(bash tools/python_env.sh)
    # once per checkout (PYTHONPATH picks the `fragments` it runs):
    PYTHONPATH=OLD/python:. $PY tools/probes/python_bit_identity.py run MODELS OUT_OLD [local session vllm]
    PYTHONPATH=python:.     $PY tools/probes/python_bit_identity.py run MODELS OUT_NEW [local session vllm]
    $PY tools/probes/python_bit_identity.py compare OUT_OLD OUT_NEW

MODELS: a folder of the reference exports (bazel-bin/tests/models: llama_tp2, moe_tp2, llama_tp2_pt2_kv,
smollm2_tp3). `run` writes OUT/<backend>_<model>.safetensors (every value a battery of traces returns, on rank 0)
and OUT/<backend>_<model>.json (token lists); `compare` compares each pair of files byte for byte and, where they
differ, names the values that do. Only public API is used, so the same file runs on any checkout since issue 29.
Issue 41's refactor was checked with it (4bb2fc5 against the refactor: every file IDENTICAL).
"""
import filecmp
import json
import os
import sys

import torch

LOCAL_MODELS = (("llama_tp2", 2, "pt"), ("moe_tp2", 2, "pt"), ("llama_tp2_pt2_kv", 2, "pt2"), ("smollm2_tp3", 3, "pt"))
SESSION_MODELS = (("llama_tp2", 2), ("smollm2_tp3", 3))
IDS = [[5, 17, 30, 42, 9, 7], [8, 1, 25, 42, 60, 3]]


def vector(width, seed):
    return torch.randn(width, generator=torch.Generator().manual_seed(seed))


def value(saved):
    v = saved.value
    return torch.stack(v) if isinstance(v, list) and v and all(t.shape == v[0].shape for t in v) else v


def traces(model, ids, out, session):
    """Reads, edits (each operator and view), expressions, a logit lens, `.apply`; the same on every backend that
    holds fragments' module tree (`session`: a LanguageModel, where weights are read whole)."""
    m, L = model.model, model.model.layers
    with model.trace(ids):
        out["qkv"] = L[0].self_attn.qkv_proj.output.save()
        out["k1"] = L[0].self_attn.qkv_proj.output.k.heads[1].save()
        out["o_in"] = L[1].self_attn.o_proj.input.save()
        out["resid"] = L[1].output.save()
        out["lens"] = model.lm_head(m.norm(L[0].output)).save()
        out["norm"] = (L[1].output * 2).norm(dim=-1).save()
        out["top"] = model.lm_head(m.norm(L[1].output))[:, -1].softmax(-1).topk(5)[0].save()
        out["logits"] = model.output.save()
    hidden = out["resid"].value.shape[-1]
    with model.trace(ids):
        L[0].output[:, -1] += vector(hidden, 1)
        L[0].self_attn.qkv_proj.output[..., 5] = 0
        L[1].self_attn.o_proj.input[:, 1:3, :8] *= 0.5
        L[1].mlp.input[..., -4:] = 1.5
        L[1].output[:, 0] -= vector(hidden, 2)
        L[0].self_attn.qkv_proj.output.k.heads[1] = 0
        L[0].self_attn.qkv_proj.output.q.heads[0] *= 0.5
        L[1].self_attn.o_proj.input.heads[0] += 1.0
        out["edited_resid"] = L[1].output.save()
        out["edited"] = model.output.save()
    with model.trace(ids):
        L[0].output[1, 2] = L[0].output[0, 2]              # patching within one forward (an expression edit)
        L[1].output.apply(lambda t: t * 0.5)
        out["patched"] = model.output.save()
    with model.trace(ids):
        L[0].output /= 2.0
        L[1].output = out["resid"].value                   # a value of an earlier trace
        out["set_whole"] = model.output.save()
    return hidden


def local_battery(rank, path):
    import fragments
    torch.manual_seed(0)
    model = fragments.load(path)
    ids = torch.tensor(IDS)
    out, tokens = {}, {}
    traces(model, ids, out, False)
    with model.plan() as plan:
        s = model.model.layers[1].output.save()
        model.model.layers[0].output[:, -1] += vector(out["resid"].value.shape[-1], 3)
        lo = model.output.save()
    for k in range(2):
        plan.run(torch.tensor(IDS)[:, k:])
        out[f"plan_save{k}"], out[f"plan_logits{k}"] = s.value.clone(), lo.value.clone()
    with model.generate(IDS[0][:4], max_new_tokens=3) as gen:
        model.model.layers[0].output[:] += 4 * vector(out["resid"].value.shape[-1], 1)
        out["gen_steps"] = model.model.layers[1].output.save()
        out["gen_tokens"] = model.output.save()
    tokens["greedy"] = gen.output.tolist()
    with model.generate([IDS[0][:3], IDS[1]], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=7) as gen:
        with gen.iter[1:]:
            model.model.layers[1].output[...] += 0.5
        out["sampled_save"] = model.model.layers[0].output.save()
    tokens["sampled"] = [t.tolist() for t in gen.output]
    tokens["streamed"] = list(model.stream([IDS[1][:4]], 3))
    return ({k: to_tensor(v) for k, v in out.items()}, tokens) if rank == 0 else None


def to_tensor(v):
    v = value(v) if hasattr(v, "value") else v
    if isinstance(v, list):
        return torch.cat([t.reshape(-1) for t in v])
    return v.detach().cpu().contiguous()


def session_battery(folder, tp):
    import fragments
    with fragments.LanguageModel(folder, tp=tp) as model:
        out, tokens = {}, {}
        ids = torch.tensor(IDS)
        traces(model, ids, out, True)
        with model.trace() as tracer:
            with tracer.invoke(IDS[0]):
                source = model.model.layers[0].output[:, 2]
                out["inv_a"] = model.output.save()
            with tracer.invoke([IDS[1][:4]]):
                model.model.layers[0].output[:, 2] = source
                out["inv_b"] = model.output.save()
        out["w_down"] = model.model.layers[0].mlp.down_proj.weight
        out["w_qkv"] = model.model.layers[1].self_attn.qkv_proj.weight
        with model.generate(IDS[0][:4], max_new_tokens=3):
            model.model.layers[0].output[:] += 2.0
            out["gen_steps"] = model.model.layers[1].output.save()
            out["gen_tokens"] = model.output.save()
        tokens["greedy"] = out["gen_tokens"].value.tolist()
        return {k: to_tensor(v) for k, v in out.items()}, tokens


def vllm_battery(work):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "python",
                                    "vllm_plugin"))
    from vllm_check import plugin_dist
    site = plugin_dist(os.path.join(work, "site"))
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = site + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cores = max(os.cpu_count() or 1, 1)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(2))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import families
    from fragments import vllm as fv
    from fragments.vllm import VLLM
    folder = os.path.join(work, "model")
    families.write_checkpoint("llama", folder)
    cfg = families.config("llama")
    g = torch.Generator().manual_seed(1)
    a = torch.randint(1, cfg.vocab_size, (7,), generator=g).tolist()
    b = torch.randint(1, cfg.vocab_size, (5,), generator=g).tolist()
    steer = (torch.randn(cfg.intermediate_size, generator=g) * 0.5).float()
    model = VLLM(folder, tensor_parallel_size=2, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                 enable_prefix_caching=False, max_num_seqs=8, seed=0)
    out, tokens = {}, {}
    L = model.model.layers
    with model.trace(a):
        out["qkv"] = L[0].self_attn.qkv_proj.output.save()
        out["v1"] = L[0].self_attn.qkv_proj.output.v.heads[1].save()
        out["logits"] = model.output.save()
        out["lens"] = model.lm_head(model.model.norm.output).save()
        out["lens0"] = model.lm_head(model.model.norm(L[0].mlp.down_proj.output)).save()
    with model.trace(a):
        L[0].self_attn.qkv_proj.output.v.heads[1] *= 0.5
        L[1].mlp.down_proj.output[...] += 0.25
        out["edit_qkv1"] = L[1].self_attn.qkv_proj.output.save()
        out["edit_logits"] = model.output.save()
    with model.generate(b, max_tokens=4) as gen:
        with gen.iter[1:]:
            L[1].mlp.down_proj.input[...] += steer
        out["gen_logits"] = model.output.save()
    tokens["greedy"] = list(gen.output.outputs[0].token_ids)
    with model.trace() as tr:
        with tr.invoke(a):
            clean = L[0].mlp.down_proj.output
            out["inv_a"] = L[0].self_attn.qkv_proj.output.save()
        with tr.invoke(b):
            L[0].mlp.down_proj.output[-1] = clean[-1]
            L[1].mlp.down_proj.output.apply(lambda t: t * 0.5 + 0.1)
            out["inv_b"] = model.output.save()
            out["inv_twice"] = (L[1].mlp.down_proj.output * 2).save()
    with model.generate([a, b], max_tokens=3, temperature=0.8, seed=5) as gen:
        out["sampled_emb"] = model.model.embed_tokens.output.save()
    tokens["sampled"] = [list(o.outputs[0].token_ids) for o in gen.output]
    plan = [{"at": "model.layers.0.mlp.down_proj.input", "do": "save", "as": "down", "step": 0},
            {"at": "model.layers.1.output", "do": "scale", "by": 0.5, "step": "decode"},
            {"at": "logits_processor.output", "do": "save", "as": "final_logits"}]
    outs = fv.generate(model.llm, [{"prompt_token_ids": a}], [plan], max_tokens=3, temperature=0)
    if outs[0].fragments_error:
        raise RuntimeError(outs[0].fragments_error)
    out["plan_down"], out["plan_logits"] = outs[0].fragments["down"], outs[0].fragments["final_logits"]
    tokens["plan"] = list(outs[0].outputs[0].token_ids)
    model.close()
    return {k: to_tensor(v) for k, v in out.items()}, tokens


def write(folder, name, result):
    from safetensors.torch import save_file
    tensors, tokens = result
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, os.path.join(folder, f"{name}.safetensors"))
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(tokens, f, sort_keys=True)
    print(f"wrote {name}: {len(tensors)} values, {len(tokens)} token lists", flush=True)


def run(models, folder, backends):
    import tempfile
    import fragments
    os.makedirs(folder, exist_ok=True)
    if "local" in backends:
        for name, world, ext in LOCAL_MODELS:
            path = os.path.abspath(os.path.join(models, name, f"rank{{rank}}.{ext}"))
            write(folder, f"local_{name}", fragments.launch(local_battery, world=world, args=(path,))[0])
    if "session" in backends:
        for name, tp in SESSION_MODELS:
            write(folder, f"session_{name}", session_battery(os.path.join(models, name), tp))
    if "vllm" in backends:
        with tempfile.TemporaryDirectory(prefix="frag-bitid-vllm-") as work:  # gone before __main__'s os._exit
            write(folder, "vllm_llama_tp2", vllm_battery(work))


def compare(old, new):
    from safetensors.torch import load_file
    names = sorted(f for f in os.listdir(old) if f.endswith((".safetensors", ".json")))
    same_all = bool(names)
    for name in names:
        there = os.path.join(new, name)
        same = os.path.exists(there) and filecmp.cmp(os.path.join(old, name), there, shallow=False)
        detail = ""
        if not same and os.path.exists(there) and name.endswith(".safetensors"):
            a, b = load_file(os.path.join(old, name)), load_file(there)
            detail = " differ: " + ", ".join(k for k in sorted(set(a) | set(b))
                                             if k not in a or k not in b or a[k].dtype != b[k].dtype
                                             or not torch.equal(a[k], b[k]))
        print(f"{name:40s} {'IDENTICAL' if same else 'DIFFERENT' + detail}")
        same_all &= same
    print("every file identical" if same_all else "FILES DIFFER")
    return 0 if same_all else 1


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    run(sys.argv[2], sys.argv[3], set(sys.argv[4:]) or {"local", "session", "vllm"})
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine threads
