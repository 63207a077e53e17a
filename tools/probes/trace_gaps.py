"""Where a profiled vLLM run's GPU waited: torch profiler traces (Chrome trace JSON, as vLLM's profiler writes
them: bench/vllm_throughput.py --profile-dir) summed up, one line block per trace file.

    python tools/probes/trace_gaps.py DIR_OR_FILE [...] [--gap-us 20] [--top 8] [--step-span NAME] [--inside NAME]
                                      [--json F]

For each trace: the GPU's span (first kernel or copy to the last), its busy time (the union of kernels, copies and
memsets on every stream) and idle time, the idle gaps longer than --gap-us (count, total, the largest), copies to
the host (count, bytes where recorded, time), the kernels that took most time, and the CUDA runtime calls that
took most host time (a cudaHostAlloc, a synchronize or an event wait there is the host holding the GPU up),
the host spans by total time (record_function's: vLLM's own under VLLM_CUSTOM_SCOPES_FOR_PROFILING=1, the
plugin's "fragments: begin_step"/"end_step") and the step's period: the time from one --step-span's start to the
next (median, 90th percentile), the host's pace where the GPU waits on it.
--inside NAME (repeatable): each such host span's instances (count, total, median, 90th percentile, the longest:
one-off work such as a prefill's saves shows there, apart from the steady steps) and what ran inside them by self
time (torch ops, CUDA calls, nested spans, and Python functions where the trace has stacks: vLLM's profiler with
torch_profiler_with_stack, the bench's --profile-stack), summed over the instances.
Why: in run36 the saving column's rounds lost more time than the worker's measured host phases; the trace says
whether the GPU sat idle between steps, and behind what.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", data) if isinstance(data, dict) else data


def gaps_us(intervals) -> list:
    """The idle stretches between the union's pieces, in order (the span less all of them: the busy time)."""
    out, end = [], None
    for a, b in sorted(intervals):
        if end is not None and a > end:
            out.append(a - end)
        end = b if end is None else max(end, b)
    return out


def percentile(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def host_spans(events: list, step_span: str, top: int) -> dict:
    """record_function spans on the host by total time, and the period of `step_span` (start to next start)."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation" and "dur" in e]
    total, count = collections.Counter(), collections.Counter()
    for e in spans:
        total[e.get("name", "?")] += float(e["dur"])
        count[e.get("name", "?")] += 1
    out = {"host_spans_ms": [(name, t / 1e3, count[name]) for name, t in total.most_common(top)]}
    starts = sorted(float(e["ts"]) for e in spans if e.get("name") == step_span)
    periods = [b - a for a, b in zip(starts, starts[1:])]
    if periods:
        out.update(steps=len(starts), step_median_us=percentile(periods, 0.5), step_p90_us=percentile(periods, 0.9))
    return out


HOST_CATS = ("cpu_op", "python_function", "cuda_runtime", "user_annotation", "cuda_driver")


def self_times(events: list) -> list:
    """[(event, its self time in us, the names of the host spans it is nested in)] for host events: its duration
    less its direct children's on the same thread (events nest by time on one thread; a child sorts after its
    parent)."""
    threads = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATS and "dur" in e:
            threads[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for evs in threads.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack = []  # entries of the events enclosing the current one: [event, self time, enclosing spans]
        for e in evs:
            while stack and float(stack[-1][0]["ts"]) + float(stack[-1][0]["dur"]) <= float(e["ts"]):
                stack.pop()
            if stack:
                stack[-1][1] -= float(e["dur"])
            names = tuple(x[0].get("name") for x in stack if x[0].get("cat") == "user_annotation")
            entry = [e, float(e["dur"]), names]
            out.append(entry)
            stack.append(entry)
    return [(e, max(0.0, t), names) for e, t, names in out]


def inside(events: list, span: str, top: int, selfs_of=None) -> dict:
    """The host span `span`'s instances and what ran inside them by self time (module docstring, --inside);
    `selfs_of`: self_times(events) where the caller has it already (one pass over a trace for every span)."""
    own = sorted((float(e["dur"]), float(e["ts"])) for e in events if e.get("ph") == "X" and
                 e.get("cat") == "user_annotation" and e.get("name") == span and "dur" in e)
    if not own:
        return {"count": 0}
    durations = [d for d, _ in own]
    start = min(float(e["ts"]) for e in events if "ts" in e)
    selfs, calls = collections.Counter(), collections.Counter()
    for e, t, names in (self_times(events) if selfs_of is None else selfs_of):
        if e.get("name") == span and e.get("cat") == "user_annotation":
            selfs["(the span's own)"] += t
            calls["(the span's own)"] += 1
        elif span in names:
            name = e.get("name", "?")[:90]
            selfs[name] += t
            calls[name] += 1
    return {"count": len(own), "total_ms": sum(durations) / 1e3, "median_us": percentile(durations, 0.5),
            "p90_us": percentile(durations, 0.9),
            "longest": [(d, (ts - start) / 1e3) for d, ts in sorted(own, reverse=True)[:3]],
            "self_ms": [(name, t / 1e3, calls[name]) for name, t in selfs.most_common(top)]}


def summary(events: list, gap_us: float, top: int, step_span: str = "gpu_model_runner: preprocess",
            spans_inside=()) -> dict:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    out = {"gpu_events": len(gpu)}
    if spans:
        start, end = min(a for a, _ in spans), max(b for _, b in spans)
        idle = gaps_us(spans)
        busy = end - start - sum(idle)
        gaps = [g for g in idle if g > gap_us]
        out.update(span_ms=(end - start) / 1e3, busy_ms=busy / 1e3, idle_ms=(end - start - busy) / 1e3,
                   gaps=len(gaps), gaps_ms=sum(gaps) / 1e3, largest_gaps_us=sorted(gaps, reverse=True)[:top])
    to_host = [e for e in gpu if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    out["copies_to_host"] = len(to_host)
    out["copies_to_host_ms"] = sum(float(e["dur"]) for e in to_host) / 1e3
    out["copies_to_host_mb"] = sum(float(e.get("args", {}).get("bytes", 0)) for e in to_host) / 2**20
    kernels = collections.Counter()
    for e in gpu:
        if e.get("cat") == "kernel":
            kernels[e.get("name", "?")[:80]] += float(e["dur"])
    out["kernels_ms"] = [(name, t / 1e3) for name, t in kernels.most_common(top)]
    runtime = collections.Counter()
    calls = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "dur" in e:
            runtime[e.get("name", "?")] += float(e["dur"])
            calls[e.get("name", "?")] += 1
    out["runtime_ms"] = [(name, t / 1e3, calls[name]) for name, t in runtime.most_common(top)]
    out.update(host_spans(events, step_span, top))
    if spans_inside:
        entries = self_times(events)
        out["inside"] = {name: inside(events, name, top, entries) for name in spans_inside}
    return out


def traces(paths) -> list:
    found = []
    for p in paths:
        if os.path.isdir(p):
            found += sorted(glob.glob(os.path.join(p, "**", "*.json*"), recursive=True))
        else:
            found.append(p)
    return [f for f in found if f.endswith((".json", ".json.gz"))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--gap-us", type=float, default=20.0, help="idle stretches shorter than this are not counted")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--step-span", default="gpu_model_runner: preprocess",
                    help="the host span that starts once a step (its period is the step's pace)")
    ap.add_argument("--inside", action="append", default=[], metavar="NAME",
                    help="a host span whose instances and contents (by self time) are summed up; repeatable")
    ap.add_argument("--json", help="also write the summaries here")
    args = ap.parse_args(argv)
    files = traces(args.paths)
    if not files:
        print(f"trace_gaps: no trace files (*.json, *.json.gz) under {', '.join(args.paths)}", file=sys.stderr)
        return 1
    results = {}
    for f in files:
        try:
            s = summary(load(f), args.gap_us, args.top, args.step_span, args.inside)
        except (OSError, ValueError) as e:
            print(f"trace_gaps: {f}: not a trace ({e})", file=sys.stderr)
            return 1
        results[f] = s
        print(f"== {f}")
        if "span_ms" in s:
            print(f"GPU span {s['span_ms']:.1f} ms: busy {s['busy_ms']:.1f}, idle {s['idle_ms']:.1f} "
                  f"({s['idle_ms'] / max(s['span_ms'], 1e-9):.0%}); {s['gaps']} gaps over {args.gap_us:g} us, "
                  f"{s['gaps_ms']:.1f} ms; largest (us): {', '.join(f'{g:.0f}' for g in s['largest_gaps_us'])}")
        else:
            print("no GPU events (a CPU run): the host's calls only")
        print(f"copies to the host: {s['copies_to_host']}, {s['copies_to_host_mb']:.1f} MiB, "
              f"{s['copies_to_host_ms']:.2f} ms")
        for name, ms in s["kernels_ms"]:
            print(f"  kernel {ms:9.2f} ms  {name}")
        for name, ms, n in s["runtime_ms"]:
            print(f"  cuda   {ms:9.2f} ms  {n:6d}x  {name}")
        if "steps" in s:
            print(f"steps ({args.step_span!r}): {s['steps']}, a step every {s['step_median_us']:.0f} us "
                  f"(median; 90th percentile {s['step_p90_us']:.0f} us)")
        for name, ms, n in s["host_spans_ms"]:
            print(f"  host   {ms:9.2f} ms  {n:6d}x  {1e3 * ms / n:8.1f} us each  {name}")
        for name, d in s.get("inside", {}).items():
            if not d["count"]:
                print(f"inside {name!r}: no such span")
                continue
            longest = ", ".join(f"{us:.0f} us at {ms:.1f} ms" for us, ms in d["longest"])
            print(f"inside {name!r}: {d['count']}x, {d['total_ms']:.2f} ms; median {d['median_us']:.1f} us, "
                  f"90th percentile {d['p90_us']:.1f} us; longest {longest}")
            for inner, ms, n in d["self_ms"]:
                print(f"  self   {ms:9.2f} ms  {n:6d}x  {1e3 * ms / n:8.1f} us each  {inner}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
