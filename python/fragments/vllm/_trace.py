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

The module tree, locations, `.save()`, in-place edits, head views and `Module(...)` calls are fragments'
in-process recorder (fragments._model: Module, Location, Trace) and its step scopes (fragments._generate);
what it records are plan steps (`Step.to_json`, fragments.plan/1). Here they are compiled into one
per-request plan (fragments.vllm._plan: "step" instead of "steps") that travels in SamplingParams'
extra_args to the workers, where the plugin's hooks run it on whole values; saves come back with the output.
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

Python steps (fragments.vllm._python): `.apply(fn)` (fn(rows) -> the replacement or None) and edits whose
value is read from a location — of the same prompt at an earlier (or the same) location, or of another
invoke's prompt in the same forward — run in the workers on whole values; the trace sends them once to
every worker (cloudpickle; collective_rpc). Refused with a message: recording outside the invokes of a
trace that has invokes, an edit's value read from `model.output` or from an ad-hoc module call, `gen.rows`
(every prompt is its own request: use invokes), a value of a location later in the forward (the request
fails with the reason).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import uuid


from .. import _C
from .._generate import Generation, _Iter, _ScopedSteps, _StepScope
from .._model import FragmentsError, Location, Module, SavedValue, Trace, _Logits, _parse_index_text


class VLLM:
    """A vLLM `LLM` (fragments' plugin loaded) whose module tree can be traced. Eager by default; with
    `taps` (globs, as additional_config["fragments_taps"]) a compiled engine (torch.compile), where a trace
    may name only the tapped locations."""

    def __init__(self, model=None, llm=None, tensor_parallel_size=1, dtype="float32", taps=None, **llm_kwargs):
        from . import inspect
        from ._tap import TAPS_KEY
        if llm is None:
            from vllm import LLM
            if taps is not None:  # a compiled engine: its graph holds a tap at each of these locations (_tap.py)
                if llm_kwargs.get("enforce_eager"):
                    raise FragmentsError("VLLM(taps=...) compiles the model (enforce_eager=False); taps and "
                                         "enforce_eager=True do not go together")
                config = dict(llm_kwargs.pop("additional_config", None) or {})
                config[TAPS_KEY] = [taps] if isinstance(taps, str) else list(taps)
                llm_kwargs.update(enforce_eager=False, additional_config=config)
            llm_kwargs.setdefault("enforce_eager", True)
            llm = LLM(model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, **llm_kwargs)
        elif taps is not None:
            raise FragmentsError("VLLM(llm=..., taps=...): an engine's taps are fixed when it starts; give them to "
                                 f'LLM(..., additional_config={{"{TAPS_KEY}": [...]}})')
        self.llm = llm
        record = inspect(llm)
        if record is None:
            raise FragmentsError("fragments' vLLM plugin is not loaded in this engine's workers (VLLM_PLUGINS "
                                 "unset or listing 'fragments', and FRAGMENTS_VLLM not 0)")
        # A compiled engine acts only at the locations tapped at its start: recording any other is refused
        # at once (None: eager, every location).
        self._taps = set(record.get("taps") or ()) if record.get("compiled") else None
        self._record = record
        self.dtype = llm.llm_engine.model_config.dtype
        self._classes = {}
        self._children = {}
        for path in record["modules"]:
            parent, _, leaf = path.rpartition(".")
            self._children.setdefault(parent, []).append(leaf)
        self._location_kinds = {f"{p}.{side}": side for p in record["modules"] for side in ("input", "output")
                                if f"{p}.{side}" not in record["refused"]}
        self._logits_at = record["logits_modules"][0] + ".output" if record["logits_modules"] else None
        self._layouts = {}
        self._trace = None
        self._root = Module(self, "")
        self._c = _Calls(self)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._root, name)

    def close(self):
        """Shuts vLLM's engine processes down (engine core and workers) now rather than at exit."""
        self.llm.llm_engine.engine_core.shutdown()

    @property
    def output(self):
        return _Logits(self, "output")

    def trace(self, prompt=None, **sampling):
        """One forward of one prompt (a prefill that samples one token); without a prompt, of the prompts of
        the trace's invokes (`with tr.invoke(prompt):`), in one batch."""
        return VllmTrace(self, [] if prompt is None else [prompt], 1, sampling, single=True)

    def generate(self, prompts=None, max_tokens=1, **sampling):
        """Generation of each prompt (its own request, the same plan); saves give one value per prompt when
        there are several. Without prompts, those of the trace's invokes (each with its own plan). Greedy
        unless `temperature` is given."""
        if prompts is None:
            return VllmTrace(self, [], int(max_tokens), sampling, single=True)
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        return VllmTrace(self, [prompts] if single else list(prompts), int(max_tokens), sampling, single)

    def _head_layout(self, location):
        if location not in self._layouts:
            import json
            self._layouts[location] = _C.head_layout(json.dumps(self._record["table"]), location,
                                                     self._record["qkv_attributes"])
        return self._layouts[location]

    def _require_tap(self, location, where=None):
        """Compiled engines: `location` must be among the taps declared at start (the graph is fixed)."""
        if self._taps is None or location in self._taps:
            return
        from ._tap import TAPS_KEY
        raise FragmentsError(f"{where or location}: this vLLM engine is compiled (enforce_eager=False) and {location} "
                             f"is not tapped; declare it at start: VLLM(..., taps=[\"{location}\"]) or LLM(..., "
                             f'additional_config={{"{TAPS_KEY}": ["{location}"]}}) (globs allowed), or use '
                             "enforce_eager=True")

    def _active_trace(self, what):
        if self._trace is None:
            raise FragmentsError(f"{what} records an intervention: use it inside `with model.trace(prompt):`")
        return self._trace


class _Calls:
    """Ad-hoc module calls, run by the workers on a whole tensor (fragments_call: every rank alike)."""

    def __init__(self, model):
        self._model = model

    def callable(self, path):
        return None if path in self._model._record["modules"] else f"{path} is not a module of this vLLM model"

    def call(self, modules, x):
        from safetensors.torch import load, save
        answers = self._model.llm.collective_rpc("fragments_call", args=(list(modules), save({"x": x.contiguous()})))
        answer = next(a for a in answers if a is not None)  # the stage holding the modules answers
        if answer["error"]:
            raise FragmentsError(answer["error"])
        return load(answer["data"])["y"]


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


class _Recorded(_ScopedSteps):
    """A trace's steps (or `.apply` callables): each stamped with the step scope and the open invoke."""

    def __init__(self, trace):
        super().__init__(trace._scope)
        self._trace = trace

    def append(self, item):
        trace = self._trace
        if trace._invokes and trace._invoke_now is None:
            raise FragmentsError("this trace has invokes: record inside `with tr.invoke(prompt):` (each invoke "
                                 "is one prompt's request; steps outside would have no prompt)")
        if isinstance(item, tuple):  # Location.apply's (name, fn, visit, label): the label becomes the user's line
            from .._proxy import user_line
            trace._model._require_tap(item[0], f"{user_line()}: {item[0]}.apply")
            list.append(self, item[:3] + (user_line(), self._scope.steps, trace._invoke_now, trace._position()))
            return
        trace._model._require_tap(item.at)
        item.invoke = trace._invoke_now
        super().append(item)


class VllmTrace(Trace):
    """`with model.trace(prompt)` / `with model.generate(prompts, max_tokens)`: Trace's recording (saves,
    edits, calls) with Generation's step scopes; runs as one vLLM generate when the block ends."""

    _scoped, all, prefill, decode = Generation._scoped, Generation.all, Generation.prefill, Generation.decode

    def __init__(self, model, prompts, max_tokens, sampling, single):
        if max_tokens < 1:
            raise FragmentsError(f"generate: max_tokens must be a positive integer, got {max_tokens!r}")
        self._model = model
        self._given = bool(prompts)
        self._prompts = [self._prompt(p) for p in prompts]
        self._generate, self._sampling, self._single = max_tokens, dict(sampling), single
        self._sampling.setdefault("temperature", 0.0)
        self._scope = _StepScope()
        self._invokes, self._invoke_now = [], None
        self._steps = _Recorded(self)
        self._callables = _Recorded(self)
        self._counter = itertools.count()
        self._python = []  # edits by expressions: dicts for _python.PyStep (leaves resolved in the workers)
        self._expressions = []  # saved expressions: (SavedValue, node, {id(leaf): SavedValue})
        self._output_invokes = {}  # id(SavedValue of model.output) -> its invoke
        self._saves = []
        self.output = None
        self.iter = _Iter(self)

    def run(self, ids):
        raise FragmentsError("a vLLM trace runs once, at its block's end: run(ids) is fragments.load's "
                             "(Trace.run) and model.plan() has no vLLM counterpart")

    def _position(self):
        """How many plan steps the open invoke (or the trace) has so far: a Python step runs after them and
        before those recorded later, at the same location (_python.attach)."""
        # (with the recording order among Python steps after it: the tuple sorts)
        return (sum(1 for step in self._steps if step.invoke == self._invoke_now), next(self._counter))

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
        if self._invoke_now is not None:
            raise FragmentsError("invoke: invokes do not nest")
        if not self._invokes and (len(self._steps) or len(self._callables) or self._saves or self._python):
            raise FragmentsError("invoke: something was recorded outside the invokes; record inside them")
        self._invoke_now = len(self._invokes)
        self._invokes.append(self._prompt(prompt))
        try:
            yield self
        finally:
            self._invoke_now = None

    def _save_output(self):
        if self._model._logits_at is not None:
            self._model._require_tap(self._model._logits_at, "model.output")
        saved = super()._save_output()
        self._output_invokes[id(saved)] = self._invoke_now
        return saved

    def _leaves(self, node, where, what):
        from .._program import _calls_in
        from .._proxy import Loc, Output, _leaves_of
        if _calls_in(node, []):
            raise FragmentsError(f"{where}: a module called ad hoc runs after the forward: save it; it cannot be "
                                 f"part of {'an edit' if what == 'edit' else 'an expression'} in a vLLM trace")
        leaves = _leaves_of(node)
        for leaf in leaves:
            if isinstance(leaf, Output):
                if what == "edit":
                    raise FragmentsError(f"{where}: model.output exists only after the forward: it cannot be an "
                                         "edit's value")
            elif not isinstance(leaf, Loc):
                raise FragmentsError(f"{where}: {leaf!r}: only locations' values can be read in a vLLM trace")
            elif leaf.visit not in (None, 0):
                raise FragmentsError(f"{where}: {leaf!r}: vLLM calls each module once per forward")
        return leaves

    def _edit_by_expression(self, location, index, do, node, where):
        """An edit whose value is read from locations: a Python step run in the workers (_python.py)."""
        if self._invokes and self._invoke_now is None:
            raise FragmentsError(f"{where}: this trace has invokes: record inside `with tr.invoke(prompt):`")
        if location._visit not in (None, 0):
            raise FragmentsError(f"{where}: vLLM calls each module once per forward: no visit {location._visit}")
        self._model._require_tap(location.name, where)
        for leaf in self._leaves(node, where, "edit"):
            self._model._require_tap(leaf.name, where)  # read by a capture there (_python.py)
            invoke = getattr(leaf, "invoke", None)
            if invoke is not None and invoke >= len(self._invokes):
                raise FragmentsError(f"{where}: {leaf!r} belongs to invoke {invoke}, which this trace does not have")
        self._python.append({"kind": "edit", "at": location.name, "do": do, "node": node, "where": where,
                             "index": None if index is None else _parse_index_text(index),
                             "steps": self._scope.steps, "invoke": self._invoke_now, "pos": self._position()})

    def _save_node(self, node, where):
        """`.save()` of an expression: its locations saved (each in its invoke), computed after the trace."""
        from .._proxy import Loc, Node
        if not isinstance(node, Node):
            raise FragmentsError(f"{where}: save() of {type(node).__name__}: save a value of the trace")
        values = {}
        for leaf in self._leaves(node, where, "save"):
            invoke = getattr(leaf, "invoke", None) if isinstance(leaf, Loc) else None
            now, self._invoke_now = self._invoke_now, invoke if invoke is not None else self._invoke_now
            try:
                values[id(leaf)] = self._save_output() if not isinstance(leaf, Loc) else \
                    self._save(Location(self._model, leaf.name))
            finally:
                self._invoke_now = now
        saved = SavedValue(repr(node))
        self._expressions.append((saved, node, values))
        return saved

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
        if any(name is None and self._output_invokes.get(id(v)) == invoke for v, name in self._saves):
            if self._model._logits_at is None:
                raise FragmentsError("model.output.save(): this vLLM model has no logits processor module")
            entries.append({"at": self._model._logits_at, "do": "save", "as": "__output", "step": "all"})
        if values:
            save_file(values, os.path.join(folder, file))
        return entries, calls

    def _program(self):
        """The trace's Python steps for the workers (_python.PyStep's entries): `.apply` callables, edits by
        expressions, and a capture of every location (and invoke) those expressions read."""
        program, captures = [], set()
        for name, fn, visit, where, steps, invoke, pos in self._callables:
            if visit not in (None, 0):
                raise FragmentsError(f"{name}.visit({visit}).apply: vLLM calls each module once per forward")
            if name == "output" or name == self._model._logits_at:
                raise FragmentsError(f"{name}.apply: the logits cannot be edited here: apply at lm_head's input "
                                     "(the final norm's output)")
            program.append({"kind": "apply", "at": name, "fn": fn, "where": where,
                            "step": _step_of(steps, self._generate), "invoke": invoke, "pos": pos})
        for entry in self._python:
            entry = dict(entry)
            entry["step"] = _step_of(entry.pop("steps"), self._generate)
            program.append(entry)
            from .._proxy import _leaves_of
            for leaf in _leaves_of(entry["node"]):
                invoke = getattr(leaf, "invoke", None)
                captures.add((leaf.name, entry["invoke"] if invoke is None else invoke))
        for name, invoke in sorted(captures, key=lambda c: (c[0], -1 if c[1] is None else c[1])):
            program.append({"kind": "capture", "at": name, "step": "all", "invoke": invoke})
        return program

    def _run(self):
        from . import generate
        if self._invokes and not self._prompts:
            prompts = self._invokes
        elif self._invokes or not self._prompts:
            raise FragmentsError("a trace without prompts needs invokes: `with tr.invoke(prompt):`")
        else:
            prompts = self._prompts
        group = "trace-" + uuid.uuid4().hex
        program = self._program()
        llm = self._model.llm
        folder = tempfile.mkdtemp(prefix="fragments-vllm-trace-")
        try:
            plans, calls = [], {}
            for i in range(len(prompts)):
                invoke = i if self._invokes else None
                if invoke is None and i > 0:
                    entries, calls[i] = plans[0]["interventions"], calls[0]
                else:
                    entries, calls[i] = self._entries(folder, invoke)
                plan = {"interventions": entries, "base": folder, "key": f"{group}.{i}"}
                if program:
                    plan["program"] = [group, invoke]
                plans.append(plan)
            if program:
                import cloudpickle
                llm.collective_rpc("fragments_program", args=(group, cloudpickle.dumps(program)))
            try:
                outputs = generate(llm, prompts, plans, max_tokens=self._generate, **self._sampling)
            finally:
                if program:
                    llm.collective_rpc("fragments_program", args=(group, None))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        for i, out in enumerate(outputs):
            if out.fragments_error:
                raise FragmentsError(out.fragments_error)
            for name, modules in calls[i]:
                out.fragments[name] = self._model._c.call(modules, out.fragments[name])
        if self._invokes:  # each value is its invoke's
            invoke_of = {step.as_: step.invoke for step in self._steps if step.as_}
            for value, name in self._saves:
                i = self._output_invokes.get(id(value)) if name is None else invoke_of[name]
                value._set(outputs[i].fragments.get(name or "__output"))
            self.output = outputs
        else:
            for value, name in self._saves:
                per_prompt = [out.fragments.get(name or "__output") for out in outputs]
                value._set(per_prompt[0] if self._single else per_prompt)
            self.output = outputs[0] if self._single else outputs
        from .._proxy import evaluate
        for saved, node, values in self._expressions:  # several prompts without invokes: one value per prompt
            per_prompt = not self._invokes and not self._single
            saved._set([evaluate(node, lambda leaf, k=k: values[id(leaf)].value[k]) for k in range(len(outputs))]
                       if per_prompt else evaluate(node, lambda leaf: values[id(leaf)].value))


__all__ = ["VLLM", "VllmTrace"]
