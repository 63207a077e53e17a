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

import atexit
import json
import os
import shutil
import sys
import tempfile
from typing import Optional

from . import _vllm_api
from ._front import Refused, generate, inspect, sampling_params, take_saves, timings
from ._plan import EXTRA_KEY, RequestPlan

__all__ = ["register", "validate_request", "sampling_params", "generate", "take_saves", "inspect",
           "EXTRA_KEY", "Refused", "VLLM", "timings"]


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
        _own_state_dir(tempfile.mkdtemp(prefix="fragments-vllm-"))
        _cpu_defaults()
    from . import _install, _saves, _server
    _install.install()
    _saves.install_rpc()
    _server.install_into_api_server()  # only in `vllm serve`'s API server process


_STATE_DIR: Optional[tuple] = None  # (pid, folder): the shared state folder this process made


def _own_state_dir(folder: str) -> None:
    global _STATE_DIR
    os.environ["FRAGMENTS_VLLM_DIR"] = folder
    _STATE_DIR = (os.getpid(), folder)
    atexit.register(remove_state_dir)


def remove_state_dir() -> None:
    """The shared state folder goes with the process that made it, at its exit (atexit), or here before an
    os._exit. vLLM's processes started from it are gone by then; a forked child that inherits the exit hook
    leaves the folder alone."""
    global _STATE_DIR
    if _STATE_DIR is not None and _STATE_DIR[0] == os.getpid():
        shutil.rmtree(_STATE_DIR[1], ignore_errors=True)
        _STATE_DIR = None


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
        reserved = _default_reservation()
        # the margin: each worker measures its node's free memory after its own start (torch, the model), not now
        if available < min(1.0, reserved + MEMORY_MARGIN) * total:
            space = max(1, int(available // 4))
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(space)
            notes.append(f"{available:.1f} of {total:.1f} GiB free, too little for vLLM's default reservation "
                         f"({reserved:g} of it): KV cache {space} GiB (VLLM_CPU_KVCACHE_SPACE chooses it)")
    if notes:
        print("fragments: vLLM CPU build: " + "; ".join(notes) + " (FRAGMENTS_VLLM_CPU_DEFAULTS=0: leave vLLM's "
              "defaults)", file=sys.stderr, flush=True)


MEMORY_MARGIN = 0.05  # of total memory, above vLLM's reservation: what its workers take before they measure


def _default_reservation() -> float:
    """vLLM's default gpu_memory_utilization, the share of a CPU node's memory it reserves (0.9 before 0.24,
    0.92 in 0.24)."""
    try:
        from vllm.config import CacheConfig  # a pydantic dataclass
        return float(CacheConfig.__pydantic_fields__["gpu_memory_utilization"].default)
    except Exception:  # noqa: B902 - another layout of vLLM's config: its 0.24 value
        return 0.92


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
