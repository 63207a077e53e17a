"""fragments' place in vLLM's processes: vLLM's Worker wrapped (load_model, execute_model, sample_tokens) and
the RPC methods the front end calls (collective_rpc "fragments_*").

Wrapping vLLM's Worker, not a model runner class, serves every runner vLLM may pick (Model Runner V1 and V2 on
GPUs, the CPU build's V1 subclass): the Worker holds whichever it built as `model_runner`, and _runner.adapt
reads it (or refuses it, at engine start). A step is open from execute_model to the end of sample_tokens:
Model Runner V2 computes the logits in sample_tokens, V1 in execute_model; vLLM's dummy runs (profiling,
CUDA-graph capture) call the runner directly, never these, so no plan acts in them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from typing import List, Optional

import torch

from . import _vllm_api, _worker

log = logging.getLogger("fragments.vllm")
_lock = threading.Lock()


def _scope(name: str):
    """A named span in a torch profiler's trace while one runs (vLLM's profiler: bench/vllm_throughput.py
    --profile-dir, summed by tools/probes/trace_gaps.py); nothing otherwise (one C call a step)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def state() -> Optional["_worker.WorkerState"]:
    return _worker.current


def _after_load(worker) -> None:
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    with _lock:
        _worker.current = _worker.WorkerState(runner, model)
    runner._fragments = _worker.current
    _worker.current.publish = _publish
    _publish(_worker.current)


def _publish(state) -> None:
    """Rank 0's model record for the server's front end (FRAGMENTS_VLLM_DIR/model.json); again when it changes
    (a location refused while vLLM captures its CUDA graphs, before the first request)."""
    directory = os.environ.get("FRAGMENTS_VLLM_DIR")
    if directory and _global_rank() == 0:  # one writer: its record holds every pipeline stage's locations
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".model.{os.getpid()}.json")
        with open(tmp, "w") as f:
            json.dump(state.model_record(), f)
        os.replace(tmp, os.path.join(directory, "model.json"))


def _global_rank() -> int:
    from vllm.distributed import get_world_group
    return get_world_group().rank_in_group


def _wrap(cls, name, make):
    original = cls.__dict__.get(name)
    if original is None or getattr(original, "_fragments", False):
        return
    wrapped = make(original)
    wrapped._fragments = True
    wrapped.__wrapped__ = original
    setattr(cls, name, wrapped)


def install() -> None:
    """Wraps vLLM's Worker and gives workers the RPC methods. Idempotent."""
    from vllm.v1.worker import gpu_worker, worker_base

    def load_model(original):
        def load_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            _after_load(self)
            return result
        return load_model

    def execute_model(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            s = getattr(self.model_runner, "_fragments", None)
            if s is None:
                return original(self, scheduler_output, *args, **kwargs)
            with _scope("fragments: begin_step"):
                s.begin_step(scheduler_output)
            ended = True
            try:
                out = original(self, scheduler_output, *args, **kwargs)
                ended = out is not None  # None: sample_tokens follows and ends the step
                return out
            finally:
                if ended:
                    with _scope("fragments: end_step"):
                        s.end_step()
        return execute_model

    def sample_tokens(original):
        def sample_tokens(self, *args, **kwargs):
            s = getattr(self.model_runner, "_fragments", None)
            try:
                return original(self, *args, **kwargs)
            finally:
                if s is not None:
                    with _scope("fragments: end_step"):
                        s.end_step()
        return sample_tokens

    _wrap_front_end()
    _wrap(gpu_worker.Worker, "load_model", load_model)
    _wrap(gpu_worker.Worker, "execute_model", execute_model)
    _wrap(gpu_worker.Worker, "sample_tokens", sample_tokens)
    _vllm_api.cpu_moe_workaround()

    # vLLM's collective_rpc finds worker methods by name (its worker_extension_cls does the same by
    # inheritance); these are fragments' own.
    for name in ("take_saves", "model_record", "call", "python_steps", "compile_stats"):
        setattr(worker_base.WorkerBase, f"fragments_{name}", _RPC[name])


def _wrap_front_end() -> None:
    """Plans checked where vLLM checks a request's parameters (InputProcessor._validate_params, in the process
    that submits: LLM's, the OpenAI server's), so a bad plan fails its request before the engine sees it."""
    try:
        from vllm.v1.engine import input_processor
    except ImportError:  # pragma: no cover - another vLLM layout: plans are still checked in the workers
        log.warning("fragments: vLLM's input processor not found; plans are checked in the workers only")
        return

    def validate_params(original):
        def _validate_params(self, params, *args, **kwargs):
            result = original(self, params, *args, **kwargs)  # 0.32 returns the request's watermarking
            from . import validate_request
            validate_request(params)
            return result
        return _validate_params
    _wrap(input_processor.InputProcessor, "_validate_params", validate_params)
    _count_tokens()


def _count_tokens() -> None:
    """The tokens each plan request produced, counted where vLLM finishes it in the front end (its output
    processor: stop strings included), so that taking its saves leaves out steps past them (_saves.py)."""
    try:
        from vllm.v1.engine import output_processor
    except ImportError:  # pragma: no cover - another vLLM layout: saves keep every step's rows
        log.warning("fragments: vLLM's output processor not found; saves may hold a step past the last token")
        return
    from . import EXTRA_KEY
    from ._saves import finished_tokens

    def add_request(original):
        def _add_request(self, request, *args, **kwargs):
            extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
            spec = extra.get(EXTRA_KEY)
            if isinstance(spec, dict) and isinstance(spec.get("key"), str):
                finished_tokens.started(request.request_id, spec["key"])
            return original(self, request, *args, **kwargs)
        return _add_request

    def finish_request(original):
        def _finish_request(self, req_state):
            tokens = getattr(getattr(req_state, "detokenizer", None), "output_token_ids", None)
            finished_tokens.finished(req_state.request_id, len(tokens) if tokens is not None else None)
            return original(self, req_state)
        return _finish_request

    def abort_requests(original):
        def _abort_requests(self, request_ids, *args, **kwargs):
            request_ids = list(request_ids)
            for request_id in request_ids:
                finished_tokens.aborted(request_id)
            return original(self, request_ids, *args, **kwargs)
        return _abort_requests
    _wrap(output_processor.OutputProcessor, "add_request", add_request)
    _wrap(output_processor.OutputProcessor, "_finish_request", finish_request)
    _wrap(output_processor.OutputProcessor, "abort_requests", abort_requests)


def _rpc_take_saves(self, keys: List[str], route=None):
    return _worker.current.take_saves(keys, route) if _worker.current is not None else None


def _rpc_model_record(self):
    return _worker.current.model_record() if _worker.current is not None else None


def _rpc_call(self, modules, data):
    return _worker.current.call(modules, data) if _worker.current is not None else None


def _rpc_python_steps(self, group, blob):
    """A VLLM trace's Python steps (cloudpickle bytes) under its group id; blob None drops them."""
    s = _worker.current
    if s is None:
        return None
    if blob is None:
        s.python_steps.pop(group, None)
        for k in [k for k in s.py_live if k[0].startswith(group + ".")]:  # its captures
            del s.py_live[k]
    else:
        import cloudpickle
        s.python_steps[group] = cloudpickle.loads(blob)
    return True


def _rpc_compile_stats(self):
    return _worker.current.compile_stats() if _worker.current is not None else None


_RPC = {"take_saves": _rpc_take_saves, "model_record": _rpc_model_record, "call": _rpc_call,
        "python_steps": _rpc_python_steps, "compile_stats": _rpc_compile_stats}

