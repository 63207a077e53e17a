"""The Python API's host cost per traced call, two checkouts side by side in one run: rounds that alternate
between them (a shared machine's load falls on both alike), the median of each row per checkout.

    PY=$(bash tools/python_env.sh)
    $PY tools/probes/host_cost_compare.py OLD/python python MODELS [--rounds 5]

Rows: tools/probes/save_overhead_probe.py on llama_tp1 (one rank: a trace per call and `plan.run`, output only
and with a save at every fragmented location, and the C++ call alone), python_side_cost.py (the same traces' Python
side alone: the C++ call answered from a recorded result) and bench/python_trace_overhead.py on
llama_tp2 (world 2, 128 tokens: a trace per call, and the same steps handed to C++ directly). Each checkout's
`fragments` is the one its python/ folder holds (PYTHONPATH); the probes are this checkout's. Each row prints
its median per checkout, then the spread: each checkout's range over the rounds and the range of the per-round
ratios (a round's old and new run back to back).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run(python_dir, args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([python_dir, ROOT]))
    done = subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed with {python_dir}:\n{done.stderr[-3000:]}")
    return done.stdout


def rows(out):
    """A probe's printed rows: {name: microseconds} (its lines "<name, 36 wide> <us> us")."""
    return {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"^(.{36}) +([0-9.]+) us$", out, re.M)}


def save_probe(python_dir, models, repeats):
    out = run(python_dir, [os.path.join(HERE, "save_overhead_probe.py"), os.path.join(models, "llama_tp1", "rank0.pt"),
                           "--repeats", str(repeats)])
    return rows(out)


def python_side(python_dir, models, repeats):
    out = run(python_dir, [os.path.join(HERE, "python_side_cost.py"), os.path.join(models, "llama_tp1", "rank0.pt"),
                           "--repeats", str(repeats * 25)])
    return rows(out)


def trace_overhead(python_dir, models, repeats):
    out = run(python_dir, [os.path.join(ROOT, "bench", "python_trace_overhead.py"),
                           os.path.join(models, "llama_tp2", "rank{rank}.pt"), "--world", "2", "--repeats",
                           str(repeats), "--frag", os.path.join(models, "..", "..", "cli", "frag")])
    rows = {}
    for name in ("C++ steps from Python", "trace (Python API)"):
        found = re.search(re.escape(name) + r" +([0-9.]+) ms", out)
        rows[f"{name}, world 2 (ms)"] = float(found.group(1)) * 1e3  # as us, like the other rows
    return rows


def wait_for_idle(most, limit_s=120):
    """Waits (up to limit_s) until at most `most` tasks are runnable besides this one (/proc/loadavg's count),
    seen twice 0.5 s apart: on a shared machine a run then starts with fewer others on the cores."""
    quiet, end = 0, time.time() + limit_s
    while quiet < 2 and time.time() < end:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0]) - 1
        quiet = quiet + 1 if running <= most else 0
        time.sleep(0.5)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("models")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--idle", type=int, default=None,
                   help="before each pair of runs, wait (up to 2 minutes) until at most this many other tasks are "
                   "runnable (a shared machine)")
    a = p.parse_args()
    results = {"old": {}, "new": {}}
    probes = (lambda d: save_probe(d, a.models, a.repeats),
              lambda d: python_side(d, a.models, a.repeats),
              lambda d: trace_overhead(d, a.models, max(10, a.repeats // 10)))
    for r in range(a.rounds):
        for probe in probes:  # each probe's old and new runs back to back, in turn first
            if a.idle is not None:
                wait_for_idle(a.idle)
            for tag, python_dir in (("old", a.old), ("new", a.new))[::1 if r % 2 == 0 else -1]:
                for name, us in probe(python_dir).items():
                    results[tag].setdefault(name, []).append(us)
        print(f"round {r + 1} of {a.rounds} done (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})",
              flush=True)
    print(f"{'median over ' + str(a.rounds) + ' rounds (us)':<44} {'old':>10} {'new':>10} {'new/old':>8}   "
          "range old | new | new/old per round")
    for name in results["old"]:
        olds, news = results["old"][name], results["new"][name]
        old, new = statistics.median(olds), statistics.median(news)
        ratios = sorted(n / o for o, n in zip(olds, news))  # a round's two runs are back to back
        print(f"{name:<44} {old:10.1f} {new:10.1f} {new / old:8.3f}   {min(olds):.1f}-{max(olds):.1f} | "
              f"{min(news):.1f}-{max(news):.1f} | {ratios[0]:.3f}-{ratios[-1]:.3f} (median "
              f"{statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
