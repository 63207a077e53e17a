"""One vLLM engine (eager; vLLM's CPU build, or its CUDA build on a GPU: engine_env.py) with fragments' plugin
against transformers' hooks on the same device in the same dtype (float32 unless FRAG_VLLM_DTYPE says).

    python vllm_check.py FAMILY TP [--heads H --kv-heads K] [--pp PP]

Writes a tiny checkpoint of FAMILY with transformers' save_pretrained, starts vLLM at tensor_parallel_size
TP (and pipeline_parallel_size PP: its 2 layers on 2 stages, layer 0 and the embedding on the first, layer 1
and the logits on the last; vLLM's mp executor) with the plugin loaded through its real entry points (a dist-info on PYTHONPATH naming
fragments.vllm:register), submits in ONE batch:
  R0 plain request on prompt A (no plan)
  R1 a read-only plan on prompt A: every location of families.Reader saved at prefill (step 0), the
     logits at every step and layer 0's down projection input at every step
  R2 an editing plan on prompt B: v head 1 of layer 0 scaled by 0.5 ("segment"/"heads"), a vector added
     to layer 1's MLP down-projection input at every step; saves layer 1's qkv output at prefill and the
     logits at every step
and R3, a plan whose index is out of range at run time (it fails in the workers, alone), then a request
whose plan names a rank-local location and one whose value does not fit its location's width (each refused
at submission, alone, the prompt beside it served; the engine unharmed) and a last plain request. It checks, printing one line per check and exiting non-zero on any failure:
  every saved whole value equals transformers' within 1e-5 relative (max abs diff / max abs value);
  R1's tokens and logprobs equal R0's exactly; decode-step rows equal transformers' forward over the
  prompt plus the generated tokens; R2's tokens equal transformers' greedy generation under the same
  edits and its saves equal the hooked transformers values; every saved value's width is the model record's
  ("widths": what the submission check holds values to); the bad plans were refused and a later request
  still ran.
"""
import argparse
import atexit
import json
import os
import shutil
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import engine_env

TOL = engine_env.bound()  # 1e-5 in float32 (engine_env: the bound per dtype and why)
FAILED = []


def use_bound(family: str) -> None:
    """The bound for `family` (engine_env.bound: Gemma 2's softcap on a GPU has its own)."""
    global TOL
    TOL = engine_env.bound(family)


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def rel(a, b):
    import torch
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def plugin_dist(folder):
    """A dist-info declaring fragments' two vLLM entry points (what `pip install .` installs)."""
    dist = os.path.join(folder, "fragments_vllm_plugin-0.1.dist-info")
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: fragments-vllm-plugin\nVersion: 0.1\n")
    with open(os.path.join(dist, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nfragments = fragments.vllm:register\n")
    return folder


_WORK = []  # folders work_folder made, removed at exit or by remove_work
_IPC = []  # the folder of vLLM's IPC sockets (one, for the whole process), removed by remove_work() alone


SHM_AGE_S = 10  # a segment younger than this may belong to an engine still starting: never removed


def remove_stray_shm(folder="/dev/shm", now=None):
    """vLLM CPU's shared-memory segments (its cpu_communicator: "{port}-{group}-cpushm_{rank}", 4 MB a rank) that
    no live process maps and older than SHM_AGE_S: what workers leave when they do not exit cleanly (seen once in
    CI at tp 2, 2026-12-07). Why they can: vLLM unlinks them only in a worker's clean exit, and its executor's
    shutdown sends SIGTERM and then SIGKILL to workers that have not exited within
    VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS and 4 s more (a loaded machine: CI's two cores). Tried by hand (stop 55):
    a tp 2 engine's processes killed with SIGKILL leave exactly this pair; torch's own segments (psm_*) and the
    semaphores go with Python's resource tracker. Every process here shares /proc and /dev/shm (tests run in a
    network namespace of their own at most), so a live engine's segments are always mapped and never taken.
    Removes them, says so on one line (which check ended when they were found), and returns their paths."""
    names = [n for n in os.listdir(folder) if "-cpushm_" in n] if os.path.isdir(folder) else []
    if not names:
        return []
    mapped = set()
    for maps in os.listdir("/proc"):
        if maps.isdigit():
            try:
                with open(f"/proc/{maps}/maps") as f:
                    mapped.update(line.split(None, 5)[5].strip() for line in f if "-cpushm_" in line)
            except (OSError, IndexError):
                continue  # a process gone meanwhile, or one we may not read
    now = time.time() if now is None else now
    stray = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            if path not in mapped and now - os.stat(path).st_mtime >= SHM_AGE_S:
                os.unlink(path)
                stray.append(path)
        except OSError:
            continue  # removed by another check meanwhile
    if stray:
        print(f"removed {len(stray)} stray vLLM shared-memory segment(s) at the end of {os.path.basename(sys.argv[0])} "
              f"(no process maps them: their workers did not exit cleanly): {', '.join(sorted(stray))}",
              file=sys.stderr, flush=True)
    return stray


def stop_process_group(proc, grace=15.0):
    """Ends what is left of `proc`'s process group (a process started with start_new_session=True: an engine and
    its engine core and workers): SIGTERM, then SIGKILL to whatever is still there after `grace` seconds; returns
    once the group is empty. Not SIGKILL first: Python's resource tracker (in the group; it ignores SIGTERM)
    unlinks torch's shared-memory segments and the semaphores of processes that died, once they are gone; killed
    with them, it leaves psm_* and sem.mp-* in /dev/shm (tried, stop 56, on bench/vllm_throughput.py's engines)."""
    def signal_group(sig):
        try:
            os.killpg(proc.pid, sig)
            return True
        except ProcessLookupError:
            return False
    signal_group(signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end:
        proc.poll()  # reaps the leader: a zombie would keep the group alive
        if not signal_group(0):
            break
        time.sleep(0.2)
    else:
        signal_group(signal.SIGKILL)
    proc.wait()


def work_folder(prefix):
    """A fresh folder for a check's or benchmark's files (checkpoint, plugin dist, compile cache): tests and
    scripts delete what they write, so it goes when the process ends, whatever the end. remove_work() before
    os._exit (which skips exit hooks; the engines shut down first), atexit otherwise (an exception, sys.exit).
    FRAG_KEEP_WORK=1 keeps it to look into, its path printed. A child given the folder (--work) makes none."""
    path = tempfile.mkdtemp(prefix=prefix)
    if not _WORK and not _IPC:
        atexit.register(remove_work)  # registered before the engine starts: runs after its exit hooks
    if not _IPC and "VLLM_RPC_BASE_PATH" not in os.environ:
        # vLLM's IPC sockets (tp > 1, vllm serve) go in its temporary folder and stay there: here, in a folder of
        # their own that lasts as long as the process (a work folder may go earlier: server_check's servers).
        # A socket's path has room for 107 bytes; the name vLLM adds is a 36-character uuid.
        ipc = tempfile.mkdtemp(prefix="frag-ipc-")
        _IPC.append(ipc)
        if len(ipc) + 40 <= 107:
            os.environ["VLLM_RPC_BASE_PATH"] = ipc
    _WORK.append(path)
    return path


def remove_work(path=None):
    """Removes `path` (default: every folder work_folder made, the sockets' folder, and the plugin's state
    folder where this process made it: os._exit skips its exit hook too), or keeps it where FRAG_KEEP_WORK=1.
    Without `path`, also vLLM CPU's shared-memory segments nobody maps any more (remove_stray_shm)."""
    keep = os.environ.get("FRAG_KEEP_WORK") == "1"
    plugin = sys.modules.get("fragments.vllm")
    if path is None and plugin is not None and not keep:
        plugin.remove_state_dir()
    if path is None and not keep:
        remove_stray_shm()
    for folders in (_WORK, _IPC if path is None else []):
        for p in [q for q in folders if path in (None, q)]:
            folders.remove(p)
            if keep:
                print(f"work folder kept (FRAG_KEEP_WORK=1): {p}", flush=True)
            else:
                shutil.rmtree(p, ignore_errors=True)


def down0_input(locs, reader):
    """Layer 0's MLP down projection input (every family's reader has one), read at every step; where `locs`
    has none left (Qwen2-MoE compiled on a GPU: its shared expert is refused), layer 0's attention output."""
    p = reader.layer_prefix(0)
    return next((l for l in locs if l.startswith(p + ".") and l.endswith(("down_proj.input", "dense_4h_to_h.input"))),
                None) or next(l for l in locs if l.startswith(p + ".") and l.endswith(("o_proj.input", "dense.input")))


def read_plan(locs, down0_in):
    """The read-only plan: every location of `locs` at the prefill, the logits at every step and layer 0's
    down projection input at every step."""
    plan = [{"at": loc, "do": "save", "as": loc, "step": 0} for loc in locs]
    return plan + [{"at": "logits_processor.output", "do": "save", "as": "final_logits"},
                   {"at": down0_in, "do": "save", "as": "down0_all"}]


def check_saves(hf, reader, locs, prompt, r, down0_in):
    """The read-only plan's saves (`r.fragments`, read_plan) against transformers' forward hooks: every
    whole value at the prefill, then the logits and the down projection input at every step (one forward
    over the prompt plus the generated tokens). Returns the worst relative difference."""
    import torch
    import families
    modules = sorted({m for spec in locs.values() for m in (spec[1] if isinstance(spec[1], list) else [spec[1]])})
    tokens = list(r.outputs[0].token_ids)
    with torch.no_grad():
        captured, _ = families.capture(hf, modules, lambda: hf(families.ids(hf, prompt)).logits[0])
        cap_full, logits_full = families.capture(hf, modules,
                                                 lambda: hf(families.ids(hf, prompt + tokens[:-1])).logits[0])
    worst = 0.0
    for loc, spec in locs.items():
        got = r.fragments.get(loc)
        e = rel(got, reader.read(spec, captured)) if got is not None else float("inf")
        worst = max(worst, e)
        check(f"whole value {loc}", e <= TOL, f"rel {e:.2e} shape {tuple(got.shape) if got is not None else None}")
    for name, got, want in [("logits at every step (prefill + decode)", "final_logits", logits_full[len(prompt) - 1:]),
                            ("decode steps: down projection input rows of every step", "down0_all",
                             reader.read(locs[down0_in], cap_full))]:
        value = r.fragments.get(got)
        e = rel(value, want) if value is not None else float("inf")
        worst = max(worst, e)
        check(name, e <= TOL, f"rel {e:.2e} shape {tuple(value.shape) if value is not None else None}")
    return worst


def check_edit(hf, edit, prompt, r, max_tokens):
    """The edit's request (`r`, families.Edit.plan) against transformers under the same edits: greedy tokens,
    layer 1's q|k|v and the logits at every step. Returns the worst relative difference."""
    import torch
    hf_tokens, qkv1, logits = edit.transformers(hf, prompt, max_tokens)
    tokens = list(r.outputs[0].token_ids)
    check("edit: tokens equal transformers' greedy under the same edits", tokens == hf_tokens,
          f"{tokens} vs {hf_tokens}")
    worst = 0.0
    for name, got, want in [("edit: downstream whole value equals transformers' under the same edits", "qkv1", qkv1),
                            ("edit: logits at every step equal transformers'", "final_logits", logits)]:
        e = rel(r.fragments.get(got, torch.empty(0)), want)
        worst = max(worst, e)
        check(name, e <= TOL, f"rel {e:.2e}")
    return worst


def executor_of(llm) -> str:
    """The executor vLLM resolved for the engine (parallel_config.distributed_executor_backend: "uni", "mp",
    "ray" or a class)."""
    backend = llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
    return backend if isinstance(backend, str) else getattr(backend, "__name__", str(backend))


def check_stages(info, pp, qkv0, down1):
    """Every stage's locations in one table, each with the stage acting there."""
    stage = info.get("stage", {})
    where = {loc: stage.get(loc) for loc in (f"{qkv0}.output", f"{down1}.input", "logits_processor.output")}
    check("inspect: each location's pipeline stage (layer 0 first, layer 1 and the logits last)",
          list(where.values()) == [0, pp - 1, pp - 1], json.dumps(where))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("family")
    ap.add_argument("tp", type=int)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size (vLLM's mp executor)")
    ap.add_argument("--executor", choices=("mp", "ray", "uni"), default=None,
                    help="distributed_executor_backend (default: vLLM's choice; ray: the GPU machine's one-GPU "
                    "check of issue 42, tools/device/vllm_stage.sh pack-ray)")
    args = ap.parse_args()
    use_bound(args.family)

    work = work_folder(f"frag-vllm-{args.family}-tp{args.tp}-")
    site = plugin_dist(os.path.join(work, "site"))
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = site + os.pathsep + os.environ.get("PYTHONPATH", "")
    engine_env.setup(args.tp * args.pp)

    import torch
    from safetensors.torch import save_file
    import families
    from fragments import vllm as fv
    from vllm import LLM

    folder = os.path.join(work, "model")
    families.write_checkpoint(args.family, folder, args.heads, args.kv_heads)
    cfg = families.config(args.family, args.heads, args.kv_heads)
    reader = families.Reader(args.family, cfg)
    locs = reader.locations()
    g = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(1, cfg.vocab_size, (7,), generator=g).tolist()
    prompt_b = torch.randint(1, cfg.vocab_size, (5,), generator=g).tolist()
    edit = families.Edit(args.family, cfg, g)
    edit.write(work)
    qkv0, down1 = edit.qkv0, edit.down1
    down0_in = down0_input(locs, reader)
    plan_read = read_plan(locs, down0_in)
    plan_edit = edit.plan()

    t0 = time.time()
    llm = LLM(folder, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, enforce_eager=True, dtype=engine_env.DTYPE, skip_tokenizer_init=True,
              max_model_len=64, enable_prefix_caching=False, max_num_seqs=8, seed=0, **engine_env.engine_kwargs(),
              **({"distributed_executor_backend": args.executor} if args.executor else {}))
    start_s = time.time() - t0
    print(f"engine start {start_s:.1f} s ({engine_env.describe()})", flush=True)

    if args.executor:
        check(f"vLLM's {args.executor} executor runs the engine", executor_of(llm) == args.executor, executor_of(llm))
    info = fv.inspect(llm)
    want_runner = {"v1": "V1", "v2": "V2"}.get(engine_env.RUNNER) if engine_env.GPU else "V1"
    if want_runner:
        check(f"the plugin serves the model runner vLLM chose ({want_runner})", info.get("runner") == want_runner,
              str(info.get("runner")))
    expected_fragmented = args.tp > 1
    check("inspect: qkv fragmented" if expected_fragmented else "inspect: nothing fragmented at tp 1",
          (f"{qkv0}.output" in info["fragmented"]) == expected_fragmented, json.dumps(info["fragmented"])[:300])
    if args.tp > 1:
        check("inspect: attention internals refused as rank-local",
              any(".attn." in k or k.endswith(".attn.output") for k in info["refused"]), str(list(info["refused"])[:4]))

    if args.pp > 1:
        check_stages(info, args.pp, qkv0, down1)
    tokens = {"max_tokens": args.max_tokens, "temperature": 0.0, "logprobs": 2}
    # R3: a plan that passes the submission check but cannot run (row 50 of a 5-token prompt): it fails in
    # the workers, that request alone, on every rank alike.
    save_file({"w": torch.ones(7)}, os.path.join(work, "bad.safetensors"))
    plan_unfit = [{"at": f"{down1}.input", "do": "add", "value": "bad.safetensors:w", "index": "50,..."}]
    outs = fv.generate(llm, [{"prompt_token_ids": prompt_a}, {"prompt_token_ids": prompt_a},
                             {"prompt_token_ids": prompt_b}, {"prompt_token_ids": prompt_b}],
                       [None, {"interventions": plan_read}, {"interventions": plan_edit, "base": work},
                        {"interventions": plan_unfit, "base": work}], **tokens)
    r0, r1, r2, r3 = outs
    for r in outs[:3]:
        check("no plan error", r.fragments_error is None, str(r.fragments_error))
    check("a step that cannot run fails its request alone", r3.fragments_error is not None and
          f"{down1}.input (add)" in r3.fragments_error, str(r3.fragments_error)[:200])
    t0_ids, t1_ids = list(r0.outputs[0].token_ids), list(r1.outputs[0].token_ids)
    check("read-only plan: tokens equal the plain request's in the same batch", t0_ids == t1_ids,
          f"{t0_ids} vs {t1_ids}")
    # The same batch again with R1's read-only plan left out (the other requests' plans kept: an edit of R2
    # changes its tokens, hence MoE routing, hence which tokens share an expert matmul with R1's): plain
    # vLLM's logprobs there are what the read-only plan must leave bit for bit. (vLLM's CPU kernels give a
    # row slightly different bits at another batch position, ~1e-7, so R0 is not the reference for them.)
    plain = fv.generate(llm, [{"prompt_token_ids": prompt_a}, {"prompt_token_ids": prompt_a},
                              {"prompt_token_ids": prompt_b}, {"prompt_token_ids": prompt_b}],
                       [None, None, {"interventions": plan_edit, "base": work},
                        {"interventions": plan_unfit, "base": work}], **tokens)[1]

    def logprobs(r):
        return [{k: v.logprob for k, v in d.items()} for d in r.outputs[0].logprobs]
    exact = list(plain.outputs[0].token_ids) == t1_ids and logprobs(plain) == logprobs(r1)
    if exact:
        check("read-only plan: tokens and logprobs equal plain vLLM's (exactly)", True)
    else:
        # Exact only where vLLM itself is: run the plain batch once more. vLLM 0.24's CPU MoE (float32 torch
        # path) was seen to differ from itself by ~2e-7 between identical batches; then the plan must stay
        # within that kind of noise (1e-5 relative), with equal tokens, and the line says so.
        again = fv.generate(llm, [{"prompt_token_ids": prompt_a}, {"prompt_token_ids": prompt_a},
                                  {"prompt_token_ids": prompt_b}, {"prompt_token_ids": prompt_b}],
                            [None, None, {"interventions": plan_edit, "base": work},
                             {"interventions": plan_unfit, "base": work}], **tokens)[1]
        vllm_exact = logprobs(again) == logprobs(plain)

        def gap(a, b):
            return max(abs(x[k] - y[k]) for x, y in zip(a, b) for k in x if k in y)
        g = gap(logprobs(plain), logprobs(r1))
        # MoE: the CPU experts group tokens of every request in the step, and which requests share a step
        # depends on when they reach vLLM's engine-core process (timing): bits then vary with the run,
        # plan or not. Dense families: rows are independent, so exact is required.
        moe = args.family == "qwen2_moe"
        check("read-only plan: tokens and logprobs equal plain vLLM's (exactly; MoE: tokens and 1e-5)",
              (moe or not vllm_exact) and list(plain.outputs[0].token_ids) == t1_ids and g <= 1e-5,
              f"vLLM bit-reproducible across identical batches: {vllm_exact}; plan vs plain max |dlogprob| {g:.2e}")

    hf = families.hf_model(folder)
    worst = check_saves(hf, reader, locs, prompt_a, r1, down0_in)
    worst = max(worst, check_edit(hf, edit, prompt_b, r2, args.max_tokens))

    # a bad plan fails that request alone, before it runs; the prompt beside it runs
    refused = next(iter(info["refused"]), None) if args.tp > 1 else None
    bad = [{"at": refused or "model.no_such_module.output", "do": "save", "as": "x"}]
    unfit = {"interventions": [{"at": f"{down1}.input", "do": "add", "value": "bad.safetensors:w"}], "base": work}
    out = fv.generate(llm, [{"prompt_token_ids": prompt_a}] * 3, [bad, None, unfit], **tokens)
    check("bad plan refused at submission, alone", isinstance(out[0], fv.Refused) and "fragments plan" in
          out[0].fragments_error and list(out[1].outputs[0].token_ids) == t0_ids, repr(out[0])[:200])
    check("a value that does not fit its location refused at submission", isinstance(out[2], fv.Refused) and
          "does not fit" in out[2].fragments_error, repr(out[2])[:200])
    widths = info.get("widths", {})
    at = {**{name: name for name in r1.fragments}, "final_logits": "logits_processor.output", "down0_all": down0_in}
    known = {name: at[name] for name in r1.fragments if at[name] in widths}
    off = {name: (widths[loc], tuple(r1.fragments[name].shape)) for name, loc in known.items()
           if r1.fragments[name].shape[-1] != widths[loc]}
    check("every saved value's width is the model record's", not off and len(known) >= 5,
          f"{len(known)} of {len(r1.fragments)} saves have a known width; off: {str(off)[:300]}")
    try:  # vLLM's own validator refuses it too (LLM.generate without the helper)
        llm.generate([{"prompt_token_ids": prompt_a}], fv.sampling_params(bad, max_tokens=2), use_tqdm=False)
        check("bad plan refused by vLLM's validator", False, "no error")
    except ValueError as e:
        check("bad plan refused by vLLM's validator", "fragments plan" in str(e), str(e)[:200])
    after = fv.generate(llm, [{"prompt_token_ids": prompt_a}], [None], **tokens)[0]
    check("engine unharmed after a bad plan", list(after.outputs[0].token_ids) == t0_ids)

    print(json.dumps({"family": args.family, "tp": args.tp, "pp": args.pp, "executor": executor_of(llm),
                      "platform": engine_env.describe(),
                      "runner": info.get("runner"), "engine_start_s": round(start_s, 1),
                      "worst_rel": worst, "failed": FAILED}), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    remove_work()  # os._exit skips the exit hooks
    os._exit(rc)  # vLLM's engine processes end with this one
