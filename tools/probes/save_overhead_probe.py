"""Where a trace's per-save cost goes (issue 31: saves at the fragmented locations add <= 15 % to a captured
decode step). Times, on one rank, a 1-token trace with only the output saved against one with a save at every
fragmented location, splits the difference into the Python recording, the C++ call (plan, forward, saves
handed out) and what is left, and prints a cProfile of the saving trace's Python side.

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
from fragments import _model

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

    # The C++ call alone, with the steps a saving trace records (their recording timed apart).
    recorded = {}
    orig_run = _model.Trace._run

    def keep(self):
        recorded["steps"], recorded["ids"] = list(self._steps), self._ids
        return orig_run(self)
    _model.Trace._run = keep
    saving()
    _model.Trace._run = orig_run

    def c_call():
        model._c.run(recorded["steps"], [], recorded["ids"], 0)

    def c_call_empty():
        model._c.run([], [], recorded["ids"], 0)

    def record_only():
        t = _model.Trace(model, ids)
        model._trace = t
        try:
            for n in names:
                location_of(model, n).save()
            model.output.save()
        finally:
            model._trace = None

    for fn in (plain, saving, c_call, c_call_empty, record_only):
        for _ in range(5):
            fn()
    rows = {name: timed(fn, a.repeats, sync) for name, fn in
            [("trace, output only", plain), (f"trace, {len(names)} saves + output", saving),
             ("C++ run of those steps", c_call), ("C++ run, no steps", c_call_empty),
             ("Python recording only", record_only)]}
    for name, us in rows.items():
        print(f"{name:<36} {us:9.1f} us")
    extra = rows[f"trace, {len(names)} saves + output"] - rows["trace, output only"]
    print(f"per save: {extra / len(names):.1f} us (recording {rows['Python recording only'] / len(names):.1f} us)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.repeats):
        saving()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
