"""The durations of the worker's last KEEP calls of a step phase (begin_step, end_step), beside their sum
(WorkerState.host_s). Why: a saving run's sum says how much the worker spent, not whether a typical step or a
few long ones spent it. Run40's H200 host put 235 us a step on average into the saving column's begin_step and
end_step, against 130 us for the same work in tools/probes/vllm_step_cost.py; a run also has its long steps (the
batch's first decode step, a block's put, its end: ~4 ms each under run39's profiler). compile_stats reports them
("step_s"); bench/vllm_throughput.py sums up a run's with `between`."""
from __future__ import annotations

import statistics
from collections import Counter, deque
from typing import Dict

KEEP = 4096  # calls kept per phase: a run of the bench's (64 x 128 tokens) has ~130 steps


class StepDurations:
    """Per phase: how many calls so far, and the last KEEP calls' durations in seconds."""
    __slots__ = ("calls", "last")

    def __init__(self):
        self.calls: Counter = Counter()
        self.last: Dict[str, deque] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.calls[phase] += 1
        kept = self.last.get(phase)
        if kept is None:
            kept = self.last[phase] = deque(maxlen=KEEP)
        kept.append(seconds)

    def report(self) -> Dict[str, dict]:
        """{phase: {"calls": calls so far, "last": [the last calls' seconds, oldest first]}} (RPC-able)."""
        return {phase: {"calls": self.calls[phase], "last": list(kept)} for phase, kept in self.last.items()}


def between(before: Dict[str, dict], after: Dict[str, dict], longest: int = 3) -> Dict[str, float]:
    """The calls made between two reports, per phase: `<phase>_calls`, their median, 90th percentile and longest
    in microseconds, the `longest` longest calls' sum and the others' in milliseconds (`<phase>_top3_ms`,
    `<phase>_rest_ms`). Where more calls were made than a report keeps, the last KEEP are summed up, and
    `<phase>_calls` still counts all of them."""
    out: Dict[str, float] = {}
    for phase, now in after.items():
        n = now["calls"] - before.get(phase, {}).get("calls", 0)
        if n <= 0:
            continue
        took = sorted(now["last"][-n:])
        top = took[-longest:]
        out[f"{phase}_calls"] = n
        out[f"{phase}_median_us"] = statistics.median(took) * 1e6
        out[f"{phase}_p90_us"] = took[min(len(took) - 1, int(0.9 * len(took)))] * 1e6
        out[f"{phase}_max_us"] = took[-1] * 1e6
        out[f"{phase}_top{longest}_ms"] = sum(top) * 1e3
        out[f"{phase}_rest_ms"] = sum(took[:-longest]) * 1e3 if len(took) > longest else 0.0
    return out
