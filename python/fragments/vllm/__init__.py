"""fragments inside vLLM: whole values at vLLM's real tensor-parallel layers, per-request plans.

Installed as vLLM plugins by the package (pyproject.toml):
  vllm.general_plugins  fragments = fragments.vllm:register            (every process: engine and workers)
(plans are checked at submission in the front end: validate_request, through vLLM's input processor)
In `vllm serve`, plans come in the request body and saves go back in the response (_server.py).
Eager engines (enforce_eager=True) act through module hooks; compiled engines at the locations tapped at start
(LLM(..., additional_config={"fragments_taps": [globs]}), fragments/vllm/_tap.py). docs/vllm.md: the data flow.

    from fragments import vllm as fv
    llm = LLM(model_dir, tensor_parallel_size=2, enforce_eager=True)
    outs = fv.generate(llm, ["The capital of France is"], [plan], max_tokens=4, temperature=0)
    outs[0].outputs[0].text, outs[0].fragments["qkv"]      # saves: name -> tensor (rows of every step run)
    fv.inspect(llm)["fragmented"]                          # location -> rule, without running a forward
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence

from . import _vllm_api
from ._plan import EXTRA_KEY, RequestPlan

__all__ = ["register", "validate_request", "sampling_params", "generate", "take_saves", "inspect",
           "EXTRA_KEY", "Refused", "VLLM"]


def __getattr__(name):
    if name == "VLLM":  # tracing in nnsight's manner (fragments/vllm/_trace.py); imported when asked for
        from ._trace import VLLM
        return VLLM
    raise AttributeError(name)


def register() -> None:
    """vLLM's general plugin entry point: runs in every vLLM process, before workers are built. It gives the
    processes a shared state folder (the workers write the model's locations there for the front end's
    plan checks) and wraps the model runners (fragments/vllm/_worker.py). Safe to call more than once."""
    if os.environ.get("FRAGMENTS_VLLM", "1") == "0":
        return
    _vllm_api.check(first_process="FRAGMENTS_VLLM_DIR" not in os.environ)  # the tested range; needed internals
    if "FRAGMENTS_VLLM_DIR" not in os.environ:  # the first process; spawned workers inherit it
        os.environ["FRAGMENTS_VLLM_DIR"] = tempfile.mkdtemp(prefix="fragments-vllm-")
        _cpu_defaults()
    from . import _install, _saves, _server
    _install.install()
    _saves.install_rpc()
    _server.install_into_api_server()  # only in `vllm serve`'s API server process


def _cpu_defaults() -> None:
    """vLLM's CPU build stops at engine start, with a traceback, on two settings a new user does not know:
    its workers bind to one NUMA node each (a machine with one node serves only tensor_parallel_size 1), and it
    reserves --gpu-memory-utilization (0.9) of the node's memory, which a busy machine does not have. Where the
    user left them unset, the first process (its children inherit the environment) sets what lets vLLM start
    and says so in one line; docs/vllm.md "Install" names both."""
    if os.environ.get("FRAGMENTS_VLLM_CPU_DEFAULTS", "1") == "0":
        return
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cpu():
            return
    except Exception:  # noqa: B902 - no platform: not our decision to make
        return
    notes = []
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and "VLLM_CPU_SIM_MULTI_NUMA" not in os.environ \
            and _numa_nodes() <= 1:
        os.environ["VLLM_CPU_SIM_MULTI_NUMA"] = "1"  # workers split the one node's cores among themselves
        notes.append("one NUMA node: tensor-parallel workers share its cores (VLLM_CPU_SIM_MULTI_NUMA=1; "
                     "VLLM_CPU_OMP_THREADS_BIND, e.g. '0-3|4-7', chooses them)")
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        total, available = _memory_gib()
        if available < 0.9 * total:
            space = max(1, int(available // 4))
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(space)
            notes.append(f"{available:.1f} of {total:.1f} GiB free, less than vLLM's default reservation (0.9): "
                         f"KV cache {space} GiB (VLLM_CPU_KVCACHE_SPACE chooses it)")
    if notes:
        print("fragments: vLLM CPU build: " + "; ".join(notes) + " (FRAGMENTS_VLLM_CPU_DEFAULTS=0: leave vLLM's "
              "defaults)", file=sys.stderr, flush=True)


def _numa_nodes() -> int:
    try:
        return max(1, len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")]))
    except OSError:
        return 1


def _memory_gib():
    """(total, available) GiB from /proc/meminfo (Linux; vLLM's CPU build runs there)."""
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                values[name] = int(rest.split()[0]) / (1 << 20)
    except (OSError, ValueError, IndexError):
        return 1.0, 1.0
    return values.get("MemTotal", 1.0), values.get("MemAvailable", values.get("MemTotal", 1.0))


def _model_record() -> Optional[dict]:
    directory = os.environ.get("FRAGMENTS_VLLM_DIR")
    if not directory:
        return None
    try:
        with open(os.path.join(directory, "model.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


_ValidationError = _vllm_api.ValidationError  # vLLM's VLLMValidationError, and a ValueError in every release


def validate_request(sampling_params) -> None:
    """Checks a request's plan when it is submitted, in vLLM's front end (_install.py wraps vLLM's input
    processor's parameter check): a ValueError (vLLM's VLLMValidationError) fails that request alone (LLM raises
    it, the OpenAI server answers 400 and keeps the connection) before any worker sees it. In `vllm serve` it
    also refuses a plan that did not pass fragments' middleware. (Not a logits-processor plugin: in vLLM 0.24 any
    entry point of that group turns Model Runner V2 off, "custom logits processors".)"""
    extra = getattr(sampling_params, "extra_args", None) or {}
    if EXTRA_KEY not in extra:
        return
    record = _model_record()
    if record is None:
        raise _ValidationError("fragments: this request has a plan but fragments' plugin is not active in "
                               "vLLM's workers (no model record in FRAGMENTS_VLLM_DIR); load the plugin "
                               "(VLLM_PLUGINS unset or listing 'fragments')")
    from . import _server
    try:
        _server.check_issued(extra[EXTRA_KEY])  # in `vllm serve`: only plans its middleware checked
        plan = RequestPlan.parse(extra[EXTRA_KEY], "<request>", record)
        if plan.error:
            raise ValueError(plan.error)
    except ValueError as e:  # vLLM's own validation error: the server answers 400 and keeps the connection
        raise _ValidationError(str(e)) from None


def sampling_params(plan: Any = None, key: Optional[str] = None, base: Optional[str] = None, **kwargs):
    """vLLM SamplingParams carrying `plan` (a plan dict/list, or None) under a fresh key."""
    from vllm import SamplingParams
    extra = dict(kwargs.pop("extra_args", None) or {})
    if plan is not None:
        spec = {"interventions": plan} if isinstance(plan, list) else dict(plan)
        spec["key"] = key or spec.get("key") or uuid.uuid4().hex
        if base is not None:
            spec["base"] = base
        extra[EXTRA_KEY] = spec
    return SamplingParams(extra_args=extra or None, **kwargs)


def take_saves(llm, keys: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """The saves of finished requests, by key (rank 0's copy; every rank drops its own). Each entry is
    {"error": str|None, "saves": {name: tensor}}."""
    from safetensors.torch import load
    from ._saves import finished_tokens
    from ._stages import merge_takes
    # with the tokens each request produced: rows of steps past them (async scheduling) are left out
    t0 = time.perf_counter()
    answers = llm.collective_rpc("fragments_take_saves", args=({k: finished_tokens.pop(k) for k in keys},))
    timings["take_rpc_s"] = time.perf_counter() - t0  # the benchmark's view of what returning saves costs
    first = merge_takes(answers, keys) if any(a is not None for a in answers) else None  # every stage's
    if first is None:
        raise RuntimeError("fragments: no worker answered fragments_take_saves; is the plugin loaded?")
    t0 = time.perf_counter()
    out = {key: {"error": v["error"], "saves": load(v["data"]) if v["data"] else {}} for key, v in first.items()}
    timings["load_s"] = time.perf_counter() - t0
    return out


timings: Dict[str, float] = {}  # the last take_saves' seconds (bench/vllm_throughput.py reports them)


class Refused:
    """generate's output for a prompt whose plan was refused at submission: no tokens, the reason in
    `fragments_error` (as the OpenAI server answers that request 400 and serves the others)."""

    def __init__(self, prompt, error: str):
        self.prompt, self.outputs, self.finished = prompt, [], True
        self.fragments, self.fragments_error = {}, error

    def __repr__(self):
        return f"Refused({self.fragments_error!r})"


def generate(llm, prompts, plans: Optional[List[Any]] = None, use_tqdm: bool = False, **sampling_kwargs):
    """llm.generate with one plan per prompt (None: no plan); each RequestOutput gets `.fragments` (name ->
    tensor) and `.fragments_error`. A prompt whose plan is refused at submission (an unknown location, a
    value that does not fit) gets a `Refused` in its place, and the others run."""
    prompts = list(prompts) if not isinstance(prompts, (str, dict)) else [prompts]
    plans = list(plans) if plans is not None else [None] * len(prompts)
    if len(plans) != len(prompts):
        raise ValueError(f"fragments: {len(plans)} plans for {len(prompts)} prompts")
    params = [sampling_params(p, **sampling_kwargs) for p in plans]
    specs = [p.extra_args.get(EXTRA_KEY) if p.extra_args else None for p in params]
    record = inspect(llm) if any(specs) else None  # this engine's locations and widths
    refused = {i: RequestPlan.parse(spec, spec["key"], record).error for i, spec in enumerate(specs) if spec}
    refused = {i: error for i, error in refused.items() if error}
    run = [i for i in range(len(prompts)) if i not in refused]
    ran = llm.generate([prompts[i] for i in run], [params[i] for i in run], use_tqdm=use_tqdm) if run else []
    keys = [specs[i]["key"] for i in run if specs[i]]
    saved = take_saves(llm, keys) if keys else {}
    outputs: List[Any] = [Refused(prompts[i], refused[i]) if i in refused else None for i in range(len(prompts))]
    for i, out in zip(run, ran):
        entry = saved.get(specs[i]["key"], {"error": None, "saves": {}}) if specs[i] else {"error": None, "saves": {}}
        out.fragments = entry["saves"]
        out.fragments_error = entry["error"]
        outputs[i] = out
    return outputs


def inspect(llm) -> dict:
    """The model's fragment table and locations as the workers classified them (no forward runs):
    {"tp_size", "table", "fragmented": {location: rule text}, "refused": {location: why}, ...}."""
    answers = llm.collective_rpc("fragments_model_record")
    return answers[0]
