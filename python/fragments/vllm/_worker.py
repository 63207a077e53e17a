"""fragments inside a vLLM worker: hooks on the real layers, per-request plans, saves kept for the caller.

Data flow of one engine step (docs/vllm.md):
  vLLM's scheduler decides the batch and broadcasts it; every rank runs execute_model on the same
  scheduler output, so every rank sees the same requests, rows and plans, in the same order.
  execute_model (wrapped) parses the plans of new requests and keeps a hook only at the locations live
  plans name (none: vLLM's modules run untouched); the first hook that fires reads the runner's flattened batch
  (input_batch.req_ids, query_start_loc, num_computed_tokens) and each request's plan (its
  SamplingParams.extra_args["fragments"]) and works out, per location, which request rows act at this
  step (prefill = step 0, decode step k = step k).
  A hook at a location with work: the rank's piece of the selected rows → vLLM's tensor-parallel group
  all_gather (or all_reduce for a partial sum) → the whole (fragments' C++ rule, logical order: q|k|v,
  gate|up) → each request's steps on its own rows (save a copy; set/add/scale/zero) → if edited, the
  rank's piece cut back out (C++ piece_of_whole) and written into the layer's value.
  Saves stay in this process, per request key, until the caller takes them (collective_rpc
  "fragments_take_saves"; rank 0 answers).

Why hooks: in eager mode (enforce_eager=True) the model runs as Python modules, and module hooks see
every layer boundary with its module path. The compiled path (torch.compile / Inductor) loses the module
structure in its post-grad graph, so compiled engines get taps placed before Dynamo traces: hooks calling the
fragments::tap op, whose body (tap_body) does the same work at run time (_tap.py; docs/vllm.md).
"""
from __future__ import annotations

import io
import json
import logging
import os
import threading
from typing import Dict, List, Optional, Tuple

import torch

from .. import _C
from . import _layers, _plan, _python, _saves

log = logging.getLogger("fragments.vllm")

_state: Optional["WorkerState"] = None
_lock = threading.Lock()


class _Work:
    """One plan step acting on one request's rows at one location in this forward."""
    __slots__ = ("key", "start", "stop", "step", "at_step")

    def __init__(self, key, start, stop, step, at_step):
        self.key, self.start, self.stop, self.step, self.at_step = key, start, stop, step, at_step


class WorkerState:
    """Per worker process: the model's table, its hooks and the plans and saves of live requests."""

    def __init__(self, runner, model):
        from vllm.distributed import get_tp_group
        self.runner = runner
        self.model = model
        self.tp = get_tp_group()
        self.rank = self.tp.rank_in_group
        self.world = self.tp.world_size
        described = _layers.describe(model)
        self.table = json.loads(_C.classify_layers(described, "vLLM model"))
        self.qkv_attributes = _layers.qkv_attributes(described)
        self.fragmented, self.refused = _layers.locations(model, self.table)
        self.modules = dict(model.named_modules())
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        self.logits_modules = sorted(p for p, m in self.modules.items() if isinstance(m, LogitsProcessor))
        self.plans: Dict[str, _plan.RequestPlan] = {}  # vLLM request id -> parsed plan
        self.saves = _saves.SavesStore(keep=self.rank == 0)  # request key -> its saves and error, bounded
        self.in_step = False
        self.executing = False  # inside execute_model (a forward), not an ad-hoc module call (fragments_call)
        self.step_work: Optional[Dict[str, List[_Work]]] = None
        self.hooks: Dict[str, object] = {}  # location -> its hook's handle: only where a live plan acts
        self.compiled = not runner.model_config.enforce_eager
        self._record = None
        self._failed = False  # a plan failed in a forward: its hooks go at the next step
        self.programs: Dict[str, list] = {}  # Python steps of VLLM traces by group (_python.py)
        self.py_live: Dict[tuple, tuple] = {}  # (request key, location, step) -> (forward, its rows)
        self.py_forward = 0  # forwards run, for py_live
        self.taps: List[str] = []  # compiled mode: the locations with a fragments::tap (fixed at start)
        self.tap_calls: Dict[str, int] = {}
        self.forwards = 0
        if self.compiled:
            self._place_taps()
            _watch_dynamo()

    # ---- what the front end and tests read --------------------------------------------------------
    def model_record(self) -> dict:
        return {"format": "fragments.vllm/1", "tp_size": self.world, "compiled": self.compiled,
                "table": self.table, "qkv_attributes": self.qkv_attributes,
                "fragmented": {loc: _C.describe_rule(json.dumps(rule)) for loc, rule in self.fragmented.items()},
                "refused": self.refused, "modules": sorted(p for p in self.modules if p),
                "logits_modules": self.logits_modules, "taps": self.taps,
                "widths": _layers.widths(self.modules, self.runner.model_config.get_hidden_size())}

    # ---- the step -----------------------------------------------------------------------------------
    def begin_step(self, scheduler_output):
        """Plans of requests new in this step are parsed, those of finished ones dropped, and the hooks
        follow: a location has a hook only while a live plan acts there, so a batch without plans runs
        vLLM's model untouched. Every rank sees the same scheduler output, so every rank hooks alike."""
        self.step_work = None
        self.executing = True
        self.py_forward += 1
        changed, self._failed = self._failed, False
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():  # done or aborted
            plan = self.plans.pop(req_id, None)
            if plan is not None:
                self.saves.finish(plan.key)  # its saves now wait only for their caller (or expire)
                changed = True
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            if new.req_id not in self.plans:
                changed |= self._plan_of(new.req_id, new.sampling_params) is not None
        if changed:
            self._sync_hooks()
        self.in_step = bool(self.hooks)
        if self.compiled:  # taps are always in the graph; their bodies act only while a live plan exists
            self.in_step = any(p is not None and not p.error for p in self.plans.values())
            self.forwards += int((getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0) > 0)

    def _sync_hooks(self):
        wanted = set() if self.compiled else \
            {s.at for p in self.plans.values() if p is not None and not p.error for s in p.steps}
        for location in set(self.hooks) - wanted:
            self.hooks.pop(location).remove()
        for location in wanted - set(self.hooks):
            path, _, side = location.rpartition(".")
            module = self.modules[path]
            self.hooks[location] = (module.register_forward_pre_hook(self._pre_hook(path), with_kwargs=True)
                                    if side == "input" else
                                    module.register_forward_hook(self._post_hook(path), with_kwargs=True))

    def end_step(self):
        self.in_step = self.executing = False
        self.step_work = None

    def _work(self) -> Dict[str, List[_Work]]:
        """Location -> work of this forward, built once per step from the runner's batch (same on every rank)."""
        if self.step_work is not None:
            return self.step_work
        work: Dict[str, List[_Work]] = {}
        runner = self.runner
        batch = runner.input_batch
        req_ids = list(batch.req_ids)
        qsl = runner.query_start_loc.np
        for i, req_id in enumerate(req_ids):
            plan = self._plan_of(req_id)
            if plan is None or plan.error:
                continue
            computed = int(batch.num_computed_tokens_cpu[i])
            prompt = int(batch.num_prompt_tokens[i])
            step = 0 if computed < prompt else computed - prompt + 1
            start, stop = int(qsl[i]), int(qsl[i + 1])
            for s in plan.steps:
                if not s.runs_at(step):
                    continue
                if s.logits:
                    # the logits processor sees one row per request: its sampled position
                    if computed + (stop - start) < prompt:
                        continue  # a prefill chunk that samples nothing
                    work.setdefault(s.at, []).append(_Work(plan.key, i, i + 1, s, step))
                else:
                    work.setdefault(s.at, []).append(_Work(plan.key, start, stop, s, step))
        self.step_work = work
        return work

    def _plan_of(self, req_id: str, params=None) -> Optional["_plan.RequestPlan"]:
        if req_id in self.plans:
            return self.plans[req_id]
        if params is None:
            state = self.runner.requests.get(req_id)
            params = getattr(state, "sampling_params", None) if state is not None else None
        extra = getattr(params, "extra_args", None) or {}
        spec = extra.get(_plan.EXTRA_KEY)
        plan = None
        if spec is not None:
            if self._record is None:
                self._record = self.model_record()
            plan = _plan.RequestPlan.parse(spec, req_id, self._record, set(self.modules))
            _python.attach(self, plan, spec)  # a VLLM trace's Python steps (.apply, edits read from locations)
            self.saves.open(plan.key, plan.error)
        self.plans[req_id] = plan
        return plan

    # ---- hooks --------------------------------------------------------------------------------------
    def _pre_hook(self, path):
        location = f"{path}.input" if path else "input"

        def hook(module, args, kwargs):
            if not self.in_step:
                return None
            work = self._work().get(location)
            if not work:
                return None
            if args:
                value = args[0]
                new = self._act(location, value, work)
                return None if new is None else ((new,) + tuple(args[1:]), kwargs)
            name = next(iter(kwargs))  # vLLM models call some layers with keyword arguments
            new = self._act(location, kwargs[name], work)
            if new is None:
                return None
            kwargs = dict(kwargs)
            kwargs[name] = new
            return args, kwargs
        return hook

    def _post_hook(self, path):
        location = f"{path}.output" if path else "output"

        def hook(module, args, kwargs, output):
            if not self.in_step:
                return None
            work = self._work().get(location)
            if not work:
                return None
            if isinstance(output, tuple):  # vLLM linears: (output, bias); decoder layers: (hidden, residual)
                new = self._act(location, output[0], work)
                return None if new is None else (new,) + tuple(output[1:])
            return self._act(location, output, work)
        return hook

    def _act(self, location: str, value, work: List[_Work]):
        """Runs the work at one location on `value` (this rank's tensor, [tokens, width]); returns the new
        value when something was edited, else None."""
        if value is None:  # vLLM's logits on ranks other than the driver when it gathers to rank 0
            return None
        if not isinstance(value, torch.Tensor) or value.dim() < 1 or not value.is_floating_point():
            # the same on every rank: no collective runs, the requests get an error instead of the engine dying
            for w in work:
                self._fail(w.key, f"{location} holds {type(value).__name__}"
                           f"{'' if not isinstance(value, torch.Tensor) else ' of ' + str(value.dtype)}, "
                           "not a floating-point activation (vLLM calls this module with it first)")
            return None
        rule = self.fragmented.get(location)
        rows = torch.cat([torch.arange(w.start, w.stop) for w in work]).unique(sorted=True)
        piece = value.index_select(0, rows.to(value.device))
        if rule is None:
            whole = piece
        else:
            rule_json = json.dumps(rule)
            if _C.collective_for(rule_json) == "all_reduce":
                whole = self.tp.all_reduce(piece.clone())
            else:
                gathered = self.tp.all_gather(piece.unsqueeze(0).contiguous(), dim=0)
                whole = _C.whole_from_pieces(rule_json, list(gathered.unbind(0)))
        position = {int(r): k for k, r in enumerate(rows.tolist())}
        edited = False
        for w in work:
            sel = slice(position[w.start], position[w.stop - 1] + 1)
            view = whole[sel]
            s = w.step
            if s.do == "python":  # fragments.vllm.VLLM's Python steps (_python.py); they fail their request alone
                edited |= _python.run(self, location, s, w, view, lambda key: next(
                    (whole[position[x.start]:position[x.stop - 1] + 1] for x in work if x.key == key), None))
                continue
            # A step that cannot run (an index out of range, a value of the wrong shape) fails its request
            # only; whole values are the same on every rank, so every rank fails it alike.
            try:
                if s.do == "save":
                    part = _C.index_view(s.index, view, location) if s.index else view
                    self.saves.add(w.key, s.as_, part)  # copied to the CPU if the store keeps it
                    continue
                target = _C.index_view(s.index, view, location) if s.index else view
                if s.do == "add":
                    update = target + s.value.to(target.dtype)
                elif s.do == "set":
                    update = s.value.to(target.dtype).expand_as(target)
                elif s.do == "scale":
                    update = target * s.by
                else:  # zero
                    update = torch.zeros_like(target)
                if update.shape != target.shape:
                    raise ValueError(f"value of shape {tuple(s.value.shape)} does not fit {tuple(target.shape)}")
                target.copy_(update)
                edited = True
            except (RuntimeError, ValueError) as e:
                self._fail(w.key, f"{location} ({s.do}) at step {w.at_step}: {e}")
        if not edited:
            return None
        new_piece = whole if rule is None else _C.piece_of_whole(json.dumps(rule), whole, self.rank)
        out = value.clone()
        out.index_copy_(0, rows.to(value.device), new_piece.to(value.dtype))
        return out

    # ---- compiled mode (fragments/vllm/_tap.py) ------------------------------------------------------
    def _place_taps(self):
        """Taps at the locations additional_config["fragments_taps"] names, placed before vLLM's first forward
        compiles the model. A bad pattern stops the engine with one message (before any request)."""
        from . import _tap
        extra = getattr(self.runner.vllm_config, "additional_config", None) or {}
        patterns = extra.get(_tap.TAPS_KEY, []) if isinstance(extra, dict) else []
        if not patterns:
            return
        candidates = {f"{p}.{side}" if p else side for p in self.modules for side in ("input", "output")}
        candidates -= {f"{p}.input" for p in self.logits_modules}  # vLLM passes the LM head module there
        _tap.check_graph_capture(self.runner.vllm_config.compilation_config)
        self.taps = _tap.select(patterns, candidates, self.refused)
        self.tap_calls = {loc: 0 for loc in self.taps}
        _tap.place(self.modules, self.taps)
        _tap.body = self.tap_body

    def tap_body(self, location: str, x) -> None:
        """fragments::tap's body, at run time inside the compiled forward: the eager hooks' work, the value
        edited in place."""
        if self.executing:  # a logit lens calling a tapped module after the forward is not a forward's call
            self.tap_calls[location] = self.tap_calls.get(location, 0) + 1
        if not self.in_step:
            return
        work = self._work().get(location)
        if not work:
            return
        new = self._act(location, x, work)
        if new is not None:
            x.copy_(new)

    def compile_stats(self) -> dict:
        """Per rank: forwards run by execute_model, tap body calls per location, Dynamo's and vLLM's compile
        counters (a recompile shows as a new Dynamo graph or compile)."""
        from torch._dynamo.utils import counters
        from vllm.compilation.counter import compilation_counter as cc
        from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
        model_code = sorted({_code_name(m.original_code_object()) for m in self.modules.values()
                             if isinstance(m, TorchCompileWithNoGuardsWrapper)})
        return {"rank": self.rank, "compiled": self.compiled, "forwards": self.forwards,
                "tap_calls": dict(self.tap_calls), "model_code": model_code,
                "dynamo_compiles": list(_dynamo_compiles),  # every frame Dynamo compiled here, in order
                "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
                "vllm_compiles": {k: int(getattr(cc, k)) for k in ("num_aot_compiles", "num_aot_artifacts_loaded",
                                                                    "num_backend_compilations",
                                                                    "num_inductor_compiles")}}

    def _fail(self, key: str, message: str) -> None:
        error = self.saves.fail(key, f"fragments plan of request {key}: {message}")
        for plan in self.plans.values():  # no further steps for that request
            if plan is not None and plan.key == key:
                plan.error = error
                self._failed = True

    # ---- RPC ----------------------------------------------------------------------------------------
    def take_saves(self, keys: List[str]) -> Optional[Dict[str, dict]]:
        """Rank 0: each key's saves (_saves.SavesStore.take: "status", "error", "data" as safetensors bytes, a
        step's rows concatenated in step order); the other ranks drop theirs and answer None."""
        out = {key: self.saves.take(key) for key in keys}
        return out if self.rank == 0 else None

    def call(self, modules: List[str], data: bytes) -> Optional[dict]:
        """Runs `modules` in turn on a whole tensor (safetensors bytes, "x") after a forward: the logit lens
        of fragments.vllm.VLLM. Replicated modules run as they are; the LM head through the model's logits
        processor (vLLM's own gather and scaling). Every rank runs it (the head's collective); rank 0
        answers {"error", "data"} ("y"), the others None."""
        from safetensors.torch import load, save
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        try:
            x = load(data)["x"]
            with torch.no_grad(), set_current_vllm_config(self.runner.vllm_config):
                for path in modules:
                    module = self.modules.get(path)
                    if module is None:
                        raise ValueError(f"{path} is not a module of this model")
                    if isinstance(module, ParallelLMHead) and self.logits_modules:
                        x = self.modules[self.logits_modules[0]](module, x)
                    elif f"{path}.input" in self.fragmented or f"{path}.output" in self.fragmented:
                        raise ValueError(f"{path} holds one rank's piece of its weights; only replicated modules "
                                         "and the LM head can be called on a whole value")
                    else:
                        out = module(x)
                        x = out[0] if isinstance(out, tuple) else out
            answer = {"error": None, "data": save({"y": x.contiguous()}) if x is not None else None}
        except (RuntimeError, ValueError, TypeError) as e:
            answer = {"error": f"fragments: {'('.join(modules[::-1])}(...): {e}", "data": None}
        return answer if self.rank == 0 else None


_dynamo_compiles: List[str] = []
_dynamo_watched = False


def _code_name(code) -> str:
    return f"{code.co_name} {code.co_filename}:{code.co_firstlineno}"


def _watch_dynamo():
    """Records every frame Dynamo compiles in this process (a bytecode hook; it changes nothing): the model's
    forward must be among them once and never again, whatever the plans (vLLM also compiles small helpers of
    its own, e.g. the sampler's logprob ranks, on first use)."""
    global _dynamo_watched
    if not _dynamo_watched:
        import torch._dynamo.convert_frame
        torch._dynamo.convert_frame.register_bytecode_hook(lambda old, new: _dynamo_compiles.append(_code_name(old)))
        _dynamo_watched = True


# ---- installation into vLLM's classes (the general plugin calls install) --------------------------------

def _state_dir() -> Optional[str]:
    return os.environ.get("FRAGMENTS_VLLM_DIR")


def _after_load(runner):
    global _state
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    with _lock:
        _state = WorkerState(runner, model)
    runner._fragments = _state
    directory = _state_dir()
    if directory and _state.rank == 0:
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".model.{os.getpid()}.json")
        with open(tmp, "w") as f:
            json.dump(_state.model_record(), f)
        os.replace(tmp, os.path.join(directory, "model.json"))


def install():
    """Wraps vLLM's model runners (load_model, execute_model) and gives workers the RPC methods. Idempotent."""
    from vllm.v1.worker import gpu_model_runner, worker_base
    runners = [gpu_model_runner.GPUModelRunner]
    try:
        from vllm.v1.worker import cpu_model_runner
        runners.append(cpu_model_runner.CPUModelRunner)
    except ImportError:
        pass
    for cls in runners:
        if "load_model" in cls.__dict__ and not getattr(cls.__dict__["load_model"], "_fragments", False):
            original_load = cls.__dict__["load_model"]

            def load_model(self, *args, _original=original_load, **kwargs):
                result = _original(self, *args, **kwargs)
                _after_load(self)
                return result
            load_model._fragments = True
            cls.load_model = load_model
        if "execute_model" in cls.__dict__ and not getattr(cls.__dict__["execute_model"], "_fragments", False):
            original_execute = cls.__dict__["execute_model"]

            def execute_model(self, scheduler_output, *args, _original=original_execute, **kwargs):
                state = getattr(self, "_fragments", None)
                if state is None:
                    return _original(self, scheduler_output, *args, **kwargs)
                state.begin_step(scheduler_output)
                try:
                    return _original(self, scheduler_output, *args, **kwargs)
                finally:
                    state.end_step()
            execute_model._fragments = True
            cls.execute_model = execute_model

    def fragments_take_saves(self, keys):
        return _state.take_saves(keys) if _state is not None else None

    def fragments_model_record(self):
        return _state.model_record() if _state is not None else None

    def fragments_call(self, modules, data):
        return _state.call(modules, data) if _state is not None else None

    def fragments_program(self, group, blob):
        """A VLLM trace's Python steps (cloudpickle bytes) under its group id; blob None drops them."""
        if _state is None:
            return None
        if blob is None:
            _state.programs.pop(group, None)
            for k in [k for k in _state.py_live if k[0].startswith(group + ".")]:  # its captures
                del _state.py_live[k]
        else:
            import cloudpickle
            _state.programs[group] = cloudpickle.loads(blob)
        return True
    def fragments_compile_stats(self):
        return _state.compile_stats() if _state is not None else None

    _cpu_moe_silu_workaround()

    # vLLM's collective_rpc finds worker methods by name (its worker_extension_cls does the same by
    # inheritance); these two are fragments' own.
    worker_base.WorkerBase.fragments_take_saves = fragments_take_saves
    worker_base.WorkerBase.fragments_model_record = fragments_model_record
    worker_base.WorkerBase.fragments_call = fragments_call
    worker_base.WorkerBase.fragments_program = fragments_program
    worker_base.WorkerBase.fragments_compile_stats = fragments_compile_stats


def _cpu_moe_silu_workaround():
    """vLLM 0.24's CPU MoE in float32 (its torch path, cpu_fused_moe.py) builds a SiluAndMul CustomOp at
    every call, outside vLLM's config context, and fails ("Current vLLM config is not set"). The same
    math (SiluAndMul.forward_native: silu(gate) * up) as a plain function; only that table entry changes."""
    try:
        import torch.nn.functional as F
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    except ImportError:
        return
    table = getattr(cpu_fused_moe, "_CPU_MOE_ACT_FN", None)
    if isinstance(table, dict) and MoEActivation.SILU in table:
        def silu_and_mul(x):
            d = x.shape[-1] // 2
            return F.silu(x[..., :d]) * x[..., d:]
        table[MoEActivation.SILU] = silu_and_mul
