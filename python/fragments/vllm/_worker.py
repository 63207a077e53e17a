"""fragments inside a vLLM worker: hooks on the real layers, per-request plans, saves kept for the caller.

Data flow of one engine step (docs/vllm.md):
  vLLM's scheduler decides the batch and broadcasts it; every rank runs execute_model on the same
  scheduler output, so every rank sees the same requests, rows and plans, in the same order.
  begin_step (_install.py wraps vLLM's Worker) parses the plans of new requests and keeps a hook only at the
  locations live plans name (none: vLLM's modules run untouched); the first hook that fires reads the
  runner's batch (_runner.py: Model Runner V1 or V2) and each request's plan (its
  SamplingParams.extra_args["fragments"]) and works out, per location, which request rows act at this
  step (prefill = step 0, decode step k = step k).
  A hook at a location with work: the rank's piece of the selected rows → vLLM's tensor-parallel group
  all_gather (or all_reduce for a partial sum) → the whole (fragments' C++ rule, logical order: q|k|v,
  gate|up) → each request's steps on its own rows (save a copy; set/add/scale/zero) → if edited, the
  rank's piece cut back out (C++ piece_of_whole) and written into the layer's value.
  Saves stay in this process, per request key, until the caller takes them (collective_rpc
  "fragments_take_saves"; rank 0 answers). On a GPU a save is copied to pinned host memory without
  waiting (the stream orders it); take_saves waits for the copies once.

Why hooks: in eager mode (enforce_eager=True) the model runs as Python modules, and module hooks see
every layer boundary with its module path. The compiled path (torch.compile / Inductor) loses the module
structure in its post-grad graph, so compiled engines get taps placed before Dynamo traces: hooks calling the
fragments::tap op, whose body (tap_body) does the same work at run time (_tap.py; docs/vllm.md).
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import Dict, List, Optional, Tuple

import torch

from .. import _C
from ..core import executor
from . import _delivery, _drain, _durations, _layers, _plan, _python, _rowqueue, _runner, _saves, _stages, _steady, _tap, _vllm_api

log = logging.getLogger("fragments.vllm")

current: Optional["WorkerState"] = None  # this process's state, once vLLM has loaded the model (_install.py)


_Work = _steady.Work  # one plan step acting on one request's rows at one location in this forward


class WorkerState:
    """Per worker process: the model's table, its hooks and the plans and saves of live requests."""

    def __init__(self, runner, model):
        from vllm.distributed import get_tp_group
        self.runner = runner
        self.view = _runner.adapt(runner)  # refuses a runner it cannot read, at engine start
        self.model = model
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.tp = get_tp_group()
        self.rank = self.tp.rank_in_group
        self.world = self.tp.world_size
        self.pp = _stages.pp_group()  # None at pipeline_parallel_size 1
        self.stage = self.pp.rank_in_group if self.pp is not None else 0
        described = _layers.describe(model)
        self.table = json.loads(_C.classify_layers(described, "vLLM model"))
        self.qkv_attributes = _layers.qkv_attributes(described)
        self.fragmented, self.refused = _layers.locations(model, self.table)
        self.rules = _layers.rules(self.fragmented)
        self.partial_sums = _layers.partial_sums(self.rules)
        self.modules = dict(model.named_modules())
        self.leading_batch = _vllm_api.leading_batch(model)  # transformers' modules: [1, tokens, width]
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        self.logits_modules = sorted(p for p, m in self.modules.items() if isinstance(m, LogitsProcessor))
        self.plans: Dict[str, _plan.RequestPlan] = {}  # vLLM request id -> parsed plan
        self.live_plans: Optional[Dict[str, bool]] = None  # compiled: live plans' ids -> whether each edits (_acting)
        self.copies = _rowqueue.HostCopies(self.device)  # saves' device -> host copies, without waiting
        self.saves = _saves.SavesStore(keep=self.rank == 0, copy=self.copies.copy, wait=self.copies.wait,
                                       folder=_delivery.rows_folder())
        self.last_rows: tuple = (None, None)  # _where's last (row spans, device) and _runner.row_index's index
        self.answers = _delivery.Folder()  # where takes' answers go as files (the caller on this machine)
        self.in_step = False
        self.acting = False  # compiled: a live plan acts at this step
        self.editing = False  # compiled: ... and edits (its taps' bodies must run: no graph they are captured in)
        self.slots: Dict[str, torch.Tensor] = {}  # CUDA graphs: location -> the buffer their replays copy to
        self.executing = False  # inside execute_model (a forward), not an ad-hoc module call (fragments_call)
        self.step_work: Optional[Dict[str, List[_Work]]] = None
        self.steady: Optional[_steady.Steady] = None  # the last step's work while the batch follows on from it
        self.draining: Optional[_drain.SlotDrain] = None  # its steps gathered on the device, not copied yet
        self.logits_done: set = set()  # logits locations acted at in this step (V2 may compute logits twice)
        self.hooks: Dict[str, object] = {}  # location -> its hook's handle: only where a live plan acts
        self.compiled = not runner.model_config.enforce_eager
        self._record = None
        self.publish = None  # _install._publish: the front end's copy of the model record, rewritten on change
        self._failed = False  # a plan failed in a forward: its hooks go at the next step
        self.python_steps: Dict[str, list] = {}  # Python steps of VLLM traces by group (_python.py)
        self.py_live: Dict[tuple, tuple] = {}  # (request key, location, step) -> (forward, its rows)
        self.py_forward = 0  # forwards run, for py_live
        self.taps: List[str] = []  # compiled mode: the locations with a fragments::tap (fixed at start)
        self.graphs = "none"  # compiled mode: how taps meet CUDA graphs (_tap.arrange_graphs)
        self.tap_calls: Dict[str, int] = {}
        self.forwards = 0  # compiled mode: forwards in which a plan acted
        self.host_s, self.step_counts = Counter(), Counter()  # host seconds by phase, steps (compile_stats)
        self.durations = _durations.StepDurations()  # begin_step's and end_step's last calls (compile_stats)
        # every stage's locations (a collective over the pipeline group at pp > 1: _stages.exchange)
        self._record = _stages.exchange(self._local_record())
        self.stage_of: Dict[str, int] = self._record.get("stage", {})
        if self.compiled:  # taps chosen over every stage's locations (the same on every rank), placed at its own
            self._place_taps()
            self._record.update(taps=self.taps, graphs=self.graphs)
            from . import _compile
            _compile.watch_dynamo()

    # ---- what the front end and tests read --------------------------------------------------------
    def model_record(self) -> dict:
        return self._record

    def _local_record(self) -> dict:
        """This worker's record (at pp > 1 only the modules its stage really holds: _stages.own)."""
        record = {"format": "fragments.vllm/1", "tp_size": self.world, "compiled": self.compiled,
                  "runner": self.view.kind, "device": str(self.device), "graphs": self.graphs,
                  "table": self.table, "qkv_attributes": self.qkv_attributes,
                  "fragmented": {loc: _C.describe_rule(json.dumps(rule)) for loc, rule in self.fragmented.items()},
                  "refused": dict(self.refused), "modules": sorted(p for p in self.modules if p),
                  "classes": {p: type(m).__name__ for p, m in self.modules.items()},
                  "logits_modules": self.logits_modules, "taps": self.taps,
                  "widths": _layers.widths(self.modules, self.runner.model_config.get_hidden_size())}
        return _stages.own(record, self.model) if self.pp is not None else record

    def here(self, location: str) -> bool:
        """Whether this worker's stage acts at `location` (always at pipeline_parallel_size 1)."""
        return self.stage_of.get(location, self.stage) == self.stage

    # ---- the step -----------------------------------------------------------------------------------
    def begin_step(self, scheduler_output):
        """Plans of requests new in this step are parsed, those of finished ones dropped, and the hooks
        follow: a location has a hook only while a live plan acts there, so a batch without plans runs
        vLLM's model untouched. Every rank sees the same scheduler output, so every rank hooks alike."""
        t0 = time.perf_counter()
        self.saves.flush()  # earlier steps' rows whose copies are done go to their files, while the GPU works
        self._begin_step(scheduler_output)
        took = time.perf_counter() - t0
        self.host_s["begin_step"] += took
        self.durations.add("begin_step", took)
        self.step_counts["all"] += 1  # (Counter.update's keywords cost a few microseconds a step)
        self.step_counts["acting"] += int(self.in_step)

    def _begin_step(self, scheduler_output):
        self.step_work = None
        self.logits_done = set()
        self.executing = True
        self.py_forward += 1
        self.view.begin_step()
        changed, self._failed = self._failed, False
        finished = getattr(scheduler_output, "finished_req_ids", ()) or ()  # done or aborted
        if finished:
            _drain.settle(self)  # their last steps' rows may wait in a drain's device block
        for req_id in finished:
            plan = self.plans.pop(req_id, None)
            if plan is not None:
                self.saves.finish(plan.key)  # its saves now wait only for their caller (or expire)
                changed = True
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            if new.req_id not in self.plans:
                changed |= self._plan_of(new.req_id, new.sampling_params) is not None
        if changed:
            self.steady = self.live_plans = None  # plans came, went or failed: the work is worked out afresh
            self._sync_hooks()
        self.in_step = bool(self.hooks)
        if self.compiled:  # taps are always in the graph; their bodies act only while a live plan acts
            self.acting, self.editing = self._acting(scheduler_output)
            self.in_step = self.acting
            self.forwards += int(self.acting)

    def _acting(self, scheduler_output) -> Tuple[bool, bool]:
        """(whether a request scheduled in this step has a live plan, whether one of those edits), read before
        vLLM picks a CUDA graph: a FULL graph serves read-only plans (its taps copy their values into slots), not
        edits. Per request, not per plan step: which step a request is at is the runner's count (_runner.Row),
        known only once its batch is built, and a tap must never be skipped where a step runs."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        if self.live_plans is None:  # live plans (whether each edits), kept until plans change: a step reads them
            self.live_plans = {r: any(s.do != "save" for s in p.steps)
                            for r, p in self.plans.items() if p is not None and not p.error}
        live = [edits for r, edits in self.live_plans.items() if r in scheduled]
        return bool(live), any(live)

    def _sync_hooks(self):
        wanted = set() if self.compiled else \
            {s.at for p in self.plans.values() if p is not None and not p.error for s in p.steps if self.here(s.at)}
        for location in set(self.hooks) - wanted:
            self.hooks.pop(location).remove()
        for location in wanted - set(self.hooks):
            path, _, side = location.rpartition(".")
            module = self.modules[path]
            self.hooks[location] = (module.register_forward_pre_hook(self._pre_hook(path), with_kwargs=True)
                                    if side == "input" else
                                    module.register_forward_hook(self._post_hook(path), with_kwargs=True))

    def end_step(self):
        t0 = time.perf_counter()
        if self.in_step and self.view.graph in _tap.slotted(self.graphs):  # the taps' values are in their slots
            self.step_counts[self.view.graph.lower()] += 1
            self._drain_slots()
        self.copies.seal(self.saves)
        took = time.perf_counter() - t0
        self.host_s["end_step"] += took
        self.durations.add("end_step", took)
        self.in_step = self.executing = self.acting = self.editing = False
        self.step_work = None

    def _work(self) -> Dict[str, List[_Work]]:
        """Location -> work of this forward, built once per step from the runner's batch (same on every rank),
        or the last step's while the batch follows on from it (_steady.py)."""
        if self.step_work is not None:
            return self.step_work
        batch = self.view.batch_arrays()
        if self.steady is not None and self.steady.follows(batch):
            self.step_work = self.steady.work
            return self.step_work
        _drain.settle(self)  # the last batch's steps a drain holds go first: a file's rows go in step order
        work: Dict[str, List[_Work]] = {}
        shift, planned, variable = [0], [], []
        for row in self.view.rows():
            plan = self._plan_of(row.req_id)
            if plan is None or plan.error:
                continue
            planned.append(row.index)
            step = row.step
            for s in plan.steps:
                runs = s.runs_at(step)
                if not isinstance(s.steps, str):  # a set of steps: the work changes when one begins or ends
                    variable.append((s, step, runs))
                if not runs or not self.here(s.at):
                    continue
                if s.logits:  # the logits processor sees one row per request: its sampled position
                    if row.samples:
                        work.setdefault(s.at, []).append(_Work(plan.key, row.index, row.index + 1, s, step, shift))
                else:
                    work.setdefault(s.at, []).append(_Work(plan.key, row.start, row.stop, s, step, shift))
        self.step_work = work
        self.steady = _steady.Steady.of(batch, planned, work, shift, variable)
        return work

    def _plan_of(self, req_id: str, params=None) -> Optional["_plan.RequestPlan"]:
        if req_id in self.plans:
            return self.plans[req_id]
        if params is None:
            params = self.view.sampling_params(req_id)
        extra = getattr(params, "extra_args", None) or {}
        spec = extra.get(_plan.EXTRA_KEY)
        plan = None
        if spec is not None:
            # checked against every stage's locations (the front end's record), acted on at this stage's
            plan = _plan.RequestPlan.parse(spec, req_id, self._record,
                                           None if self.pp is not None else set(self.modules))
            _python.attach(self, plan, spec)  # a VLLM trace's Python steps (.apply, edits read from locations)
            for s in plan.steps:  # values (files, registered vectors) onto the model's device, once
                if isinstance(getattr(s, "value", None), torch.Tensor):
                    s.step.value = s.value.to(self.device)
            self.saves.open(plan.key, plan.error)
        self.plans[req_id] = plan
        self.live_plans = None
        return plan

    # ---- hooks --------------------------------------------------------------------------------------
    def _pre_hook(self, path):
        location = f"{path}.input" if path else "input"

        def hook(module, args, kwargs):
            work = self._live_work(location)
            if not work:
                return None
            if args:
                new = self._edited(location, args[0], work)
                return None if new is None else ((new,) + tuple(args[1:]), kwargs)
            name = next(iter(kwargs))  # vLLM models call some layers with keyword arguments
            new = self._edited(location, kwargs[name], work)
            if new is None:
                return None
            kwargs = dict(kwargs)
            kwargs[name] = new
            return args, kwargs
        return hook

    def _post_hook(self, path):
        location = f"{path}.output" if path else "output"

        def hook(module, args, kwargs, output):
            work = self._live_work(location)
            if not work:
                return None
            if isinstance(output, tuple):  # vLLM linears: (output, bias); decoder layers: (hidden, residual)
                new = self._edited(location, output[0], work)
                return None if new is None else (new,) + tuple(output[1:])
            return self._edited(location, output, work)
        return hook

    def _live_work(self, location: str) -> Optional[List[_Work]]:
        """This step's work at `location`, or None. The logits processor acts once per step: Model Runner V2
        also calls it for prompt logprobs, on other rows."""
        if not self.in_step:
            return None
        work = self._work().get(location)
        if not work:
            return None
        if work[0].step.logits:
            if location in self.logits_done:
                return None
            self.logits_done.add(location)
        return work

    def _edited(self, location: str, value, work: List[_Work]):
        """The hooks' form of _act: a new tensor (the layer's own is left as it is) when something was edited."""
        rows = self._token_rows(value)
        acted = self._act(location, rows, work)
        if acted is None:
            return None
        out = rows.clone()
        _runner.write_rows(out, *acted)
        return out.view(value.shape)

    def _token_rows(self, value):
        """`value` as [tokens, ...]: vLLM's Transformers backend calls transformers' modules on a batch of one."""
        if self.leading_batch and isinstance(value, torch.Tensor) and value.dim() == 3 and value.shape[0] == 1:
            return value[0]
        return value

    def _act(self, location: str, value, work: List[_Work]) -> Optional[Tuple[object, torch.Tensor]]:
        """Runs the work at one location on `value` (this rank's tensor, [tokens, width]); when something was
        edited, returns (rows, the rank's new piece of them) for _write."""
        t0 = time.perf_counter()
        try:
            return self._act_on(location, value, work)
        finally:
            self.host_s["act"] += time.perf_counter() - t0

    def _act_on(self, location: str, value, work: List[_Work]) -> Optional[Tuple[object, torch.Tensor]]:
        if value is None:  # vLLM's logits on ranks other than the driver when it gathers to rank 0
            return None
        if not isinstance(value, torch.Tensor) or value.dim() < 1 or not value.is_floating_point():
            # the same on every rank: no collective runs, the requests get an error instead of the engine dying
            for w in work:
                self._fail(w.key, f"{location} holds {type(value).__name__}"
                           f"{'' if not isinstance(value, torch.Tensor) else ' of ' + str(value.dtype)}, "
                           "not a floating-point activation (vLLM calls this module with it first)")
            return None
        rule = self.rules.get(location)
        prep = _steady.prepared(self.steady, self.step_work, location, work,
                                lambda spans: self._where(spans, value.device))
        where = prep.where
        if prep.count and prep.last >= value.shape[0]:
            # a tensor laid out other than [tokens, ...]: the requests fail alike on every rank, vLLM goes on
            for w in work:
                self._fail(w.key, f"{location} holds {list(value.shape)}, not one row per token of this step "
                           f"({prep.last + 1} or more): a layout the plugin does not read")
            return None
        edits = prep.edits
        piece = value.narrow(0, where.start, prep.count) if isinstance(where, range) else value.index_select(0, where)
        if rule is None:
            whole = piece.clone() if edits and isinstance(where, range) else piece  # edits never touch `value`
        elif location in self.partial_sums:
            whole = self.tp.all_reduce(piece.clone())
        else:
            gathered = self.tp.all_gather(piece.unsqueeze(0).contiguous(), dim=0)
            whole = rule.whole_from_pieces(list(gathered.unbind(0)))
        edited = False
        # read-only work here: one host copy of the rows for every request's plain saves (SaveGroup: one call to
        # the store per save name); ranks other than 0 keep no tensors (their saves are equal copies nobody reads)
        # (on the CPU, rows written into their files at once need no copy)
        host = None if edits or not self.saves.keep else \
            whole if self.saves.folder and not self.copies.asynchronous(whole) else self.copies.copy(whole)
        for w in (work if host is None else prep.rest):
            s = w.step
            view = whole[slice(*prep.block_rows(w))]
            if s.do == "python":  # fragments.vllm.VLLM's Python steps (_python.py); they fail their request alone
                edited |= _python.run(self, location, s, w, view, lambda key: next(
                    (whole[slice(*prep.block_rows(x))] for x in work if x.key == key), None))
                continue
            # A step that cannot run (an index out of range, a value of the wrong shape) fails its request
            # only; whole values are the same on every rank, so every rank fails it alike.
            try:
                edited |= self._step(location, s, w, view)
            except (RuntimeError, ValueError) as e:
                self._fail(w.key, f"{location} ({s.do}) at step {w.at_step}: {e}")
        if host is not None:
            pending = self.copies.asynchronous(whole)
            for group in prep.saves:
                group.add(self.saves, host, pending, location)
        if not edited:
            return None
        new_piece = whole if rule is None else rule.piece_of_whole(whole, self.rank)
        return where, new_piece.to(value.dtype)

    def _where(self, spans: List[tuple], device) -> object:
        """_runner.row_index, kept while the batch's rows stay the same (decode: every location, step after step)."""
        key = (tuple(spans), device)
        if self.last_rows[0] != key:
            self.last_rows = (key, _runner.row_index(spans, device))
        return self.last_rows[1]

    def _step(self, location: str, s, w: _Work, view) -> bool:
        """One JSON plan step on the request's rows `view` of the whole; returns whether it edited them."""
        if s.do == "save":
            part = _C.index_view(s.index, view, location) if s.index else view
            self.saves.add(w.key, s.as_, part, step=w.at_step)  # copied to the host if the store keeps it
            return False
        target = _C.index_view(s.index, view, location) if s.index else view
        executor.edit(target, s.do, s.value, s.by)  # the one switch over an edit in Python (fragments.core)
        return True

    # ---- compiled mode (fragments/vllm/_tap.py) ------------------------------------------------------
    def _place_taps(self):
        """Taps at the locations additional_config["fragments_taps"] names, placed before vLLM's first forward
        compiles the model. A bad pattern stops the engine with one message (before any request)."""
        extra = getattr(self.runner.vllm_config, "additional_config", None) or {}
        patterns = extra.get(_tap.TAPS_KEY, []) if isinstance(extra, dict) else []
        if not patterns:
            return
        modules = self._record["modules"] if self.pp is not None else self.modules  # every stage's
        candidates = {f"{p}.{side}" if p else side for p in modules for side in ("input", "output")}
        candidates -= {f"{p}.input" for p in self._record["logits_modules"]}  # vLLM passes the LM head module there
        self.taps = _tap.select(patterns, candidates, self._record["refused"])
        self.graphs = _tap.arrange_graphs(self.runner.vllm_config.compilation_config, _tap.graph_way())
        slots = self.graphs == "slots"  # taps inside every graph: a step that edits runs without one
        if slots:  # Inductor's code around a tap at a biased layer's output as plain vLLM's (_addmm.py)
            from . import _addmm
            _addmm.install()
        self.view.guard_graphs(lambda: self.editing, no_graph=slots)
        self.tap_calls = {loc: 0 for loc in self.taps}
        _tap.place(self.modules, [t for t in self.taps if self.here(t)])
        _tap.body = self.tap_body
        _tap.opaque = self.tap_opaque

    def tap_opaque(self, location: str) -> None:
        """A tap's hook ran as Python inside a CUDA graph being captured (_tap._ran_as_python). Where taps split
        the PIECEWISE graphs, such a tap would run nowhere in their replays (it is inside a piece): plans naming
        the location are refused from now on (engine start captures every graph before the first request).
        Where taps stay inside every graph ("slots"), its copy into its slot was captured like every other tap's
        and serves it."""
        if self.graphs != "slots" and location not in self.refused:
            self.refused[location] = ("it runs inside an op vLLM keeps opaque to torch.compile (e.g. its fused-MoE "
                                      "op's shared expert), so a captured CUDA graph replays it without the plugin;"
                                      ' serve it with enforce_eager=True or compilation_config {"cudagraph_mode": '
                                      '"NONE"}')
            log.warning("fragments: %s is served only without CUDA graphs: %s", location, self.refused[location])
            self._record["refused"][location] = self.refused[location]  # the record plans are checked against
            if self.publish is not None:
                self.publish(self)

    def tap_body(self, location: str, x) -> None:
        """fragments::tap's body, at run time inside the compiled forward (on a GPU: between CUDA-graph pieces, or
        in a forward run without a graph): the eager hooks' work, the value edited in place. While vLLM captures
        a CUDA graph it records a copy of the value into the location's slot instead, which every replay of that
        graph makes (_drain_slots)."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            self._slot_copy(location, x)
            return
        work = self._live_work(location)
        if self.in_step and self.executing:  # a logit lens calling a tapped module is not a forward's call
            self.tap_calls[location] = self.tap_calls.get(location, 0) + 1
        if not work:
            return
        rows = self._token_rows(x)  # a view: _write edits x itself
        acted = self._act(location, rows, work)
        if acted is not None:
            _runner.write_rows(rows, *acted)

    def _slot_copy(self, location: str, x) -> None:
        _drain.fill(self, location, x)

    def _drain_slots(self) -> None:
        _drain.drain(self)

    def compile_stats(self) -> dict:
        from . import _compile
        return _compile.stats(self)

    def _fail(self, key: str, message: str) -> None:
        error = self.saves.fail(key, f"fragments plan of request {key}: {message}")
        for plan in self.plans.values():  # no further steps for that request
            if plan is not None and plan.key == key:
                plan.error = error
                self._failed = True

    # ---- RPC ----------------------------------------------------------------------------------------
    def take_saves(self, keys, route: Optional[dict] = None) -> Optional[Dict[str, dict]]:
        """Rank 0: each key's saves (_saves.SavesStore.take: "status", "error", "data" as safetensors bytes, or
        a "file" in shared memory when `route` says the caller is on this machine: _delivery.py; a step's rows
        concatenated in step order); the other ranks drop theirs and answer None. `keys`: a list, or {key: the
        tokens its request produced, or None} (rows of later steps left out)."""
        t0 = time.perf_counter()
        _drain.settle(self)
        steps = keys if isinstance(keys, dict) else dict.fromkeys(keys)
        folder = self.answers.get(route) if self.rank == 0 else None
        out = {key: self.saves.take(key, n, folder) for key, n in steps.items()}
        self.host_s["take_saves"] += time.perf_counter() - t0
        return out if self.rank == 0 else None

    def call(self, modules: List[str], data: bytes) -> Optional[dict]:
        """Ad-hoc module calls on a whole tensor after a forward, the logit lens (_calls.run)."""
        from . import _calls
        return _calls.run(self, modules, data)
