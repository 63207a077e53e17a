"""Pipeline stages (docs/vllm.md "Stages and nodes"): one vLLM engine at pipeline_parallel_size PP (vLLM's mp
executor) against transformers' hooks, through fragments.vllm.VLLM (tracing) and fv.inspect.

    python pp_check.py TP PP [--nnodes 2] [--compiled]

--compiled: enforce_eager=False (torch.compile), the trace's locations tapped at start by globs over every stage.
--nnodes 2: the engine spread over two "nodes" on this machine through vLLM's own multi-node mp executor: node 1
is `vllm serve DIR --headless --nnodes 2 --node-rank 1 --master-addr 127.0.0.1` (its workers only), node 0 this
process's LLM(..., nnodes=2, node_rank=0); with TP 2 PP 1 the tensor-parallel group spans the nodes, with TP 1
PP 2 each stage is a node.

A tiny 4-layer Llama (transformers' save_pretrained), fp32, eager, at tensor_parallel_size TP and
pipeline_parallel_size PP (at PP 2: layers 0-1 on stage 0, 2-3 on stage 1):
  inspect: every location's stage ("stage"), the stages' layer spans, the embedding on the first stage and the
    logits and final norm on the last; a plan naming the last layer is accepted (it was "no such location");
  trace: every layer's output saved (each stage's own) and the logit lens at every layer — the last stage's norm
    and LM head on each layer's saved whole value (layers 0-1 saved on stage 0, the lens run on stage 1) —
    equal transformers' norm + head on the same values; the logits (model.output);
  an edit on stage 0 (layer 1's MLP output += 0.25) carries into stage 1: layer 3's q|k|v and the logits equal
    transformers' under the same edit;
  activation patching within a stage (a Python step) equals transformers'; one reading across stages fails
    with the reason; a module call spanning stages is refused with one line.
Prints one line per check (and the lens's cost); exits non-zero on a failure (tolerance 1e-5 relative).
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import engine_env
from vllm_check import FAILED, TOL, check, plugin_dist, rel, remove_work, work_folder

LAYERS = 4


def write_llama(folder):
    import torch
    import transformers
    import families
    cfg = families.config("llama")
    cfg.num_hidden_layers = LAYERS
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    return cfg


def check_inspect(info, pp):
    stage = info.get("stage", {})
    last = pp - 1
    want = {"model.embed_tokens.output": 0, "model.layers.0.mlp.down_proj.input": 0,
            f"model.layers.{LAYERS - 1}.mlp.down_proj.input": last, "model.norm.output": last,
            "logits_processor.output": last}
    got = {k: stage.get(k) for k in want}
    check("inspect: the stage of each location (embedding first, logits last)", got == want or pp == 1,
          json.dumps(got))
    spans = [s.get("layers") for s in info.get("stages", [])]
    per = LAYERS // pp
    check("inspect: each stage's layer span", pp == 1 or spans == [[k * per, (k + 1) * per - 1] for k in range(pp)],
          str(spans))
    check("inspect: every stage's modules in one table", f"model.layers.{LAYERS - 1}.mlp.down_proj" in info["modules"]
          and "model.layers.0.mlp.down_proj" in info["modules"], "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tp", type=int)
    ap.add_argument("pp", type=int)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--compiled", action="store_true")
    args = ap.parse_args()
    work = work_folder(f"frag-vllm-pp{args.pp}-")
    site = plugin_dist(os.path.join(work, "site"))
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = site + os.pathsep + os.environ.get("PYTHONPATH", "")
    engine_env.setup(args.tp * args.pp)  # the world's size (node 0's own binding: start_node1)

    import torch
    import families
    from fragments import vllm as fv
    from fragments.vllm import VLLM
    from safetensors.torch import save

    folder = os.path.join(work, "model")
    cfg = write_llama(folder)
    prompt = torch.randint(1, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    t0 = time.time()
    engine = dict(max_model_len=64, enable_prefix_caching=False, max_num_seqs=8, seed=0)
    if args.compiled:  # every location the checks name, on both stages
        engine["taps"] = ["model.layers.*.output", "model.layers.*.self_attn.qkv_proj.output",
                          "model.layers.*.mlp.down_proj.output", "logits_processor.output"]
    node1 = None
    if args.nnodes > 1:
        node1, nodes = start_node1(folder, args, engine, work)
        engine.update(nodes)
    model = VLLM(folder, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, skip_tokenizer_init=True,
                 **engine)
    print(f"engine start {time.time() - t0:.1f} s (tp {args.tp} pp {args.pp}"
          f"{', compiled' if args.compiled else ''})", flush=True)
    info = fv.inspect(model.llm)
    check_inspect(info, args.pp)
    if args.compiled:
        check("compiled: every stage's taps in the record", info.get("compiled") and
              f"model.layers.{LAYERS - 1}.output" in info["taps"] and "model.layers.0.output" in info["taps"],
              str(info.get("taps"))[:200])

    hf = families.hf_model(folder)
    check_trace(model, hf, prompt, info)
    check_python_steps(model, hf, prompt, args.pp)
    answers = model.llm.collective_rpc("fragments_call", args=(["model.layers.0.mlp.down_proj", "lm_head"],
                                                                save({"x": torch.zeros(1, 256)})))
    answer = next(a for a in answers if a is not None)
    check("a module call spanning stages is refused with one line", args.pp == 1 or (
        answer["error"] and "different pipeline stages" in answer["error"]), str(answer["error"])[:200])
    if args.compiled:
        stats = model.llm.collective_rpc("fragments_compile_stats")
        print(f"compile stats per rank: {json.dumps(stats)[:600]}", flush=True)
    print(json.dumps({"tp": args.tp, "pp": args.pp, "nnodes": args.nnodes, "compiled": args.compiled,
                      "failed": FAILED}), flush=True)
    model.llm.llm_engine.engine_core.shutdown()  # the engine's processes end here: they outlive os._exit
    if node1 is not None:
        stop(node1)
    return 1 if FAILED else 0


def check_trace(model, hf, prompt, info):
    """Every layer's output and the logit lens at every layer, the logits, and an edit on stage 0 carried into
    stage 1, against transformers' hooks."""
    import torch
    import families
    L = model.model.layers
    with model.trace(prompt):
        outs = [L[i].output.save() for i in range(LAYERS)]
        lens = [model.lm_head(model.model.norm(L[i].output)).save() for i in range(LAYERS)]
        logits = model.output.save()
    mods = [f"model.layers.{i}.mlp" for i in range(LAYERS)]
    with torch.no_grad():
        cap, hf_logits = families.capture(hf, mods, lambda: hf(torch.tensor([prompt])).logits[0])
        want_lens = [hf.lm_head(hf.model.norm(cap[(m, "output")])) for m in mods]
    for i in range(LAYERS):
        e = rel(outs[i].value, cap[(mods[i], "output")])
        check(f"trace: layer {i}'s output (stage {info.get('stage', {}).get(f'model.layers.{i}.output', 0)})",
              e <= TOL, f"rel {e:.2e}")
        e = rel(lens[i].value, want_lens[i])
        check(f"logit lens at layer {i} (the last stage's norm + head)", e <= TOL, f"rel {e:.2e}")
    e = rel(logits.value, hf_logits[-1:])
    check("trace: logits (model.output)", e <= TOL, f"rel {e:.2e}")
    lens_cost(model, outs[0].value)

    with model.trace(prompt):
        L[1].mlp.down_proj.output[...] += 0.25  # stage 0
        qkv3 = L[LAYERS - 1].self_attn.qkv_proj.output.save()  # stage 1
        logits_e = model.output.save()
    named = dict(hf.named_modules())
    hook = named["model.layers.1.mlp.down_proj"].register_forward_hook(lambda m, i, o: o + 0.25)
    a = f"model.layers.{LAYERS - 1}.self_attn"
    try:
        with torch.no_grad():
            cap_e, hf_logits_e = families.capture(hf, [f"{a}.{p}_proj" for p in "qkv"],
                                                  lambda: hf(torch.tensor([prompt])).logits[0])
    finally:
        hook.remove()
    want_qkv = torch.cat([cap_e[(f"{a}.{p}_proj", "output")] for p in "qkv"], -1)
    e = max(rel(qkv3.value, want_qkv), rel(logits_e.value, hf_logits_e[-1:]))
    check("an edit on stage 0 carries into stage 1 (layer 3's q|k|v, the logits)", e <= TOL, f"rel {e:.2e}")


def check_python_steps(model, hf, prompt, pp):
    """Activation patching within one stage (layer 1's MLP output set to half layer 0's, both on stage 0) equals
    transformers' hooks doing the same; a read across stages (layer 3 from layer 0) fails with the reason."""
    import torch
    import families
    from fragments import FragmentsError
    L = model.model.layers
    with model.trace(prompt):
        L[1].mlp.down_proj.output[...] = L[0].mlp.down_proj.output * 0.5
        logits = model.output.save()
    named = dict(hf.named_modules())
    kept = {}
    hooks = [named["model.layers.0.mlp.down_proj"].register_forward_hook(lambda m, i, o: kept.update(h=o)),
             named["model.layers.1.mlp.down_proj"].register_forward_hook(lambda m, i, o: kept["h"] * 0.5)]
    try:
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1:]
    finally:
        for h in hooks:
            h.remove()
    e = rel(logits.value, want)
    check("patching within a stage (a Python step) equals transformers'", e <= TOL, f"rel {e:.2e}")
    if pp < 2:
        return
    try:
        with model.trace(prompt):
            L[LAYERS - 1].mlp.down_proj.output[...] = L[0].mlp.down_proj.output * 0.5
        check("patching across stages fails with the reason", False, "no error")
    except FragmentsError as err:
        check("patching across stages fails with the reason", "pipeline stage" in str(err), str(err)[:200])


def start_node1(folder, args, engine, work):
    """The second node's workers: vLLM's own headless command (its mp executor, no API server), on one core of
    its own (node 0's workers take the other). Returns (process, LLM kwargs of node 0)."""
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = dict(nnodes=args.nnodes, node_rank=0, master_addr="127.0.0.1", master_port=port,
                 distributed_executor_backend="mp")
    cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", folder, "--headless", "--nnodes",
           str(args.nnodes), "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
           "--tensor-parallel-size", str(args.tp), "--pipeline-parallel-size", str(args.pp), "--enforce-eager",
           "--dtype", "float32", "--skip-tokenizer-init", "--max-model-len", str(engine["max_model_len"]),
           "--no-enable-prefix-caching", "--max-num-seqs", str(engine["max_num_seqs"]), "--seed", "0",
           "--distributed-executor-backend", "mp"]
    cores = os.cpu_count() or 1
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str((cores - 1) if cores > 1 else 0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    log = open(os.path.join(work, "node1.log"), "w")
    print(f"node 1: {' '.join(cmd[1:4])} ... (log {log.name})", flush=True)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), nodes


def stop(proc):
    """Ends node 1's command and the workers it started (SIGTERM: vLLM's headless mode shuts down on it)."""
    import psutil
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.terminate()
    try:
        proc.wait(30)
    except Exception:  # noqa: B902 - still there: killed below
        proc.kill()
    for child in psutil.wait_procs(children, timeout=15)[1]:
        child.kill()


def lens_cost(model, h):
    """What the cross-stage lens costs: the whole value sent to every worker (vLLM's RPC), the last stage runs
    the norm and head, its tensor-parallel rank 0 answers with the logits."""
    from safetensors.torch import save
    data = save({"x": h.contiguous()})
    t0 = time.perf_counter()
    for _ in range(5):
        model.llm.collective_rpc("fragments_call", args=(["model.norm", "lm_head"], data))
    dt = (time.perf_counter() - t0) / 5 * 1e3
    print(f"lens call: {len(data)} bytes to each worker, {dt:.1f} ms per call", flush=True)


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    remove_work()  # os._exit skips the exit hooks; main shut the engine down
    os._exit(rc)
