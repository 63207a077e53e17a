"""Where a trace's per-save cost goes (issue 31: saves at the fragmented locations add <= 15 % to a captured
decode step). Times, on one rank, a 1-token trace with only the output saved against one with a save at every
fragmented location, splits the difference into the Python recording, the C++ call (plan, forward, saves
handed out) and what is left, times the same two recorded once and run per call (`model.plan()`,
`plan.run(ids)`: the decode loop's path), and prints a cProfile of the saving trace's Python side.

    PYTHONPATH=bazel-bin/python:python:. $(bash tools/python_env.sh) tools/probes/save_overhead_probe.py \\
        bazel-bin/tests/models/llama_tp1/rank0.pt [--device cuda] [--repeats 200]
"""
import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch

import fragments
from fragments import Trace

sys.path.insert(0, "bench")
from peer_benchmark import fragmented_locations, location_of  # noqa: E402


# On a shared CPU the process's own CPU time (one intra-op thread) is what the machine's load leaves alone.
CLOCK = time.perf_counter


def timed(fn, repeats, sync):
    out = []
    for _ in range(repeats):
        sync()
        t = CLOCK()
        fn()
        sync()
        out.append(CLOCK() - t)
    return statistics.median(out) * 1e6


def traces(model, ids, names):
    """(a trace of `ids` saving the output only, one saving `names` too): each a function that records and runs it."""
    def plain():
        with model.trace(ids):
            out = model.output.save()
        return out.value

    def saving():
        with model.trace(ids):
            for n in names:
                location_of(model, n).save()
            out = model.output.save()
        return out.value
    return plain, saving


def plans(model, names):
    """The same two recorded once (`model.plan()`): run with `plan.run(ids)`."""
    with model.plan() as plain_plan:
        model.output.save()
    with model.plan() as saving_plan:
        for n in names:
            location_of(model, n).save()
        model.output.save()
    return plain_plan, saving_plan


def main():
    p = argparse.ArgumentParser()
    p.add_argument("rank_file")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=200)
    a = p.parse_args()
    global CLOCK
    if a.device == "cpu":
        torch.set_num_threads(1)
        CLOCK = time.process_time
    model = fragments.load(a.rank_file, device=a.device) if a.device != "cpu" else fragments.load(a.rank_file)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    ids = torch.zeros(1, 1, dtype=torch.long)
    names = fragmented_locations(model)

    plain, saving = traces(model, ids, names)
    has_plan = hasattr(type(model), "plan")  # (the same probe on a tree from before model.plan())
    if has_plan:
        plain_plan, saving_plan = plans(model, names)

    # The C++ call alone, with the steps a saving trace records (their recording timed apart).
    recorded = {}
    orig_run = Trace._run

    def keep(self):
        recorded["steps"], recorded["ids"] = list(self._steps), self._ids
        return orig_run(self)
    Trace._run = keep
    saving()
    Trace._run = orig_run

    def c_call():  # as a repeated trace calls it: the plan still registered, not parsed again
        model._c.run(recorded["steps"], [], recorded["ids"], 0, True)

    def c_call_empty():
        model._c.run([], [], recorded["ids"], 0, True)

    def record_only():
        t = Trace(model, ids)
        model._trace = t
        try:
            for n in names:
                location_of(model, n).save()
            model.output.save()
        finally:
            model._trace = None


    # Each case's first call registers its plan (C++ same_plan False); the timed ones repeat it, as a trace
    # repeated call after call does.
    def register(steps):
        return lambda: model._c.run(steps, [], recorded["ids"], 0, False)
    cases = [("trace, output only", plain, None),
             (f"trace, {len(names)} saves + output", saving, None),
             ("plan.run, output only", lambda: plain_plan.run(ids), None),
             (f"plan.run, {len(names)} saves + output", lambda: saving_plan.run(ids), None),
             ("C++ run of those steps", c_call, register(recorded["steps"])),
             ("C++ run, no steps", c_call_empty, register([])),
             ("Python recording only", record_only, None)]
    cases = [c for c in cases if has_plan or not c[0].startswith("plan.run")]
    for _, fn, setup in cases:
        for _ in range(5):
            (setup or fn)()
            fn()
    rows = {name: [] for name, _, _ in cases}
    for _ in range(5):  # interleaved rounds: a shared machine's load falls on every row alike
        for name, fn, setup in cases:
            if setup:
                setup()
            rows[name].append(timed(fn, max(1, a.repeats // 5), sync))
    rows = {name: statistics.median(us) for name, us in rows.items()}
    for name, us in rows.items():
        print(f"{name:<36} {us:9.1f} us")
    n = len(names)
    trace_extra = rows[f"trace, {n} saves + output"] - rows["trace, output only"]
    plan_extra = (rows[f"plan.run, {n} saves + output"] - rows["plan.run, output only"]) if has_plan else None
    print(f"per save, trace:    {trace_extra / n:.1f} us ({trace_extra:.0f} us per call for {n}; recording "
          f"{rows['Python recording only'] / n:.1f} us a save)")
    cpp = (rows["C++ run of those steps"] - rows["C++ run, no steps"]) / n
    if has_plan:
        print(f"per save, plan.run: {plan_extra / n:.1f} us ({plan_extra:.0f} us per call for {n}; C++ {cpp:.1f} "
              "us a save)")
    else:
        print(f"per save, C++: {cpp:.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.repeats):
        saving()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
