"""The vLLM worker's host work per decode step and per take, without vLLM or a GPU: a WorkerState with a fake
runner view, `rows` requests decoding one token each, every `every`-th saving LOCATIONS at every step (the
throughput benchmark's "quarter" column), the tapped values in FULL-graph slots. Prints ms per step (the
worker's begin_step and end_step, as vLLM calls them around a FULL graph's replay: plans checked, the slots
drained, the rows on their way to their files; bench/vllm_throughput.py's worker_begin_step_s + worker_end_step_s)
and the take of every saving request.

    python tools/probes/vllm_step_cost.py [--rows 256] [--every 4] [--steps 128] [--dtype bfloat16] [--memory]

--memory keeps rows in memory until the take (FRAGMENTS_VLLM_ROWS_IN_SHM=0, the way before row files);
--unsteady works every step out afresh (the worker before _steady.py: the runner's rows, every plan step of every
row, each location's rows and saving requests); rows always go through _C.RowSink, whose thread writes them.
--as-gpu: on the CPU, the GPU's path (copies asynchronous, blocks released at the next step once the step's
event is done), minus the CUDA calls. Here, 64 requests, 16 saving: 0.72 ms a step (0.96 ms --unsteady), of
which the data's own gathers and copies (CPU index_select and clone of 1.7 MB) are most; with --width 8 (the
data out of it) 0.14 ms a step, 0.35 ms --unsteady. Before run34 (rows reserved in Python and written by
the stepping thread): 1.06-1.09 ms a step here, 1.47 ms on the H100's host with the CUDA calls (run33).
Since run35, --warmup steps (16) run untimed first: run35's H100 figures (1.90 ms; 1.09 ms at --width 8)
counted one-time costs (the first pinned blocks, CUDA's lazy setup, the sink's files) in 128 timed steps.
With warm-up, here: 0.53 ms a step at full width, 0.09 ms at --width 8. On the H100's host (run36): 0.41 ms
(0.32 at --width 8); with a step's saves drained in one block (_drain.py) 0.28 ms (0.18), of which the one
pinned block from torch's allocator was 94 us. Run37 (the drain's own pool): 0.27 ms (0.15). Since run37 a step
is the worker's whole begin_step and end_step (before: the drain and the flush alone), and the drain sends 8 steps
at once: here at --width 8 --steps 2048, 0.105-0.159 ms a step before, 0.041-0.048 ms after (3 runs each). On
the H100's host (run38, --width 8): run37's code 0.147 ms, 8 steps to a block 0.094, and with one gather a step
for every location (_C.gather_rows, one kernel launch) 0.049.
--every 0: no request saves (the bench's none column): 0.003 ms a step here (run39's profile, with Python's stacks
inflating every call, had put 70 us of begin_step there). Every run checks the first and last saving requests'
rows against the slots' rows. It also prints each begin_step and end_step call's median, 90th percentile and
longest (_durations.py, as the bench's detail): here at --width 8 --as-gpu, end_step's median 10 us and 90th
percentile 97 us, the latter the steps that send a block on (one in STEPS).
"""
import argparse
import collections
import os
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(ROOT, "python"))  # after PYTHONPATH (the GPU machine: the built package)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fragments.vllm import _delivery, _durations, _plan, _rowqueue, _runner, _saves, _worker  # noqa: E402

WIDTHS = {"model.layers.0.self_attn.qkv_proj.output": 6144, "model.layers.1.mlp.down_proj.input": 14336,
          "model.layers.2.output": 4096, "model.norm.output": 4096}


class _SaveStep:
    def __init__(self, at):
        self.at, self.do, self.as_, self.index, self.value, self.by = at, "save", at, None, None, None


class _View:
    """The runner's batch: n requests decoding, its arrays kept and changed in place as vLLM's are."""
    def __init__(self, n):
        self.n, self.graph = n, "FULL"
        self.req_ids = [f"r{i}" for i in range(n)]
        self.qsl = np.arange(n + 1, dtype=np.int32)
        self.computed_np = np.full(n, 128, dtype=np.int32)

    @property
    def computed(self):
        return int(self.computed_np[0])

    @computed.setter
    def computed(self, value):
        self.computed_np[:] = value

    def rows(self):
        return [_runner.Row(r, i, i, i + 1, int(self.computed_np[i]), 128) for i, r in enumerate(self.req_ids)]

    def batch_arrays(self):
        return self.req_ids, self.qsl, self.computed_np

    def begin_step(self):
        pass


def state(rows, every, dtype, device, folder):
    s = _worker.WorkerState.__new__(_worker.WorkerState)
    s.view, s.device, s.rank, s.pp, s.stage, s.stage_of = _View(rows), torch.device(device), 0, None, 0, {}
    s.fragmented, s.rules, s.leading_batch, s.copies = {}, {}, False, _rowqueue.HostCopies(torch.device(device))
    s.saves = _saves.SavesStore(copy=s.copies.copy, wait=s.copies.wait, folder=folder)
    s.saves.max_bytes = s.saves.request_bytes = 1 << 40
    s.answers, s.plans, s.last_rows, s.steady, s.draining = _delivery.Folder(), {}, (None, None), None, None
    s.live_plans = None
    for i in range(rows):
        if every and i % every == 0:
            steps = [_plan.Scheduled(_SaveStep(at), "all", False) for at in WIDTHS]
            s.plans[f"r{i}"] = _plan.RequestPlan(f"k{i}", steps, None)
            s.saves.open(f"k{i}")
        else:
            s.plans[f"r{i}"] = None
    s.taps = list(WIDTHS)
    s.slots = {at: torch.randn(512, w, device=device).to(dtype) for at, w in WIDTHS.items()}
    s.tap_calls, s.host_s, s.step_counts = collections.Counter(), collections.Counter(), collections.Counter()
    s.durations = _durations.StepDurations()
    s.in_step, s.executing, s.logits_done = True, True, set()
    # what begin_step and end_step read: a compiled engine with taps in slots, its FULL graph replayed each step
    s.compiled, s.graphs, s.hooks, s._failed, s.py_forward, s.forwards = True, "slots", {}, False, 0, 0
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--every", type=int, default=4, help="every N-th request saves; 0: none does (the bench's none "
                    "column: the plugin's cost a step with no plan)")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=16, help="steps run before the timed ones (not timed): the first "
                    "pinned blocks, CUDA's lazy setup, the sink's files")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true", help="cProfile the steps: the 15 costliest functions")
    ap.add_argument("--bytes", action="store_true", help="answers as bytes (the caller on another machine)")
    ap.add_argument("--memory", action="store_true", help="rows kept in memory until the take, not in files")
    ap.add_argument("--width", type=int, help="every location this wide (8: the data's own copies out of the time)")
    ap.add_argument("--unsteady", action="store_true", help="work the step out afresh every step (_steady.py off)")
    ap.add_argument("--as-gpu", action="store_true", help="on the CPU, the GPU's path: every copy asynchronous, "
                    "its rows queued until the step's (here: done) event, written at the next step")
    args = ap.parse_args()
    if args.width:
        global WIDTHS
        WIDTHS = dict.fromkeys(WIDTHS, args.width)
    folder = None if args.memory else _delivery.rows_folder()
    s = state(args.rows, args.every, getattr(torch, args.dtype), args.device, folder)
    if args.as_gpu:
        _rowqueue.SimulatedDeviceCopies().attach(s)
    scheduled = types.SimpleNamespace(finished_req_ids=(), scheduled_new_reqs=(),
                                      num_scheduled_tokens=dict.fromkeys(s.view.req_ids, 1))

    def step(n):  # the worker's part of a decode step: begin_step before vLLM's forward, end_step after it
        s.view.computed = 128 + n
        if args.unsteady:
            s.steady = None
        s.begin_step(scheduled)
        s.end_step()

    t_first = None  # the batch's first step: its work worked out, each location's share and the drain made
    for n in range(args.warmup):
        t = time.perf_counter()
        step(n)
        if n == 0:
            t_first = time.perf_counter() - t
    if args.device == "cuda":
        torch.cuda.synchronize()
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    before = s.durations.report()
    t0 = time.perf_counter()
    for n in range(args.warmup, args.warmup + args.steps):
        step(n)
    t_host = time.perf_counter() - t0  # the stepping thread's time: what vLLM's loop waits for
    calls = _durations.between(before, s.durations.report())  # each call's, as the bench's detail has them
    if args.device == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    if prof is not None:
        import pstats
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    keys = {p.key: None for p in s.plans.values() if p is not None}
    out = s.take_saves(keys, None if args.bytes else _delivery.route())
    read = {k: _delivery.tensors(v) for k, v in out.items()}
    t2 = time.perf_counter()
    assert all(len(r) == len(WIDTHS) for r in read.values())
    for i in ((0, args.every * (len(keys) - 1)) if keys else ()):  # the first and last saving requests: each step's row
        for at, got in read[f"k{i}"].items():
            want = s.slots[at][i].cpu().expand(args.warmup + args.steps, -1)
            assert torch.equal(got, want), f"request {i} at {at}: saved rows differ from the slot's row"
    mb = sum(v["bytes"] for v in out.values()) / 2**20
    where = "memory" if folder is None else f"files in {folder}" + (", work afresh each step" if args.unsteady else "")
    print(f"vllm_step_cost ({args.device}, rows in {where}): {args.rows} rows, {len(keys)} saving {len(WIDTHS)} locations: "
          f"{t_host / args.steps * 1e3:.3f} ms per step on the stepping thread ({(t1 - t0) / args.steps * 1e3:.3f} with "
          f"the device's queue drained; {args.warmup} warm-up steps untimed), take and read {t2 - t1:.3f} s for {mb:.0f} MiB "
          f"({mb / max(t2 - t1, 1e-9):.0f} MiB/s)" + ("" if t_first is None else f"; the batch's first step {t_first * 1e3:.2f} ms"))
    print("  each call (us): " + ", ".join(f"{p} median {calls[p + '_median_us']:.1f} p90 {calls[p + '_p90_us']:.1f} "
                                         f"max {calls[p + '_max_us']:.0f}" for p in ("begin_step", "end_step")))


if __name__ == "__main__":
    main()
