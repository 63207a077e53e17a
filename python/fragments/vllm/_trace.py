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
head through vLLM's logits processor). Not here: `.apply` callables, edits whose value is read from a
location, `gen.rows` (every prompt is its own request: use one generate per plan).
"""
from __future__ import annotations

import os
import shutil
import tempfile


from .. import _C
from .._generate import Generation, _Iter, _ScopedSteps, _StepScope
from .._model import FragmentsError, Module, Trace, _Logits


class VLLM:
    """A vLLM `LLM` (eager mode, fragments' plugin loaded) whose module tree can be traced."""

    def __init__(self, model=None, llm=None, tensor_parallel_size=1, dtype="float32", **llm_kwargs):
        from . import inspect
        if llm is None:
            from vllm import LLM
            llm_kwargs.setdefault("enforce_eager", True)
            llm = LLM(model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, **llm_kwargs)
        self.llm = llm
        record = inspect(llm)
        if record is None:
            raise FragmentsError("fragments' vLLM plugin is not loaded in this engine's workers (VLLM_PLUGINS "
                                 "unset or listing 'fragments', and FRAGMENTS_VLLM not 0)")
        if record.get("compiled"):
            raise FragmentsError("tracing needs vLLM's eager mode: start the engine with enforce_eager=True")
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

    def trace(self, prompt, **sampling):
        """One forward of one prompt (a prefill that samples one token)."""
        return VllmTrace(self, [prompt], 1, sampling, single=True)

    def generate(self, prompts, max_tokens=1, **sampling):
        """Generation of each prompt (its own request, the same plan); saves give one value per prompt when
        there are several. Greedy unless `temperature` is given."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        return VllmTrace(self, [prompts] if single else list(prompts), int(max_tokens), sampling, single)

    def _head_layout(self, location):
        if location not in self._layouts:
            import json
            self._layouts[location] = _C.head_layout(json.dumps(self._record["table"]), location,
                                                     self._record["qkv_attributes"])
        return self._layouts[location]

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
        answer = answers[0]
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


class VllmTrace(Trace):
    """`with model.trace(prompt)` / `with model.generate(prompts, max_tokens)`: Trace's recording (saves,
    edits, calls) with Generation's step scopes; runs as one vLLM generate when the block ends."""

    _scoped, all, prefill, decode = Generation._scoped, Generation.all, Generation.prefill, Generation.decode

    def __init__(self, model, prompts, max_tokens, sampling, single):
        if max_tokens < 1:
            raise FragmentsError(f"generate: max_tokens must be a positive integer, got {max_tokens!r}")
        self._model = model
        self._prompts = [{"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) else p for p in prompts]
        self._generate, self._sampling, self._single = max_tokens, dict(sampling), single
        self._sampling.setdefault("temperature", 0.0)
        self._scope = _StepScope()
        self._steps = _ScopedSteps(self._scope)
        self._callables = []
        self._saves = []
        self.output = None
        self.iter = _Iter(self)

    def rows(self, rows):
        raise FragmentsError("gen.rows: in vLLM every prompt is its own request; give each plan its own generate")

    def _entries(self, folder):
        """The recorded steps as one request plan (values in folder/values.safetensors); the saves that are
        module calls, as (name, modules)."""
        from safetensors.torch import save_file
        values, entries, calls = {}, [], []
        for i, step in enumerate(self._steps):
            ref = None
            if step.value is not None:
                values[f"v{i}"] = step.value.contiguous()
                ref = f"values.safetensors:v{i}"
            entry = step.to_json(ref)
            entry.pop("steps", None)
            entry["step"] = _step_of(step.steps, self._generate)
            if step.do == "call":  # saved here, called after the forward (see the module's docstring)
                calls.append((step.as_, list(step.modules)))
                entry["do"] = "save"
                entry.pop("modules")
            entries.append(entry)
        if any(name is None for _, name in self._saves):
            if self._model._logits_at is None:
                raise FragmentsError("model.output.save(): this vLLM model has no logits processor module")
            entries.append({"at": self._model._logits_at, "do": "save", "as": "__output", "step": "all"})
        if values:
            save_file(values, os.path.join(folder, "values.safetensors"))
        return entries, calls

    def _run(self):
        from . import generate
        if self._callables:
            raise FragmentsError(".apply(fn) inside vLLM: Python callables do not run in vLLM's workers here; "
                                 "save the value and compute after the trace")
        folder = tempfile.mkdtemp(prefix="fragments-vllm-trace-")
        try:
            entries, calls = self._entries(folder)
            plan = {"interventions": entries, "base": folder}
            outputs = generate(self._model.llm, self._prompts, [plan] * len(self._prompts),
                               max_tokens=self._generate, **self._sampling)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        for out in outputs:
            if out.fragments_error:
                raise FragmentsError(out.fragments_error)
            for name, modules in calls:
                out.fragments[name] = self._model._c.call(modules, out.fragments[name])
        for value, name in self._saves:
            per_prompt = [out.fragments.get(name or "__output") for out in outputs]
            value._set(per_prompt[0] if self._single else per_prompt)
        self.output = outputs[0] if self._single else outputs


__all__ = ["VLLM", "VllmTrace"]
