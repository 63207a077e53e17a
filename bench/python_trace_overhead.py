"""Python front end overhead per forward, side by side in one run:
  - a trace (recording + typed plan + the C++ run) in fragments' Python API,
  - the same typed steps handed to the C++ runtime directly (fragments._C: set the plan, forward),
  - the same plan as JSON through the C++ CLI itself: `frag run --world N --plan P --repeat R`, which
    clears, applies and runs the forward R times and prints its median per forward (run before and after
    the Python runs; their mean is the reference).

    PYTHONPATH=bazel-bin/python:python:. $(bash tools/python_env.sh) bench/python_trace_overhead.py \\
        'bazel-bin/tests/models/llama_tp2/rank{rank}.pt' [--world 2] [--tokens 128] [--repeats 30] \\
        [--frag bazel-bin/cli/frag] [--rounds K]

Prints, on rank 0, the median time per forward of each and the ratios (goal, issue 15: trace <= 1.05 x CLI).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

import torch

import fragments


def body(model, v):
    m = model.model
    m.layers[0].mlp.down_proj.input.save()
    m.layers[1].self_attn.qkv_proj.output.save()
    m.layers[0].output[:, -1] += v
    return model.output.save()


def work(rank, path, tokens, repeats):
    model = fragments.load(path)
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    v = torch.randn(64, generator=torch.Generator().manual_seed(1))  # the same on every rank (else refused)
    with model.trace(ids) as recorded:
        body(model, v)
    steps = recorded._steps
    python, direct = [], []
    for _ in range(3):  # warm up both paths (the profiling executor specializes the graph)
        with model.trace(ids):
            body(model, v)
        model._c.run(steps, [], recorded._ids)
    for _ in range(repeats):
        t = time.perf_counter()
        with model.trace(ids):
            body(model, v)
        python.append(time.perf_counter() - t)
        t = time.perf_counter()
        model._c.run(steps, [], recorded._ids)
        direct.append(time.perf_counter() - t)
    return statistics.median(python), statistics.median(direct)


def plan_for_cli(folder, tokens, v):
    """The trace's body as a JSON plan and an ids file, for `frag run`."""
    from safetensors.torch import save_file
    save_file({"v": v.contiguous()}, os.path.join(folder, "v.safetensors"))
    plan = {"interventions": [
        {"at": "model.layers.0.mlp.down_proj.input", "do": "save", "as": "down_in"},
        {"at": "model.layers.1.self_attn.qkv_proj.output", "do": "save", "as": "qkv"},
        {"at": "model.layers.0.output", "do": "add", "value": "v.safetensors:v", "index": ":,-1"}]}
    with open(os.path.join(folder, "plan.json"), "w") as f:
        json.dump(plan, f)
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with open(os.path.join(folder, "ids.txt"), "w") as f:
        f.write(" ".join(str(int(i)) for i in ids[0]) + "\n")
    return os.path.join(folder, "plan.json"), os.path.join(folder, "ids.txt")


def cli_median(frag, path, world, plan, ids, repeats):
    """frag run's own median per forward (set the plan, forward), from its --repeat line."""
    out = subprocess.run([frag, "run", path, "--world", str(world), "--input", ids, "--plan", plan,
                          "--repeat", str(repeats)], capture_output=True, text=True, timeout=600)
    found = re.search(r"median ([0-9.]+) ms per forward", out.stderr)
    if out.returncode != 0 or not found:
        raise SystemExit(f"frag run failed (exit {out.returncode}):\n{out.stderr}")
    return float(found.group(1)) / 1e3


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rounds", type=int, default=1,
                   help="CLI / Python / CLI rounds; more than one prints each round and the median of their "
                        "ratios (this machine's speed drifts by more than the 5 %% goal between runs)")
    p.add_argument("--frag", default="bazel-bin/cli/frag", help="the frag CLI")
    a = p.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        v = torch.randn(64, generator=torch.Generator().manual_seed(1))
        plan, ids = plan_for_cli(folder, a.tokens, v)
        for _ in range(a.rounds):
            cli_before = cli_median(a.frag, a.path, a.world, plan, ids, a.repeats)
            python, direct = fragments.launch(work, world=a.world, args=(a.path, a.tokens, a.repeats))[0]
            cli_after = cli_median(a.frag, a.path, a.world, plan, ids, a.repeats)
            rounds.append(((cli_before + cli_after) / 2, cli_before, cli_after, direct, python))
    print(f"world {a.world}, {a.tokens} tokens, median of {a.repeats} forwards each:")
    for cli, cli_before, cli_after, direct, python in rounds:
        print(f"  frag run --plan (CLI)   {cli * 1e3:8.2f} ms  (before {cli_before * 1e3:.2f}, after {cli_after * 1e3:.2f})")
        print(f"  C++ steps from Python   {direct * 1e3:8.2f} ms  {direct / cli:.3f} x CLI")
        print(f"  trace (Python API)      {python * 1e3:8.2f} ms  {python / cli:.3f} x CLI "
              f"({(python / cli - 1) * 100:+.1f} %; goal <= +5 %), {(python / direct - 1) * 100:+.1f} % vs C++ steps")
    if len(rounds) > 1:
        traces = sorted(r[4] / r[0] for r in rounds)
        directs = sorted(r[3] / r[0] for r in rounds)
        trace = statistics.median(traces)
        print(f"median over {len(rounds)} rounds: trace {trace:.3f} x CLI (rounds {traces[0]:.3f} to "
              f"{traces[-1]:.3f}; goal <= 1.05: {'met' if trace <= 1.05 else 'NOT met'}), C++ steps from Python "
              f"{statistics.median(directs):.3f} x CLI")
