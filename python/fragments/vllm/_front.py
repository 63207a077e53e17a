"""The front end of fragments in vLLM for an in-process `LLM`: one plan per prompt through `LLM.generate`, the
saves taken back from the workers, a refused plan in its prompt's place (fragments.vllm re-exports these)."""
from __future__ import annotations

import time
import uuid
import weakref
from typing import Any, Dict, List, Optional, Sequence

from ._plan import EXTRA_KEY, RequestPlan


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
    from . import _delivery
    from ._saves import finished_tokens
    from ._stages import merge_takes
    # with the tokens each request produced: rows of steps past them (async scheduling) are left out; saves
    # come back as files in shared memory when the workers are on this machine (_delivery.py)
    t0 = time.perf_counter()
    answers = llm.collective_rpc("fragments_take_saves",
                                 args=({k: finished_tokens.pop(k) for k in keys}, _delivery.route()))
    timings["take_rpc_s"] = time.perf_counter() - t0  # the benchmark's view of what returning saves costs
    first = merge_takes(answers, keys) if any(a is not None for a in answers) else None  # every stage's
    if first is None:
        raise RuntimeError("fragments: no worker answered fragments_take_saves; is the plugin loaded?")
    t0 = time.perf_counter()
    out = {key: {"error": v["error"], "saves": _delivery.tensors(v)} for key, v in first.items()}
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
    record = record_of(llm) if any(specs) else None  # this engine's locations and widths
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


_records: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def record_of(llm) -> dict:
    """inspect(llm), asked once per engine (generate's check of each plan, a VLLM trace's tree): its model's
    locations and widths do not change while it runs, and the RPC took ~1-1.5 ms a generate call on the CPU
    build (a GPU host's is slower). A None answer (no plugin in the workers) is asked again next time."""
    try:
        record = _records.get(llm)
    except TypeError:  # an engine that cannot be weakly referenced: asked every time
        return inspect(llm)
    if record is None:
        record = _records[llm] = inspect(llm)
    return record


def inspect(llm) -> dict:
    """The model's fragment table and locations as the workers classified them (no forward runs):
    {"tp_size", "table", "fragmented": {location: rule text}, "refused": {location: why}, ...}."""
    answers = llm.collective_rpc("fragments_model_record")
    return answers[0]
