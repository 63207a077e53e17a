"""vLLM's throughput with fragments' plugin against plain vLLM (and nnsight's VLLM), CPU, one run.

    python bench/vllm_throughput.py [--prompts 64 --prompt-len 32 --max-tokens 32 --rounds 6 --repeat 1]
                                    [--nnsight] [--chunked-prefill on|off] [--json bench/results/....json]

Load: vLLM's offline `LLM.generate` with all prompts at once (continuous batching over --prompts requests,
greedy, ignore_eos: every request makes exactly --max-tokens tokens); tokens/s = generated tokens / wall
time of generate (and, where plans save, of fetching the saves). A Llama written by transformers'
save_pretrained (hidden 512, 8 heads / 4 kv heads of 64, 4 layers, MLP 1536, vocab 4096; fp32), tp 1,
enforce_eager=True in every column (fragments' hooks need eager mode; plain vLLM runs eager too, so the
columns differ only by the plugin), chunked prefill as --chunked-prefill says in every engine. Columns:
  plain     vLLM without the plugin (no entry points on the path, FRAGMENTS_VLLM=0)
  none      the plugin loaded, no request with a plan
  quarter   the plugin loaded, every 4th request saving 4 locations at every step (layer 0's fused qkv
            output, layer 1's MLP down-projection input, layer 2's output, the final norm's output),
            saves fetched with fragments.vllm.take_saves
  nnsight   nnsight 0.8.1's VLLM (bench/nnsight_vllm_shim.py: its CPU worker), the same prompts as
            invokes of one trace: nothing saved (nnsight_none), and every 4th invoke saving the same 4
            locations at every step (nnsight_quarter; every value checked to come back)
--repeat N: each column's turn runs its requests N times back to back, timed as one (the issue's 64 prompts ×
128 tokens take ~0.6 s on an H100: a single run's noise is larger than the effects; run38).
Paired rotating rounds: each engine (plain, plugin, nnsight) starts once, in its own process, and stays;
after one warm-up run of every column, each of --rounds rounds runs every column once, in an order rotated
by one column per round, and takes each column's ratio to plain within the round. The report gives, per
column, the median of the per-round ratios with their spread (min–max, interquartile range), for tokens/s
(wall) and tokens per CPU second (user + system of the engine's processes: steadier than wall time on a
shared machine), beside the issue's goals (none ≥ 0.97×, quarter ≥ 0.85×), and writes every round to
--json (default bench/results/vllm_throughput_cpu.json).
--profile-dir DIR: after the rounds, one more run of plain, none and quarter each under vLLM's torch profiler
(not counted in the rounds), its traces in DIR/<column>, with vLLM's own host spans (preprocess, forward,
sample, ...) and the plugin's (begin_step, end_step) in every engine; tools/probes/trace_gaps.py DIR sums them up
(where the GPU sat idle, copies to the host, CUDA calls, host time a step by span). --profile-stack: with Python's
stacks (trace_gaps.py --inside "fragments: end_step" then names the Python functions inside a span).
--control: a second plain vLLM engine (column plain_b), run like plain: its ratio to plain is what two identical
engines differ by on this machine (where they sit, which started first), the floor under the none column's gap.
On a GPU it starts once plain is up, and loads the graphs plain compiled from vLLM's compile cache.
--deadline S: no round (or pass, or profiled run) starts that would end more than S seconds after the bench
started, judged by the longest round (and engine start) so far; the report covers the rounds done and says the
run was cut short. SIGTERM (a device call's `timeout`) ends the rounds alike, the report written, exit 143:
run40's 64 rounds outran a 570 s call (its engines took 229 s to start) and left a log but no JSON. --json is
also written after every round ("complete": false until the end): run41's call limit came while its engines
closed, after the last round and before the report.
"""
import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOCATIONS = ("model.layers.0.self_attn.qkv_proj.output", "model.layers.1.mlp.down_proj.input",
             "model.layers.2.output", "model.norm.output")


def write_model(folder, gpu=False, layers=8):
    """CPU: a small fp32 Llama with transformers' weights. GPU: an 8B-shaped Llama (hidden 4096, 32 heads / 8 kv
    heads, MLP 14336, vocab 32000) of `layers` layers in bfloat16, its config only: every engine loads vLLM's
    seeded random weights (load_format="dummy"), so no 4 GB checkpoint is written."""
    import torch
    import transformers
    torch.manual_seed(0)
    if gpu:
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, num_hidden_layers=layers,
                                       num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                                       max_position_embeddings=1024, torch_dtype="bfloat16")
        cfg.save_pretrained(folder)
    else:
        cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                       num_key_value_heads=4, intermediate_size=1536, max_position_embeddings=256,
                                       torch_dtype="float32")
        transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).save_pretrained(folder)
    # a word-level tokenizer (w0 … w4095): nnsight's VLLM loads one; prompts are token ids
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1",
                                         eos_token="w2").save_pretrained(folder)


def cpu_seconds(pid=None):
    """User + system CPU seconds of a process (default this one) and every process it started (vLLM's engine
    core and workers): a rate per CPU second is far less sensitive to other load on a shared machine than wall
    time."""
    import psutil
    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root] + root.children(recursive=True):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:  # a process that ended meanwhile
                pass
    except psutil.Error:
        pass
    return total


def timed(fn):
    """(wall seconds, CPU seconds) of fn()."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


def engine_settings(args, mode):
    """LLM(...) settings every engine shares, and the plugin's taps. CPU: eager engines (fragments' hooks; plain
    vLLM eager too), float32. GPU: vLLM's default CUDA graphs in every engine (FULL_AND_PIECEWISE), bfloat16,
    random weights, a quarter of the GPU each (the engines stay up side by side); the plugin's engine taps the
    four saved locations (compiled mode: docs/vllm.md)."""
    common = dict(tensor_parallel_size=1, max_model_len=args.prompt_len + args.max_tokens + 8,
                  enable_prefix_caching=False, max_num_seqs=args.prompts, seed=0,
                  enable_chunked_prefill=args.chunked_prefill == "on")
    if not args.gpu:
        return dict(common, enforce_eager=True, dtype="float32")
    common.update(enforce_eager=False, dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.25,
                  kv_cache_memory_bytes=8 << 30)  # fixed: engines starting side by side would profile each other
    if mode == "plugin":
        common["additional_config"] = {"fragments_taps": list(LOCATIONS)}
    return common


def with_profiler(settings, args, mode):
    """--profile-dir: vLLM's torch profiler in the engine (every step of a profiled run; no stacks unless
    --profile-stack: small traces), traces under <dir>/<mode>."""
    if not args.profile_dir:
        return settings
    return dict(settings, profiler_config={
        "profiler": "torch", "torch_profiler_dir": os.path.join(os.path.abspath(args.profile_dir), mode),
        "torch_profiler_with_stack": bool(args.profile_stack), "torch_profiler_dump_cuda_time_total": False})


def prompts(n, length):
    import random
    rng = random.Random(0)
    return [[rng.randrange(3, 4000) for _ in range(length)] for _ in range(n)]


def vllm_runner(args, mode):
    """The plain or plugin engine: returns run(column) -> (tokens/s, tokens per CPU s, values saved)."""
    from vllm import LLM, SamplingParams
    llm = LLM(args.model, **with_profiler(engine_settings(args, mode), args, mode))
    ps = [{"prompt_token_ids": p} for p in prompts(args.prompts, args.prompt_len)]
    sampling = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    tokens = args.prompts * args.max_tokens * args.repeat

    def generate(column):
        """Runs the column's requests; returns (values saved, the outputs)."""
        if column == "quarter":
            from fragments import vllm as fv
            plan = [{"at": loc, "do": "save", "as": loc, "step": "all"} for loc in LOCATIONS]
            outs = fv.generate(llm, ps, [plan if i % 4 == 0 else None for i in range(len(ps))], **sampling)
            assert all(o.fragments_error is None for o in outs)
            assert all(len(o.fragments) == 4 for o in outs[::4])
            saved = sum(len(o.fragments) for o in outs)
        else:
            if column not in ("plain", "plain_b", "none"):
                raise ValueError(f"column {column} is not run by a vLLM engine")
            outs = llm.generate(ps, SamplingParams(**sampling), use_tqdm=False)
            saved = 0
        assert sum(len(o.outputs[0].token_ids) for o in outs) == args.prompts * args.max_tokens
        return saved, outs

    def stats():
        return llm.collective_rpc("fragments_compile_stats")[0] or {}

    def where_time_went(column, before, after, outs):
        """A plugin column's run: the worker's host seconds by phase (and begin_step's and end_step's calls:
        median, 90th percentile, longest, the longest three's sum), its steps (and how many replayed a FULL
        graph); the saving column's also the front end's fetch of the saves (fv.timings) and their size; read
        outside the timed run."""
        from fragments import vllm as fv
        from fragments.vllm import _durations
        detail = {f"worker_{k}_s": v - before.get("host_s", {}).get(k, 0.0) for k, v in after.get("host_s", {}).items()}
        # begin_step's and end_step's calls in the run: a typical step's (median) apart from its longest three
        detail.update(_durations.between(before.get("step_s", {}), after.get("step_s", {})))
        detail.update({f"{k}_steps": v - before.get("steps", {}).get(k, 0) for k, v in after.get("steps", {}).items()})
        if column != "quarter":  # (the none column: what the plugin's worker does a step with no plan)
            return detail
        detail.update(fv.timings)
        detail["saved_mb"] = sum(t.numel() * t.element_size() for o in outs for t in o.fragments.values()) / 2**20
        detail["saved_rows"] = sorted({t.shape[0] for o in outs for t in o.fragments.values()})  # prompt + new - 1
        return detail

    def step_rate(column):
        """Batch-1 decode: one request, (t(1 + n new tokens) - t(1 new token)) / n per step (the prefill and the
        engine's per-request cost cancel); steps per second."""
        from fragments import vllm as fv
        plan = [{"at": loc, "do": "save", "as": loc, "step": "all"} for loc in LOCATIONS] \
            if column == "b1_quarter" else None

        def once(n):
            one = dict(sampling, max_tokens=n)
            if plan is None:
                return llm.generate(ps[:1], SamplingParams(**one), use_tqdm=False)
            out = fv.generate(llm, ps[:1], [plan], **one)
            assert out[0].fragments_error is None and len(out[0].fragments) == len(LOCATIONS)
            return out
        decode_s = 0.0
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            once(1)
            t1 = time.perf_counter()
            once(1 + args.max_tokens)
            t2 = time.perf_counter()
            decode_s += (t2 - t1) - (t1 - t0)
        return args.repeat * args.max_tokens / decode_s

    def run(column):
        if column.startswith("b1_"):
            rate = step_rate(column)
            return rate, rate, int(column == "b1_quarter") * len(LOCATIONS), {}
        before = stats() if column in DETAILED else None
        out = {}
        wall, cpu = timed(lambda: out.setdefault("runs", [generate(column) for _ in range(args.repeat)]))
        saved, outs = sum(n for n, _ in out["runs"]), [o for _, os_ in out["runs"] for o in os_]
        detail = {} if before is None else dict(where_time_went(column, before, stats(), outs), wall_s=wall)
        return tokens / wall, tokens / cpu, saved, detail

    def profiled(column):
        """One run of `column` under vLLM's profiler (--profile-dir; not a round: its rate is not reported)."""
        llm.start_profile(column)
        try:
            return run(column)
        finally:
            llm.stop_profile()
    run.profiled = profiled
    return run


def nnsight_runner(args):
    sys.path.insert(0, HERE)
    import nnsight
    from nnsight.modeling.vllm import VLLM
    settings = engine_settings(args, "nnsight")
    if args.gpu:  # nnsight's own GPU worker; CUDA graphs kept at its declared taps (vLLM's breakable graphs)
        settings.pop("enforce_eager")
        settings["taps"] = list(LOCATIONS)
    else:
        import nnsight_vllm_shim  # noqa: F401  (nnsight's VLLM on vLLM's CPU worker)
    model = VLLM(args.model, dispatch=True, **settings)
    from vllm.inputs import TokensPrompt
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(args.prompts, args.prompt_len)]
    tokens = args.prompts * args.max_tokens * args.repeat
    expected = (args.prompts + 3) // 4 * len(LOCATIONS) * args.max_tokens * args.repeat

    def envoy(loc):
        path, side = loc.rsplit(".", 1)
        e = model
        for part in path.split("."):
            e = e[int(part)] if part.isdigit() else getattr(e, part)
        return e, side

    def trace(column):
        with model.trace(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True) as tracer:
            # one dict above the invokes: each invoke (its own vLLM request, with its own copy) fills its key,
            # and nnsight merges the copies by key (nnsight/modeling/vllm/collect.py)
            bucket = nnsight.save({})
            for i, p in enumerate(ps):
                with tracer.invoke(p):
                    if column == "nnsight_quarter" and i % 4 == 0:
                        mine = []
                        for _ in tracer.iter[:args.max_tokens]:  # every forward: prefill, then each decode
                            for loc in LOCATIONS:
                                e, side = envoy(loc)
                                v = e.output if side == "output" else e.input
                                mine.append((v[0] if isinstance(v, tuple) else v).clone())
                        bucket[i] = mine
        return sum(len(v) for v in bucket.values())

    def run(column):
        out = {}
        wall, cpu = timed(lambda: out.setdefault("n", sum(trace(column) for _ in range(args.repeat))))
        if column == "nnsight_quarter" and out["n"] != expected:  # reported, not hidden: it saved nothing usable
            raise RuntimeError(f"nnsight_quarter: {out['n']} of {expected} values came back")
        return tokens / wall, tokens / cpu, out["n"], {}
    return run


PROTOCOL = "@@vllm_throughput "  # the child's answers on stdout (vLLM's own lines are skipped)


def child(args):
    """One engine kept for the whole benchmark: runs the columns the parent names on stdin, one a line."""
    t0 = time.time()
    run = nnsight_runner(args) if args.child == "nnsight" else vllm_runner(args, args.child)
    print(PROTOCOL + json.dumps({"ready": args.child, "start_s": time.time() - t0}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        rate, per_cpu, saved, detail = (run.profiled if command.get("profile") else run)(command["column"])
        print(PROTOCOL + json.dumps({"column": command["column"], "tokens_per_s": rate, "tokens_per_cpu_s": per_cpu,
                                     "saved": saved, "detail": detail}), flush=True)


class Engine:
    """A child process holding one engine (plain vLLM, vLLM with the plugin, nnsight's VLLM)."""

    def __init__(self, args, mode, site, log_dir):
        env = dict(os.environ)
        import glob  # the checkout's package where its extension is built beside it (else the PYTHONPATH one)
        own = [os.path.join(ROOT, "python")] if glob.glob(os.path.join(ROOT, "python", "fragments", "_C*.so")) else []
        paths = own + ([site] if mode == "plugin" else [])
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
        if mode != "plugin":
            env["FRAGMENTS_VLLM"] = "0"  # belt and braces: no entry points on its path either
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model", args.model, "--prompts",
               str(args.prompts), "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
               "--chunked-prefill", args.chunked_prefill, "--gpu", "on" if args.gpu else "off",
               "--repeat", str(args.repeat)] + \
            (["--profile-dir", os.path.abspath(args.profile_dir)] if args.profile_dir else []) + \
            (["--profile-stack"] if args.profile_stack else [])
        self.mode, self.log = mode, os.path.join(log_dir, f"{mode}.log")
        # its own process group: an engine stopped before it is ready goes with vLLM's engine core and workers
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "w"), text=True, start_new_session=True)
        self.start_s = None

    def ready(self):
        """Waits for the engine to be up (engines start side by side: on a GPU each compiles and captures its
        CUDA graphs for minutes)."""
        self.start_s = self._answer()["start_s"]
        print(f"{self.mode} engine ready in {self.start_s:.0f} s", flush=True)

    def cpu_seconds(self):
        """CPU seconds of this engine's processes (its child, vLLM's engine core, workers)."""
        return cpu_seconds(self.proc.pid)

    def _answer(self):
        for line in self.proc.stdout:
            if line.startswith(PROTOCOL):
                return json.loads(line[len(PROTOCOL):])
        with open(self.log) as f:
            sys.stderr.write(f.read()[-4000:])
        raise RuntimeError(f"the {self.mode} engine exited ({self.proc.wait()}); log {self.log}")

    def run(self, column, profile=False):
        self.proc.stdin.write(json.dumps({"column": column, "profile": profile}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def quit(self):
        """Asks a ready engine to quit (it reads the line once its run in hand ends), without waiting: the bench
        asks every engine first, then waits for each (close), so that their shutdowns overlap."""
        if self.start_s is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
        except OSError:
            pass

    def close(self):
        """Waits for a ready engine to quit; one not ready yet (the bench stopped while engines started) or not
        quitting in 120 s is stopped with its process group (vllm_check.stop_process_group: SIGTERM first, so
        that its shared memory is cleared)."""
        try:
            if self.start_s is None:
                raise OSError("not ready")
            self.quit()
            self.proc.wait(120)
        except (OSError, subprocess.TimeoutExpired):
            from vllm_check import stop_process_group  # tests/python/vllm_plugin, on the path since main()
            stop_process_group(self.proc)


OWNER = {"plain": "plain", "plain_b": "plain_b", "none": "plugin", "quarter": "plugin", "nnsight_none": "nnsight",
         "nnsight_quarter": "nnsight", "b1_plain": "plain", "b1_none": "plugin", "b1_quarter": "plugin"}
BASE = {"b1_plain": "b1_plain", "b1_none": "b1_plain", "b1_quarter": "b1_plain"}  # batch-1 columns: × plain's batch 1
DETAILED = ("none", "quarter")  # the plugin's columns: its worker's time by phase reported each run
TWIN = {"plain_b": "plain", "plain": "plain_b"}  # engines of the same settings (run_pass starts the later one last)
GOALS = {"none": 0.97, "quarter": 0.85}  # issue 27: × plain vLLM's tokens/s
GOALS_GPU = {"none": 0.98, "quarter": 0.90, "b1_none": 0.98}  # issue 39, CUDA graphs on in every engine


def spread(values):
    """(median, min, max, interquartile range or None: fewer than 3 rounds) of one column's per-round ratios."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) >= 3 else None
    return statistics.median(values), min(values), max(values), (q[2] - q[0]) if q else None


def run_settled(engines, column, settle):
    """One column's run, then `settle` seconds of nothing. vLLM's workers and engine core read their shared-
    memory queues in a sched_yield loop for busy_loop_s = 1 s after their last read (vllm/distributed/
    device_communicators/shm_broadcast.py, SpinCondition): an engine that has just finished burns up to a core
    for that second (measured 0.9 CPU s here), which on a 2-core machine lands on whichever engine runs next.
    Without the pause, a column that follows another engine's column is slowed and one that follows its own
    engine's is not; plain vLLM, alone in its engine, always followed another engine, and the plugin's columns
    looked faster than plain (s37's unexplained 1.17x). `others_cpu_s`, the other engines' CPU seconds during
    the run, shows that nothing else ran."""
    owner = engines[OWNER[column]]
    others = [e for e in engines.values() if e is not owner]
    before = sum(e.cpu_seconds() for e in others)
    row = owner.run(column)
    row["others_cpu_s"] = sum(e.cpu_seconds() for e in others) - before
    time.sleep(settle)
    return row


class Stopped(Exception):
    """SIGTERM while the rounds run: the rounds so far are reported (module docstring)."""


def stop_on_sigterm():
    """SIGTERM raises Stopped in the main thread, once (a second one while the engines close is ignored)."""
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Stopped("SIGTERM")
    signal.signal(signal.SIGTERM, handler)


class Deadline:
    """--deadline: whether another round (or pass) fits, judged by the longest seen so far; `cut`: why the
    rounds stopped early (None while they did not: the deadline, or SIGTERM)."""

    def __init__(self, seconds, clock=time.monotonic):
        self.seconds, self.clock, self.start, self.cut = seconds, clock, clock(), None
        self.longest = {}  # what -> its longest duration seen
        self.signalled = False  # the rounds stopped by SIGTERM (exit 143), not by the deadline

    def timed(self, what, fn):
        t0 = self.clock()
        try:
            return fn()
        finally:
            self.longest[what] = max(self.longest.get(what, 0.0), self.clock() - t0)

    def allows(self, *whats) -> bool:
        """Whether `whats` (each as long as its longest so far) would end within the deadline; notes the cut."""
        if self.seconds is None or self.cut is not None:
            return self.cut is None
        left = self.seconds - (self.clock() - self.start)
        need = sum(self.longest.get(w, 0.0) for w in whats)
        if need > left:
            self.cut = f"--deadline {self.seconds:g} s: {left:.0f} s left, the next {' and '.join(whats)} " \
                       f"would take ~{need:.0f} s"
        return self.cut is None


def run_pass(args, columns, started, site, work, start_s, index, rounds, deadline, engine=None, on_round=None):
    """One pass: the engines started in `started`'s order and kept; a warm-up of every column, then
    --rounds rounds, every column once per round in an order rotated by one each round (no column always
    runs first or after the same neighbour), ratios to plain taken within the round (a slow spell of the
    machine lands on a round's columns alike). Rounds are appended to `rounds` as they end, so that a pass
    cut short by `deadline` leaves the ones done, and `on_round()` follows each (main: the report so far written);
    on SIGTERM (Stopped) the engines close and Stopped goes on to run_passes. `engine`: makes an engine (Engine;
    a test's fake)."""
    engine = engine or Engine
    engines = {}
    try:
        # An engine whose twin starts before it starts last, once the twin is up: it loads the graphs the twin
        # compiled from vLLM's cache instead of compiling them beside it (a fresh GPU machine's engines took
        # 229 s to compile in run40); the others start side by side meanwhile.
        later = [m for i, m in enumerate(started) if TWIN.get(m) in started[:i]]
        for mode in [m for m in started if m not in later] + later:
            if mode in later and engines[TWIN[mode]].start_s is None:
                engines[TWIN[mode]].ready()
            engines[mode] = engine(args, mode, site, work)
            if not args.gpu:  # one engine starting at a time on 2 cores
                engines[mode].ready()
        for mode in started:
            if engines[mode].start_s is None:
                engines[mode].ready()
            start_s.setdefault(mode, []).append(engines[mode].start_s)
        for c in columns:  # warm-up
            engines[OWNER[c]].run(c)
            time.sleep(args.settle)
        for r in range(args.rounds):
            if not deadline.allows("round"):
                break
            order = columns[r % len(columns):] + columns[:r % len(columns)]
            rows = deadline.timed("round", lambda: {c: run_settled(engines, c, args.settle) for c in order})
            ratio = {c: rows[c]["tokens_per_s"] / rows[BASE.get(c, "plain")]["tokens_per_s"] for c in columns}
            ratio_cpu = {c: rows[c]["tokens_per_cpu_s"] / rows[BASE.get(c, "plain")]["tokens_per_cpu_s"]
                         for c in columns}
            rounds.append({"pass": index, "started": started, "order": order, "rows": rows, "ratio": ratio,
                           "ratio_per_cpu_s": ratio_cpu, "load": os.getloadavg()[0]})
            print(f"round {r + 1}/{args.rounds} ({' '.join(order)}): " +
                  ", ".join(f"{c} {ratio[c]:.3f}" for c in columns if c != "plain") +
                  f" × plain ({rows['plain']['tokens_per_s']:.0f} tokens/s); load {rounds[-1]['load']:.1f}; "
                  f"other engines' CPU during a run ≤ {max(x['others_cpu_s'] for x in rows.values()):.2f} s",
                  flush=True)
            for c in [c for c in DETAILED if rows.get(c, {}).get("detail")]:  # where the plugin's worker spent
                print(f"  {c}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, (int, float)) else f"{k} {v}"
                                             for k, v in sorted(rows[c]["detail"].items())), flush=True)
            if on_round is not None:
                on_round()
        if args.profile_dir and deadline.allows("round", "round"):  # after the rounds: one profiled run of each
            # vLLM column (a profiled run takes several times a plain one), traces kept
            for c in [c for c in columns if c in ("plain", "plain_b", "none", "quarter")]:
                traces = os.path.join(args.profile_dir, OWNER[c])
                before = set(os.listdir(traces)) if os.path.isdir(traces) else set()
                engines[OWNER[c]].run(c, profile=True)
                os.makedirs(os.path.join(args.profile_dir, c), exist_ok=True)
                for name in sorted(set(os.listdir(traces)) - before):  # the run's own files, under its column
                    if ".trace." in name:
                        os.replace(os.path.join(traces, name), os.path.join(args.profile_dir, c, name))
                print(f"profiled {c}: traces in {os.path.join(args.profile_dir, c)}", flush=True)
    finally:
        for e in engines.values():  # every engine asked first: their shutdowns overlap (run41: the call's limit
            e.quit()                # came while the engines closed one after another)
        for e in engines.values():
            e.close()


def run_passes(args, columns, site, work, rounds, start_s, deadline, engine=None, on_round=None):
    """--start-orders passes (run_pass), each starting the engines in another rotation, while the deadline
    allows; SIGTERM (stop_on_sigterm) ends them, the engines closed, noted in `deadline`."""
    modes = list(dict.fromkeys(OWNER[c] for c in columns))
    try:
        for p in range(args.start_orders):
            if p:  # another pass starts its engines again: as long as the slowest start so far, and a round
                deadline.longest["engine start"] = max(max(v) for v in start_s.values())
                if not deadline.allows("engine start", "round"):
                    break
            started = modes[p % len(modes):] + modes[:p % len(modes)]
            print(f"pass {p + 1}/{args.start_orders}: engines started {', '.join(started)}", flush=True)
            run_pass(args, columns, started, site, work, start_s, p, rounds, deadline, engine, on_round)
    except Stopped as e:
        deadline.cut, deadline.signalled = f"{e} after {len(rounds)} round(s)", True


def balanced(rounds, column, key):
    """The geometric mean over passes of each pass's median ratio: the start order's effect cancels."""
    medians = [statistics.median(r[key][column] for r in rounds if r["pass"] == p)
               for p in sorted({r["pass"] for r in rounds})]
    return statistics.geometric_mean(medians), medians


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6, help="rounds per pass")
    ap.add_argument("--repeat", type=int, default=1,
                    help="each column's turn in a round runs its requests this many times back to back, timed as "
                         "one (batch 1: its decode this many times): less noise per round (run38: a 0.6 s run on "
                         "the H100 varied by 16%%, more than the effects measured)")
    ap.add_argument("--start-orders", type=int, default=2,
                    help="passes, each starting the engines in another rotation (3 with --nnsight: each engine "
                         "first once)")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds between column runs: > vLLM's 1 s busy loop of an engine that has just run "
                         "(run_settled); 0 shows the interference")
    ap.add_argument("--nnsight", action="store_true")
    ap.add_argument("--chunked-prefill", choices=("on", "off"), default="on",
                    help="every engine alike; nnsight's VLLM defaults to off (a traced prompt prefills in one "
                         "forward): use off for like-for-like with the nnsight columns")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "vllm_throughput_cpu.json"))
    ap.add_argument("--gpu", choices=("auto", "on", "off"), default="auto",
                    help="on: the GPU settings (engine_settings, write_model); auto: on where vLLM's platform is CUDA")
    ap.add_argument("--layers", type=int, default=8, help="GPU: the 8B-shaped model's layers")
    ap.add_argument("--batch1", action="store_true", help="also batch-1 decode per step (b1_* columns)")
    ap.add_argument("--profile-dir", help="after the rounds, one run of plain, none and quarter under vLLM's torch "
                    "profiler, traces here (summed up by tools/probes/trace_gaps.py)")
    ap.add_argument("--profile-stack", action="store_true",
                    help="--profile-dir with Python's stacks: the traces hold every Python function's time "
                    "(trace_gaps.py --inside sums a span's by self time); larger traces, slower profiled runs")
    ap.add_argument("--control", action="store_true",
                    help="a second plain vLLM engine, column plain_b: what two identical engines differ by")
    ap.add_argument("--deadline", type=float,
                    help="seconds: no round, pass or profiled run starts that would end later (the report covers "
                         "the rounds done)")
    ap.add_argument("--child")
    ap.add_argument("--model")
    args = ap.parse_args()
    if args.gpu == "auto":
        sys.path.insert(0, os.path.join(ROOT, "tests", "python", "vllm_plugin"))
        import engine_env
        args.gpu = "on" if engine_env.GPU else "off"
    args.gpu = args.gpu == "on"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max((os.cpu_count() or 1) - 1, 0)}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.profile_dir:  # vLLM's own spans (preprocess, forward, sample, ...) in every engine's trace, beside
        os.environ.setdefault("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")  # the plugin's (same cost in each column)
    if args.child:
        return child(args)
    if args.rounds < 1 or args.start_orders < 1 or args.repeat < 1:
        ap.error("--rounds, --start-orders and --repeat must be at least 1")

    sys.path.insert(0, os.path.join(ROOT, "tests", "python", "vllm_plugin"))
    from vllm_check import plugin_dist, remove_work, work_folder
    work = work_folder("frag-vllm-bench-")  # removed at the end or at exit (a failed engine)
    args.model = os.path.join(work, "model")
    write_model(args.model, args.gpu, args.layers)
    site = plugin_dist(os.path.join(work, "site"))
    columns = ["plain"] + (["plain_b"] if args.control else []) + ["none", "quarter"] + \
        (["nnsight_none", "nnsight_quarter"] if args.nnsight else []) + \
        (["b1_plain", "b1_none", "b1_quarter"] if args.batch1 else [])
    load_before = os.getloadavg()
    rounds, start_s = [], {}
    # Each pass starts the engines in another rotation and the headline is the geometric mean of the passes'
    # median ratios, so no engine is always the first started (s37 saw start order move the ratios; the
    # interference run_settled takes out explained most of it, bench/README.md).
    deadline = Deadline(args.deadline)
    if args.gpu:
        device_name()  # asked before the engines start, not between two rounds (CUDA's start in this process)

    def on_round():  # the report so far, after every round: whatever ends the bench later (a device call's limit
        # while the engines close: run41) leaves the rounds done in --json ("complete": false until the end)
        write_report(args.json, dict(summarize(args, columns, rounds, start_s, load_before, deadline.cut,
                                               show=False), complete=False))
    stop_on_sigterm()
    run_passes(args, columns, site, work, rounds, start_s, deadline, on_round=on_round)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 143 if deadline.signalled else 0
    if not rounds:
        print(f"vllm_throughput: no round ran ({deadline.cut}); nothing written", file=sys.stderr)
        remove_work()
        return code or 1
    report = summarize(args, columns, rounds, start_s, load_before, deadline.cut)
    write_report(args.json, dict(report, complete=True))
    print(f"wrote {args.json}")
    remove_work()
    return code


@functools.lru_cache(maxsize=None)
def device_name():
    """The GPU's name, asked once (the report is written after every round)."""
    import torch
    return torch.cuda.get_device_name(0)


def write_report(path, report):
    """The report as JSON, whole or not at all: written beside `path`, then renamed over it (the bench may be
    killed while it writes)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    part = path + ".part"
    with open(part, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(part, path)


def summarize(args, columns, rounds, start_s, load_before, cut, show=True):
    """The report of the rounds done (printed as a table where `show`, returned for --json); `cut`: why they
    stopped early."""
    summary = {}
    for c in columns:
        med, lo, hi, iqr = spread([r["ratio"][c] for r in rounds])
        cmed, clo, chi, ciqr = spread([r["ratio_per_cpu_s"][c] for r in rounds])
        bal, per_pass = balanced(rounds, c, "ratio")
        cbal, _ = balanced(rounds, c, "ratio_per_cpu_s")
        summary[c] = {"others_cpu_s_max": max(r["rows"][c]["others_cpu_s"] for r in rounds),
                      "median_tokens_per_s": statistics.median(r["rows"][c]["tokens_per_s"] for r in rounds),
                      "ratio_balanced": bal, "ratio_median_per_pass": per_pass, "ratio_per_cpu_s_balanced": cbal,
                      "ratio_median": med, "ratio_min": lo, "ratio_max": hi, "ratio_iqr": iqr,
                      "ratio_per_cpu_s_median": cmed, "ratio_per_cpu_s_min": clo, "ratio_per_cpu_s_max": chi,
                      "ratio_per_cpu_s_iqr": ciqr, "goal": (GOALS_GPU if args.gpu else GOALS).get(c)}
        details = [r["rows"][c].get("detail") or {} for r in rounds]
        numeric = [k for k in details[0] if all(isinstance(d.get(k), (int, float)) for d in details)]
        if numeric:  # the plugin's worker a run, the rounds' median of each figure (--json has every round's)
            summary[c]["detail_median"] = {k: statistics.median(d[k] for d in details) for k in numeric}
    device = device_name() if args.gpu else "cpu"
    report = {"settings": {k: getattr(args, k) for k in ("prompts", "prompt_len", "max_tokens", "rounds", "repeat",
                                                         "start_orders", "chunked_prefill", "settle", "gpu",
                                                         "layers")},
              "device": device,
              "engine_start_s": start_s,
              "load_before": load_before, "load_after": os.getloadavg(), "summary": summary, "rounds": rounds,
              "cut_short": cut, "rounds_done": len(rounds)}
    if not show:
        return report
    passes = len({r["pass"] for r in rounds})
    print(f"\n{passes} pass(es) of {args.rounds} paired rounds (ratios to plain taken within each "
          "round; balanced: geometric mean of the passes' medians; then all rounds' median [min–max], IQR):")
    print("| column | median tokens/s | × plain, balanced (per pass) | × plain (wall) | spread | IQR | "
          "× plain (per CPU s) | spread | goal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c, v in summary.items():
        iqr = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
        passes = ", ".join(f"{m:.3f}" for m in v["ratio_median_per_pass"])
        print(f"| {c} | {v['median_tokens_per_s']:.1f} | **{v['ratio_balanced']:.3f}** ({passes}) | "
              f"{v['ratio_median']:.3f} | {v['ratio_min']:.3f}–"
              f"{v['ratio_max']:.3f} | {iqr(v['ratio_iqr'])} | {v['ratio_per_cpu_s_median']:.3f} | "
              f"{v['ratio_per_cpu_s_min']:.3f}–{v['ratio_per_cpu_s_max']:.3f} | "
              f"{'≥ %.2f' % v['goal'] if v['goal'] else ''} |")
    print(f"load average before {load_before[0]:.1f}, after {report['load_after'][0]:.1f}")
    if "plain_b" in summary:
        print(f"control: a second plain engine reads {summary['plain_b']['ratio_median']:.3f} x plain (IQR "
              f"{summary['plain_b']['ratio_iqr'] or 0:.3f}): what two identical engines differ by here")
    for c in [c for c in DETAILED if "detail_median" in summary.get(c, {})]:
        print(f"{c}, the worker a run (rounds' medians): " + ", ".join(
            f"{k} {v:.3g}" for k, v in sorted(summary[c]["detail_median"].items())))
    if cut:
        print(f"cut short: {len(rounds)} of {args.rounds * args.start_orders} rounds ({cut})")
    return report


if __name__ == "__main__":
    sys.exit(main())
