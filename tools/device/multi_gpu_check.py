#!/usr/bin/env python3
"""tp=2 on two GPUs over NCCL against tp=1, through `frag run` (issue 6's equivalence suite).

For each reference model and dtype it exports tp=1 and tp=2 (tools/export_model.py), asks `frag inspect --json
--all` for the locations, and runs with `frag run --device cuda` (one GPU per rank, NCCL):

  read plan   a save at every fragmented location, a save at every whole location of layer 0, and an ad-hoc
              call (logit lens: model.norm, lm_head) at model.layers.1.output;
  edit plan   on layer 0 and lm_head, one edit per fragmented location, each index crossing a boundary (q/k,
              gate/up, the rank boundary of a shard; partial sums and vocab shards too): scale, zero, set
              and add, plus a steering vector added at model.layers.1.output.

Checks (tp=1 on one GPU is the ground truth):
  - every saved tensor and the logits of the read plan at tp=2 equal tp=1 within the tolerance;
  - the read plan leaves the tp=2 logits bit-identical to no plan;
  - the edit plan changes tp=2 logits as it changes tp=1 logits (within the tolerance), and it matters
    (tp=1 logits move by more than 10x the tolerance);
  - once, on the first model: two ranks started as separate processes (torchrun's variables) with different
    plans both refuse with the "different interventions" error well within --timeout, neither hangs.
Tolerance on max |a - b|: float32 1e-4 (the CPU suites' bound); bfloat16 8 units of bf16 rounding (2^-8 each)
of the reference tensor's largest magnitude: 0.03125 * max(1, max|ref|).

Run on a machine with 2 GPUs after tools/device/build_and_test.sh (or any CMake build):
    NCCL_NVLS_ENABLE=0 python3 tools/device/multi_gpu_check.py --frag build/device/cli/frag
Prints one line per check and "N passed, N failed"; exits 1 if any check failed.
"""
import argparse
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(TOOLS))  # the repository root holds fragkit/

import torch  # noqa: E402

from fragkit.safetensors_io import load_file, save_file  # noqa: E402

HIDDEN = 64
MODELS = {
    "llama": ["--model", "llama"],
    "llama_mqa": ["--model", "llama", "--kv-heads", "1"],  # kv heads replicated on both ranks
    "llama_plain_mlp": ["--model", "llama", "--mlp", "plain"],
    "qwen2_moe": ["--model", "qwen2_moe"],
    "qwen2_moe_ep": ["--model", "qwen2_moe", "--ep"],
}
REFERENCE = {"qwen2_moe_ep": "qwen2_moe"}  # EP exports the same weights as the TP export at tp=1


def tolerance(dtype, reference):
    if dtype == "float32":
        return 1e-4
    return 8 * 2.0 ** -8 * max(1.0, reference.abs().max().item())


def run(cmd):
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError("%s\nfailed (%d):\n%s" % (" ".join(cmd), done.returncode, done.stdout[-4000:]))
    return done.stdout


def export(folder, flags, tp, dtype):
    if not os.path.exists(os.path.join(folder, "rank0.pt")):
        run([sys.executable, os.path.join(TOOLS, "export_model.py"), *flags, "--tp", str(tp), "--dtype", dtype,
             "--hidden", str(HIDDEN), "--out", folder])
    return [os.path.join(folder, "rank%d.pt" % r) for r in range(tp)]


def boundary_index(entry):
    """A slice of the whole's last dim that crosses a boundary of the layout."""
    rule, width = entry["rule"], entry["whole_width"]
    kind = rule["kind"]
    if kind == "qkv":
        cut = rule["num_heads"] * rule["head_size"]  # q | k
    elif kind == "segments":
        cut = rule["segment_sizes"][0]  # gate | up
    elif kind == "vocab_shard":
        cut = rule["padded_vocab"] // rule["group_size"]  # rank 0 | rank 1
    elif kind == "shard":
        cut = width // rule["group_size"]
    else:  # partial_sum: any columns
        cut = width // 2
    return "...,%d:%d" % (cut - 3, min(width, cut + 5))


def plans(folder, inspect, dtype):
    fragmented = inspect["fragmented"]
    whole = [w["location"] if isinstance(w, dict) else w for w in inspect.get("whole", [])]
    read = [{"at": e["location"], "do": "save", "as": e["location"]} for e in fragmented]
    read += [{"at": loc, "do": "save", "as": loc} for loc in whole if loc.startswith("model.layers.0.")]
    read.append({"at": "model.layers.1.output", "do": "call", "modules": ["model.norm", "lm_head"], "as": "lens1"})

    torch.manual_seed(1)
    values = {"steer": torch.randn(HIDDEN).to(getattr(torch, dtype))}
    edit = []
    actions = ["scale", "zero", "set", "add"]
    picked = [e for e in fragmented if e["location"].startswith(("model.layers.0.", "lm_head."))]
    for i, entry in enumerate(picked):
        step = {"at": entry["location"], "index": boundary_index(entry)}
        action = actions[i % len(actions)]
        step["do"] = action
        if action == "scale":
            step["by"] = 0.5
        elif action in ("set", "add"):
            name = "v%d" % i
            values[name] = (0.25 * torch.ones(1)).to(getattr(torch, dtype))  # broadcast to the selection
            step["value"] = "values.safetensors:" + name
        edit.append(step)
    edit.append({"at": "model.layers.1.output", "do": "add", "value": "values.safetensors:steer"})
    save_file(values, os.path.join(folder, "values.safetensors"))
    paths = {}
    for name, steps in (("read", read), ("edit", edit)):
        paths[name] = os.path.join(folder, name + ".json")
        with open(paths[name], "w") as f:
            json.dump({"interventions": steps}, f, indent=1)
    return paths, len(edit)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frag", required=True, help="the frag binary of a CUDA build")
    p.add_argument("--work", default=None, help="folder for exports and outputs (default: a temporary one)")
    p.add_argument("--models", nargs="*", default=sorted(MODELS), choices=sorted(MODELS))
    p.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--timeout", type=int, default=120, help="frag run --timeout")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the same checks over Gloo (a smoke test of this script)")
    args = p.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("multi_gpu_check: SKIPPED: needs 2 GPUs, this machine has %d" % torch.cuda.device_count())
        return 0
    work = args.work or tempfile.mkdtemp(prefix="frag-multi-gpu-")
    if not args.work:  # ours: removed when the check ends, whatever the end
        atexit.register(shutil.rmtree, work, True)
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "ids.txt"), "w") as f:
        g = torch.Generator().manual_seed(7)
        for row in torch.randint(0, 1000, (2, 24), generator=g).tolist():
            f.write(" ".join(map(str, row)) + "\n")
    passed = failed = 0

    def check(label, ok, detail):
        nonlocal passed, failed
        passed += bool(ok)
        failed += not ok
        print("%-58s %-4s %s" % (label, "PASS" if ok else "FAIL", detail), flush=True)

    def frag_run(files, world, out, plan=None):
        cmd = [args.frag, "run", "--world", str(world), "--device", args.device, *files, "--input",
               os.path.join(work, "ids.txt"), "--out", out, "--timeout", str(args.timeout)]
        if plan:
            cmd += ["--plan", plan]
        run(cmd)
        return {k: v.float() for k, v in load_file(out).items()}

    def divergent_plans_refused(files, plans_by_rank):
        """Both ranks must fail with the cross-rank digest error, not hang."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start = time.monotonic()
        procs = []
        for r, plan in enumerate(plans_by_rank):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            cmd = [args.frag, "run", "--device", args.device, *files, "--input", os.path.join(work, "ids.txt"),
                   "--out", os.path.join(work, "divergent%d.safetensors" % r), "--timeout", str(args.timeout)]
            if plan:
                cmd += ["--plan", plan]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = []
        for proc in procs:
            try:
                outputs.append((proc.wait(timeout=args.timeout * 2), proc.stdout.read()))
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs.append((None, "HUNG"))
        seconds = time.monotonic() - start
        ok = all(rc not in (0, None) and "different interventions" in out for rc, out in outputs)
        detail = "; ".join("rank %d: exit %s, %s" % (r, rc, out.strip().splitlines()[-1][:140] if out.strip() else "")
                           for r, (rc, out) in enumerate(outputs))
        check("rank-divergent plans are refused on both ranks", ok, "%.1f s; %s" % (seconds, detail))

    divergence_checked = False
    for dtype in args.dtypes:
        for model in args.models:
            label = "%s %s" % (model, dtype)
            try:
                ref_model = REFERENCE.get(model, model)
                tp1 = export(os.path.join(work, "%s_%s_tp1" % (ref_model, dtype)), MODELS[ref_model], 1, dtype)
                folder = os.path.join(work, "%s_%s_tp2" % (model, dtype))
                tp2 = export(folder, MODELS[model], 2, dtype)
                inspect = json.loads(run([args.frag, "inspect", "--json", "--all", tp2[0]]))
                plan, edits = plans(folder, inspect, dtype)
                out = lambda name: os.path.join(folder, name + ".safetensors")  # noqa: E731
                ref_plain = frag_run(tp1, 1, out("tp1_plain"))
                ref_read = frag_run(tp1, 1, out("tp1_read"), plan["read"])
                ref_edit = frag_run(tp1, 1, out("tp1_edit"), plan["edit"])
                plain = frag_run(tp2, 2, out("tp2_plain"))
                read = frag_run(tp2, 2, out("tp2_read"), plan["read"])
                edit = frag_run(tp2, 2, out("tp2_edit"), plan["edit"])
            except Exception as e:  # noqa: BLE001 - reported as a failed check
                check(label + ": runs", False, str(e).splitlines()[0] + " ... " + str(e)[-600:])
                continue

            worst, worst_name, n = 0.0, "", 0
            ok = sorted(read) == sorted(ref_read)
            for name in sorted(ref_read):
                if name not in read:
                    continue
                diff = (read[name] - ref_read[name]).abs().max().item()
                tol = tolerance(dtype, ref_read[name])
                n += 1
                if diff / tol > worst:
                    worst, worst_name = diff / tol, "%s %.2e (tol %.2e)" % (name, diff, tol)
                ok = ok and diff <= tol
            check(label + ": %d saved tensors + logits = tp=1" % n, ok and n > 2,
                  "worst: " + worst_name + ("" if sorted(read) == sorted(ref_read) else "; NAMES DIFFER"))
            check(label + ": read plan leaves logits bit-identical", torch.equal(read["logits"], plain["logits"]),
                  "")
            diff = (edit["logits"] - ref_edit["logits"]).abs().max().item()
            tol = tolerance(dtype, ref_edit["logits"])
            effect = (ref_edit["logits"] - ref_plain["logits"]).abs().max().item()
            check(label + ": %d edits change logits as at tp=1" % edits,
                  diff <= tol and effect > 10 * tol,
                  "max diff %.2e (tol %.2e); the edits move tp=1 logits by %.2e" % (diff, tol, effect))
            if not divergence_checked:
                divergence_checked = True
                divergent_plans_refused(tp2, [plan["read"], plan["edit"]])
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
