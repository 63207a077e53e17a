"""The Python side of a traced call alone: the C++ engine's call (`_C` run) answered from a recorded result, so
what is timed is the recording, the plan handed over and the saves delivered, without the forward (~270 us on
this machine's CPU, which a shared machine's load moves by more than the whole Python side). Rows as
save_overhead_probe.py's (the same traces: output only and a save at 10 fragmented locations, each as a trace
per call and as `plan.run`); tools/probes/host_cost_compare.py runs it for two checkouts side by side.

    PYTHONPATH=python:. $(bash tools/python_env.sh) tools/probes/python_side_cost.py \\
        bazel-bin/tests/models/llama_tp1/rank0.pt [--repeats 10000]
"""
import argparse
import sys
import timeit

import torch

import fragments

sys.path.insert(0, "bench")
from peer_benchmark import fragmented_locations  # noqa: E402
from save_overhead_probe import plans, traces  # noqa: E402


class RecordedEngine:
    """The rank's engine with `run` answered from the first real answer for the same number of steps (the
    same traces repeat: the answer is the one a real call gives; nothing else of the engine is touched)."""

    def __init__(self, engine):
        self._engine, self._answers = engine, {}

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run(self, steps, callables, ids, generate, same):
        key = (len(steps), len(callables))
        if key not in self._answers:
            self._answers[key] = self._engine.run(steps, callables, ids, generate, False)
        return self._answers[key]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("rank_file")
    p.add_argument("--repeats", type=int, default=10000)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = fragments.load(a.rank_file)
    ids = torch.zeros(1, 1, dtype=torch.long)
    names = fragmented_locations(model)[:10]
    model._c = RecordedEngine(model._c)

    plain, saving = traces(model, ids, names)
    plain_plan, saving_plan = plans(model, names)
    rows = {"Python side: trace, output only": plain,
            f"Python side: trace, {len(names)} saves": saving,
            "Python side: plan.run, output only": lambda: plain_plan.run(ids),
            f"Python side: plan.run, {len(names)} saves": lambda: saving_plan.run(ids)}
    for name, fn in rows.items():  # the best of 7 repeats: the least a shared machine's load added
        us = min(timeit.repeat(fn, number=a.repeats, repeat=7)) / a.repeats * 1e6
        print(f"{name:<36} {us:10.2f} us")


if __name__ == "__main__":
    main()
