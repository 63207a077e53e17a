"""Tracing over vLLM's `LLM` in nnsight's manner, with fragments' own recorder.

    from fragments.vllm import VLLM
    model = VLLM(folder, tensor_parallel_size=2, dtype="float32")        # or VLLM(llm=an_LLM)
    with model.trace([5, 6, 7]) as tr:                                   # one prompt: token ids or text
        qkv = model.model.layers[0].self_attn.qkv_proj.output.save()    # whole: [tokens, q|k|v]
        model.model.layers[0].self_attn.qkv_proj.output.v.heads[1] *= 0.5
        lens = model.lm_head(model.model.norm.output).save()            # a logit lens: every position
        logits = model.output.save()                                     # the sampled position's logits
    with model.generate([prompt_a, prompt_b], max_tokens=8) as gen:      # per-step plans
        with gen.iter[1:]:                                               # decode steps (gen.prefill(), ...)
            model.model.layers[1].mlp.down_proj.input[...] += steer
        h = model.model.layers[1].output.save()                          # one value per prompt
    gen.output                                                           # vLLM's RequestOutputs

The module tree, locations, `.save()`, in-place edits, head views and `Module(...)` calls are the recorder
every backend shares (fragments.tracing) with its generation scopes; what it records are plan steps
(fragments.core.step.Step) and Python steps. Here the plan steps are written as one per-request plan
(`Step.to_json`, fragments.plan/1, with vLLM's "step" instead of "steps": fragments.vllm._plan) that travels in
SamplingParams' extra_args to the workers, where the plugin's hooks run it on whole values; saves come back with
the output.
vLLM's values are [tokens, width] (its flattened batch: one prompt's rows), a save at several steps is
their rows concatenated (prefill rows, then one row per decode step). An ad-hoc module call (logit lens)
runs after the forward in the workers on the saved whole value (every rank, vLLM's own modules; the LM
head through vLLM's logits processor).

Several prompts in one trace, nnsight's invokes: each invoke is its own request in one `LLM.generate`, and
what is recorded inside it acts on (and saves) that prompt's rows only:

    with model.trace() as tr:                                            # or model.generate(max_tokens=4)
        with tr.invoke(clean):
            h = model.model.layers[1].mlp.down_proj.output               # clean's value (taken in its invoke)
        with tr.invoke(corrupt):
            model.model.layers[1].mlp.down_proj.output[-1] = h[-1]      # patching within one forward
            patched = model.output.save()

Compiled engines (enforce_eager=False: `VLLM(folder, taps=[globs])`, or an `LLM` started with
additional_config {"fragments_taps": [...]}) run the same traces at the locations tapped at start
(fragments/vllm/_tap.py); naming any other location (a save, an edit, `.apply`, a location an edit reads,
`model.output` without `logits_processor.output` tapped) is refused where it is recorded, with the tap to
declare. Ad-hoc module calls (the logit lens) run after the forward, outside the compiled graph.

Python steps (fragments.core.step.PythonStep, scheduled by fragments.vllm._python): `.apply(fn)` (fn(rows) -> the
replacement or None) and edits whose value is read from a location — of the same prompt at an earlier (or the same) location, or of another
invoke's prompt in the same forward — run in the workers on whole values; the trace sends them once to
every worker (cloudpickle; collective_rpc). Refused with a message: recording outside the invokes of a
trace that has invokes, an edit's value read from `model.output` or from an ad-hoc module call, `gen.rows`
(every prompt is its own request: use invokes), a value of a location later in the forward (the request
fails with the reason).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import numbers
import os
import shutil
import tempfile
import uuid

from .. import _C
from ..core import graph
from ..core.errors import FragmentsError
from ..core.saved import SavedValue
from ..core.step import PythonStep
from ..tracing.envoy import TracedModel
from ..tracing.tracer import Tracer
from ..tracing.tree import ModelTree, rank_local_reason
from ._front import generate, record_of
from ._tap import TAPS_KEY


class VLLM(TracedModel):
    """A vLLM `LLM` (fragments' plugin loaded) whose module tree can be traced. Eager by default; with
    `taps` (globs, as additional_config["fragments_taps"]) a compiled engine (torch.compile), where a trace
    may name only the tapped locations."""

    def __init__(self, model=None, llm=None, tensor_parallel_size=1, dtype="float32", taps=None, **llm_kwargs):
        if llm is None:
            llm = _engine(model, tensor_parallel_size, dtype, taps, llm_kwargs)
        elif taps is not None:
            raise FragmentsError("VLLM(llm=..., taps=...): an engine's taps are fixed when it starts; give them to "
                                 f'LLM(..., additional_config={{"{TAPS_KEY}": [...]}})')
        self.llm = llm
        record = record_of(llm)  # the one its traces' generate calls then use
        if record is None:
            raise FragmentsError("fragments' vLLM plugin is not loaded in this engine's workers (VLLM_PLUGINS "
                                 "unset or listing 'fragments', and FRAGMENTS_VLLM not 0)")
        # A compiled engine acts only at the locations tapped at its start: recording any other is refused
        # at once (None: eager, every location).
        self._taps = set(record.get("taps") or ()) if record.get("compiled") else None
        self._record = record
        self.dtype = llm.llm_engine.model_config.dtype
        self._tree = _tree_of(record, self.dtype)
        self._logits_at = record["logits_modules"][0] + ".output" if record["logits_modules"] else None

    def _title(self):
        r = self._record
        return (f"<fragments.vllm.VLLM tp={r['tp_size']} {'compiled' if r.get('compiled') else 'eager'}, "
                f"{self.dtype}>")

    def close(self):
        """Shuts vLLM's engine processes down (engine core and workers) now rather than at exit."""
        self.llm.llm_engine.engine_core.shutdown()

    def locations(self):
        """The locations as `frag inspect --json` lists a rank file's (fragments.inspect/1's fields: tp_size,
        fragmented (location and rule), whole, rank_local (location and why), layers, heads), from the
        workers' classification of vLLM's layers (fragments.vllm.inspect has the whole record)."""
        r, tree = self._record, self._tree
        attention = {path.rpartition(".")[0] for path in r["qkv_attributes"]}  # where heads can be
        heads = {name: {k: {"start": a, "stop": b, "head_dim": d, "heads": (b - a) // d} for k, (a, b, d) in
                        tree.head_layout(name).items()}
                 for name in tree.locations if name.rpartition(".")[0].rpartition(".")[0] in attention}
        return {"format": "fragments.inspect/1", "tp_size": r["tp_size"], "layers": r["table"].get("layers", []),
                "fragmented": [{"location": loc, "rule": rule} for loc, rule in r["fragmented"].items()],
                "whole": [loc for loc, kind in tree.locations.items() if kind == "whole"],
                "rank_local": [{"location": loc, "why": why} for loc, why in r["refused"].items()],
                "heads": {name: regions for name, regions in heads.items() if regions}}

    def trace(self, prompt=None, **sampling):
        """One forward of one prompt (a prefill that samples one token); without a prompt, of the prompts of
        the trace's invokes (`with tr.invoke(prompt):`), in one batch."""
        return VllmTrace(self, [] if prompt is None else [prompt], 1, sampling, single=True)

    def generate(self, prompts=None, max_tokens=1, **sampling):
        """Generation of each prompt (its own request, the same plan); saves give one value per prompt when
        there are several. Without prompts, those of the trace's invokes (each with its own plan). Greedy
        unless `temperature` is given; vLLM's SamplingParams otherwise (top_p, seed, ...; `max_new_tokens` is
        max_tokens, as in fragments.load's and LanguageModel's generate; their `eos_token_id`, one id or several,
        is vLLM's stop_token_ids: the row stops after it, the token kept, as there)."""
        if "max_new_tokens" in sampling:
            max_tokens = sampling.pop("max_new_tokens")
        eos = sampling.pop("eos_token_id", None)
        if eos is not None:
            sampling["stop_token_ids"] = [int(eos)] if isinstance(eos, numbers.Integral) else [int(t) for t in eos]
        if prompts is None:
            return VllmTrace(self, [], int(max_tokens), sampling, single=True)
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        return VllmTrace(self, [prompts] if single else list(prompts), int(max_tokens), sampling, single)

    def _head_layout(self, location):
        return self._tree.head_layout(location)

    def _require_tap(self, location, where=None):
        """Compiled engines: `location` must be among the taps declared at start (the graph is fixed)."""
        if self._taps is None or location in self._taps:
            return
        raise FragmentsError(f"{where or location}: this vLLM engine is compiled (enforce_eager=False) and {location} "
                             f"is not tapped; declare it at start: VLLM(..., taps=[\"{location}\"]) or LLM(..., "
                             f'additional_config={{"{TAPS_KEY}": ["{location}"]}}) (globs allowed), or use '
                             "enforce_eager=True")

    def _callable(self, path):
        return None if path in self._record["modules"] else f"{path} is not a module of this vLLM model"

    def _call(self, modules, x):
        """Modules run by the workers on a whole tensor (fragments_call: every rank alike; rank 0's answer)."""
        from safetensors.torch import load, save
        answers = self.llm.collective_rpc("fragments_call", args=(list(modules), save({"x": x.contiguous()})))
        answer = next(a for a in answers if a is not None)  # the stage holding the modules answers
        if answer["error"]:
            raise FragmentsError(answer["error"])
        return load(answer["data"])["y"]


def _engine(model, tensor_parallel_size, dtype, taps, llm_kwargs):
    """vLLM's LLM for VLLM(folder, ...): eager, or compiled with a tap at each of `taps` (_tap.py)."""
    from vllm import LLM
    if taps is not None:
        if llm_kwargs.get("enforce_eager"):
            raise FragmentsError("VLLM(taps=...) compiles the model (enforce_eager=False); taps and "
                                 "enforce_eager=True do not go together")
        config = dict(llm_kwargs.pop("additional_config", None) or {})
        config[TAPS_KEY] = [taps] if isinstance(taps, str) else list(taps)
        llm_kwargs.update(enforce_eager=False, additional_config=config)
    llm_kwargs.setdefault("enforce_eager", True)
    return LLM(model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, **llm_kwargs)


def _tree_of(record, dtype):
    """The ModelTree of the workers' model record: modules (in natural order), locations (those a plan may not
    name are rank-local, with the workers' reason), head layouts from the fragment table."""
    natural = lambda path: [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")]  # noqa: E731
    paths = sorted(record["modules"], key=natural)
    classes = record.get("classes") or {}
    modules = [("", classes.get("", "?"))] + [(p, classes.get(p, "?")) for p in paths]
    kinds, reasons = {}, {}
    for p in paths:
        for side in ("input", "output"):
            loc = f"{p}.{side}"
            if loc in record["refused"]:
                kinds[loc], reasons[loc] = "rank_local", _why_rank_local(record, classes, p, side)
            else:
                kinds[loc] = "fragmented" if loc in record["fragmented"] else "whole"
    table = json.dumps(record["table"])
    heads = lambda loc: _C.head_layout(table, loc, record["qkv_attributes"])  # noqa: E731
    return ModelTree(modules, kinds, reasons, dtype, heads=heads)


_COLUMN = ("ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear")


def _why_rank_local(record, classes, path, side):
    """fragments.load's words (rank_local_reason) for a module the workers found between a block's
    column-parallel layer and its row-parallel one (vllm._layers.locations): derived from the column layer's
    output; whole at the row layer's input only where the block feeds the module's output straight in (its
    activation, its attention); any other refusal (a partial sum) in the workers' words."""
    loc, parent = f"{path}.{side}", path.rpartition(".")[0]
    layers = [e for e in record["table"].get("layers", []) if e["path"].rpartition(".")[0] == parent]
    column = next((e["path"] for e in layers if e["kind"] in _COLUMN and e.get("output")), None)
    if column is None:
        return f"{loc}: {record['refused'][loc]}"
    row = next((e["path"] for e in layers if e["kind"] == "RowParallelLinear"), None)
    feeds_row = side == "output" and (path.endswith(".act_fn") or classes.get(path) == "Attention")
    return rank_local_reason(loc, f"{column}.output", f"{row}.input" if row and feeds_row else None)


def _step_of(steps, max_tokens):
    """The recorder's generation scope ("prefill", "decode", "k", "a:b", None) as a vLLM plan's "step"."""
    if steps is None:
        return "all"
    if steps in ("prefill", "decode"):
        return steps
    if ":" in steps:
        start, stop = steps.split(":")
        return list(range(int(start), int(stop) if stop else max_tokens))
    return int(steps)


class VllmTrace(Tracer):
    """`with model.trace(prompt)` / `with model.generate(prompts, max_tokens)`: the shared recorder with its
    generation scopes and nnsight's invokes (each invoke one request); runs as one vLLM generate when the block
    ends."""

    def __init__(self, model, prompts, max_tokens, sampling, single):
        if max_tokens < 1:
            raise FragmentsError(f"generate: max_tokens must be a positive integer, got {max_tokens!r}")
        super().__init__(model, max_tokens)
        self._given = bool(prompts)
        self._prompts = [self._prompt(p) for p in prompts]
        self._sampling, self._single = dict(sampling), single
        self._sampling.setdefault("temperature", 0.0)
        self._invokes, self._context = [], None
        self._output_invokes = {}  # id(SavedValue of model.output) -> its invoke
        self._vllm_expressions = []  # (SavedValue, node, {id(leaf): SavedValue}): computed after the trace

    def run(self, ids):
        raise FragmentsError("a vLLM trace runs once, at its block's end: run(ids) is fragments.load's "
                             "(Trace.run) and model.plan() has no vLLM counterpart")

    @staticmethod
    def _prompt(p):
        return {"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) else p

    def rows(self, rows):
        raise FragmentsError("gen.rows: in vLLM every prompt is its own request; give each prompt its own invoke "
                             "(`with tr.invoke(prompt):`)")

    @contextlib.contextmanager
    def invoke(self, prompt):
        """nnsight's invoke: one prompt (its own request in the batch); what is recorded inside acts on its
        rows only and saves its values."""
        if self._given:
            raise FragmentsError("invoke: this trace was given its prompts; use `model.trace()` (no prompt) with "
                                 "one invoke per prompt")
        if self._context is not None:
            raise FragmentsError("invoke: invokes do not nest")
        if not self._invokes and (self._steps or self._python or self._saves):
            raise FragmentsError("invoke: something was recorded outside the invokes; record inside them")
        self._context = len(self._invokes)
        self._invokes.append(self._prompt(prompt))
        try:
            yield self
        finally:
            self._context = None

    # ---- the recorder's hooks: invokes, taps, what vLLM can run
    def _locate(self, name, visit, context):
        return graph.Output() if name == "output" else graph.Loc(name, visit, invoke=context)

    def _check(self, name, where):
        super()._check(name, where)
        self._model._require_tap(name, where)

    def _in_invoke(self):
        if self._invokes and self._context is None:
            raise FragmentsError("this trace has invokes: record inside `with tr.invoke(prompt):` (each invoke is "
                                 "one prompt's request; steps outside would have no prompt)")

    def _add(self, step, where):
        self._in_invoke()
        step.invoke = self._context
        super()._add(step, where)

    def _position(self):
        """How many plan steps the open invoke (or the trace) has so far: a Python step runs after them and before
        those recorded later, at the same location (_python.attach); then its place among the Python steps."""
        return (sum(1 for step in self._steps if step.invoke == self._context), len(self._python))

    def _save_output(self):
        if self._model._logits_at is not None:
            self._model._require_tap(self._model._logits_at, "model.output")
        saved = super()._save_output()
        self._output_invokes[id(saved)] = self._context
        return saved

    def _leaves(self, node, where, what):
        if graph.calls_in(node):
            raise FragmentsError(f"{where}: a module called ad hoc runs after the forward: save it; it cannot be "
                                 f"part of {'an edit' if what == 'edit' else 'an expression'} in a vLLM trace")
        leaves = graph.leaves_of(node)
        for leaf in leaves:
            if isinstance(leaf, graph.Output):
                if what == "edit":
                    raise FragmentsError(f"{where}: model.output exists only after the forward: it cannot be an "
                                         "edit's value")
            elif not isinstance(leaf, graph.Loc):
                raise FragmentsError(f"{where}: {leaf!r}: only locations' values can be read in a vLLM trace")
            elif leaf.visit not in (None, 0):
                raise FragmentsError(f"{where}: {leaf!r}: vLLM calls each module once per forward")
        return leaves

    def _edit_by_expression(self, location, index, do, node, where):
        """An edit whose value is read from locations: a Python step run in the workers (_python.py)."""
        if self._invokes and self._context is None:
            raise FragmentsError(f"{where}: this trace has invokes: record inside `with tr.invoke(prompt):`")
        if location._visit not in (None, 0):
            raise FragmentsError(f"{where}: vLLM calls each module once per forward: no visit {location._visit}")
        for leaf in self._leaves(node, where, "edit"):
            self._check(leaf.name, where)  # read by a capture there (_python.py)
            if leaf.invoke is not None and leaf.invoke >= len(self._invokes):
                raise FragmentsError(f"{where}: {leaf!r} belongs to invoke {leaf.invoke}, which this trace does not "
                                     "have")
        self._python.append(PythonStep(kind="edit", at=location.name, visit=location._visit, index=index, do=do,
                                       value=node, where=where, steps=self._scope.steps, invoke=self._context,
                                       pos=self._position()))

    def _apply(self, location, fn, where):
        self._in_invoke()
        if location._visit not in (None, 0):
            raise FragmentsError(f"{location.name}.visit({location._visit}).apply: vLLM calls each module once per "
                                 "forward")
        if location.name == "output" or location.name == self._model._logits_at:
            raise FragmentsError(f"{location.name}.apply: the logits cannot be edited here: apply at lm_head's input "
                                 "(the final norm's output)")
        self._check(location.name, f"{where}: {location.name}.apply")
        self._python.append(PythonStep(kind="apply", at=location.name, visit=location._visit, fn=fn, where=where,
                                       steps=self._scope.steps, invoke=self._context, pos=self._position()))

    def _save_expression(self, node, where):
        """`.save()` of an expression: its locations saved (each in its invoke), computed after the trace."""
        values = {}
        for leaf in self._leaves(node, where, "save"):
            invoke = leaf.invoke if isinstance(leaf, graph.Loc) else None
            now, self._context = self._context, invoke if invoke is not None else self._context
            try:
                values[id(leaf)] = self._save_output() if not isinstance(leaf, graph.Loc) else \
                    self._save_location(leaf.name, None, where, repr(graph.Loc(leaf.name)))
            finally:
                self._context = now
        saved = SavedValue(repr(node))
        self._vllm_expressions.append((saved, node, values))
        return saved

    # ---- running: one request per prompt (or invoke)
    def _entries(self, folder, invoke=None):
        """The recorded steps (of one invoke) as one request plan (values in folder/values.safetensors); the
        saves that are module calls, as (name, modules)."""
        from safetensors.torch import save_file
        values, entries, calls = {}, [], []
        file = "values.safetensors" if invoke is None else f"values{invoke}.safetensors"  # one file per invoke
        for i, step in enumerate(self._steps):
            if step.invoke != invoke:
                continue
            ref = None
            if step.value is not None:
                values[f"v{i}"] = step.value.contiguous()
                ref = f"{file}:v{i}"
            entry = step.to_json(ref)
            entry.pop("steps", None)
            entry["step"] = _step_of(step.steps, self._generate)
            if step.do == "call":  # saved here, called after the forward (see the module's docstring)
                calls.append((step.as_, list(step.modules)))
                entry["do"] = "save"
                entry.pop("modules")
            entries.append(entry)
        if any(name is None and self._output_invokes.get(id(v)) == invoke
               for v, name in zip(self._saves, self._recorded.saves)):
            if self._model._logits_at is None:
                raise FragmentsError("model.output.save(): this vLLM model has no logits processor module")
            entries.append({"at": self._model._logits_at, "do": "save", "as": "__output", "step": "all"})
        if values:
            save_file(values, os.path.join(folder, file))
        return entries, calls

    def _python_steps(self):
        """The trace's Python steps for the workers (_python.attach schedules them): `.apply` callables, edits by
        expressions, and a capture of every location (and invoke) those expressions read; each with its engine
        steps (`steps`: a vLLM plan's "step")."""
        steps, captures = [], set()
        for step in self._python:
            steps.append(_with_engine_steps(step, _step_of(step.steps, self._generate)))
            if step.kind == "edit":
                captures.update((leaf.name, step.invoke if leaf.invoke is None else leaf.invoke)
                                for leaf in graph.leaves_of(step.value))
        for name, invoke in sorted(captures, key=lambda c: (c[0], -1 if c[1] is None else c[1])):
            steps.append(PythonStep(kind="capture", at=name, steps="all", invoke=invoke))
        return steps

    def _finish(self):
        prompts = self._requests()
        group = "trace-" + uuid.uuid4().hex
        python = self._python_steps()
        llm = self._model.llm
        folder = tempfile.mkdtemp(prefix="fragments-vllm-trace-")
        try:
            plans, calls = self._plans(prompts, folder, group, bool(python))
            if python:
                import cloudpickle
                llm.collective_rpc("fragments_python_steps", args=(group, cloudpickle.dumps(python)))
            try:
                outputs = generate(llm, prompts, plans, max_tokens=self._generate, **self._sampling)
            finally:
                if python:
                    llm.collective_rpc("fragments_python_steps", args=(group, None))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._deliver_outputs(outputs, calls)

    def _requests(self):
        if self._invokes and not self._prompts:
            return self._invokes
        if self._invokes or not self._prompts:
            raise FragmentsError("a trace without prompts needs invokes: `with tr.invoke(prompt):`")
        return self._prompts

    def _plans(self, prompts, folder, group, python):
        """One request plan per prompt (an invoke's own; otherwise the same for each), and its module calls."""
        plans, calls = [], {}
        for i in range(len(prompts)):
            invoke = i if self._invokes else None
            if invoke is None and i > 0:
                entries, calls[i] = plans[0]["interventions"], calls[0]
            else:
                entries, calls[i] = self._entries(folder, invoke)
            plan = {"interventions": entries, "base": folder, "key": f"{group}.{i}"}
            if python:
                plan["python_steps"] = [group, invoke]
            plans.append(plan)
        return plans, calls

    def _deliver_outputs(self, outputs, calls):
        for i, out in enumerate(outputs):
            if out.fragments_error:
                raise FragmentsError(out.fragments_error)
            for name, modules in calls[i]:
                out.fragments[name] = self._model._call(modules, out.fragments[name])
        if self._invokes:  # each value is its invoke's
            invoke_of = {step.as_: step.invoke for step in self._steps if step.as_}
            for value, name in zip(self._saves, self._recorded.saves):
                i = self._output_invokes.get(id(value)) if name is None else invoke_of[name]
                value._set(outputs[i].fragments.get(name or "__output"))
            self.output = outputs
        else:
            for value, name in zip(self._saves, self._recorded.saves):
                per_prompt = [out.fragments.get(name or "__output") for out in outputs]
                value._set(per_prompt[0] if self._single else per_prompt)
            self.output = outputs[0] if self._single else outputs
        for saved, node, values in self._vllm_expressions:  # several prompts without invokes: one value per prompt
            per_prompt = not self._invokes and not self._single
            saved._set([graph.evaluate(node, lambda leaf, k=k: values[id(leaf)].value[k]) for k in range(len(outputs))]
                       if per_prompt else graph.evaluate(node, lambda leaf: values[id(leaf)].value))


def _with_engine_steps(step, steps):
    """A copy of `step` whose `steps` is a vLLM plan's "step" (the engine steps it acts at)."""
    return dataclasses.replace(step, steps=steps)
