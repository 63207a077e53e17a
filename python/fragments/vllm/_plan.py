"""A request's plan: the project's plan JSON (fragments.plan/1, runtime/plan.schema.json; its $defs
vllm_request is this shape) plus, per intervention, the engine steps it
runs at. Parsed by the C++ plan parser (runtime::Plan::from_json via fragments._C.parse_plan), then checked
against the vLLM model's locations. Used twice with the same code: in the front end at submission
(validate_request, through vLLM's input processor: a bad plan fails that request alone, before it runs) and in each
worker when the request first appears in a batch (never raises there: an error is recorded for the
request and its steps are skipped, on every rank alike).

    SamplingParams(extra_args={"fragments": {
        "key": "req-7",                      # saves come back under this key (default: vLLM's request id)
        "base": "/data/steer",               # folder of relative "value" files (default: the worker's cwd)
        "interventions": [
          {"at": "model.layers.0.self_attn.qkv_proj.output", "do": "save", "as": "qkv", "step": 0},
          {"at": "model.layers.1.output", "do": "add", "value": "steer.safetensors:v", "step": "all"}]}})

"step": 0 = the prefill forward (every chunk of it), k = the k-th decode step, a list of those,
"prefill", "decode" or "all" (the default). A parsed plan is a list of Scheduled: each the step itself (a
fragments.core.step.Step as the C++ parser typed it, or a PythonStep of a VLLM trace: _python.py) with the engine
steps it acts at.

Steering vectors registered by name: FRAGMENTS_VLLM_VECTORS names safetensors files (separated by ","),
each tensor a vector under its own name; a plan's "value": "@name" refers to one (resolved here, before
the C++ parser loads it as "file:name"). Every vLLM process inherits the variable from the one started.
"""
from __future__ import annotations

import copy
import difflib
import json
import math
import os
from typing import Dict, List, Optional

import torch

from .. import _C
from ..core.step import PythonStep, Step

EXTRA_KEY = "fragments"
_STEP_WORDS = ("all", "prefill", "decode")


class Scheduled:
    """A step of a request's plan as the workers schedule it: `step` (what acts: a plan Step, or a PythonStep of a
    VLLM trace; its fields read through), `steps` (the engine steps it acts at: "all", "prefill", "decode" or a
    frozenset of step numbers), `logits` (it acts at the logits processor: one row per request), `group` (a
    trace's Python steps: their group, _python.py). `do` is "python" for a Python step."""
    __slots__ = ("step", "at", "do", "steps", "logits", "group", "as_", "index")

    def __init__(self, step, steps, logits: bool, group=None):
        self.step, self.at, self.steps, self.logits, self.group = step, step.at, steps, logits, group
        self.do = "python" if isinstance(step, PythonStep) else step.do
        # read at every step of every request: fields of their own, not through __getattr__
        self.as_, self.index = getattr(step, "as_", None), getattr(step, "index", None)

    def __getattr__(self, name):
        return getattr(self.step, name)

    def runs_at(self, step: int) -> bool:
        s = self.steps
        if s == "all":
            return True
        if s == "prefill":
            return step == 0
        if s == "decode":
            return step > 0
        return step in s


class RequestPlan:
    __slots__ = ("key", "steps", "error")

    def __init__(self, key: str, steps: List[Scheduled], error: Optional[str]):
        self.key, self.steps, self.error = key, steps, error

    @staticmethod
    def parse(spec, req_id: str, record: dict, modules: Optional[set] = None) -> "RequestPlan":
        """`record` is the worker's model record (WorkerState.model_record). Never raises."""
        key = req_id
        try:
            if isinstance(spec, str):  # vLLM's OpenAI server carries vllm_xargs values as text
                spec = json.loads(spec)
            if isinstance(spec, dict):
                key = str(spec.get("key", req_id))
            steps = _parse(spec, record, modules)
            return RequestPlan(key, steps, None)
        except (ValueError, RuntimeError, TypeError, KeyError) as e:  # _C.FragError is a RuntimeError
            return RequestPlan(key, [], f"fragments plan of request {key}: {e}")


def _parse(spec, record: dict, modules: Optional[set]) -> List[Scheduled]:
    if isinstance(spec, str):
        spec = json.loads(spec)
    if isinstance(spec, list):
        spec = {"interventions": spec}
    if not isinstance(spec, dict):
        raise ValueError(f'extra_args["{EXTRA_KEY}"] must be a plan object or list, found {type(spec).__name__}')
    unknown = sorted(set(spec) - {"format", "interventions", "key", "base", "python_steps"})
    if unknown:
        raise ValueError(f'unknown field(s) {unknown}; a request plan has "format", "interventions", "key" and '
                         '"base"')
    ref = spec.get("python_steps")  # [group, invoke]: a VLLM trace's Python steps, registered by RPC (_python.py)
    if ref is not None and not (isinstance(ref, list) and len(ref) == 2 and isinstance(ref[0], str)
                                and (ref[1] is None or isinstance(ref[1], int))):
        raise ValueError(f'"python_steps" must be [group id, invoke number or null], found {json.dumps(ref)}')
    interventions = spec.get("interventions")
    if not isinstance(interventions, list):
        raise ValueError('"interventions" must be a list')
    stripped, step_sets = [], []
    for i, item in enumerate(interventions):
        if not isinstance(item, dict):
            raise ValueError(f"intervention {i} is not an object")
        item = copy.copy(item)
        step_sets.append(engine_steps(item.pop("step", "all"), i))
        stripped.append(item)
    base = spec.get("base") or os.getcwd()
    named = [item.get("value") for item in stripped]  # as the user wrote them ("@steer", not its file)
    for i, item in enumerate(stripped):
        if isinstance(item.get("value"), str) and item["value"].startswith("@"):
            item["value"] = vector_value(item["value"][1:], i)
    plan = {"interventions": stripped}
    if "format" in spec:  # the C++ parser refuses a version it does not read
        plan["format"] = spec["format"]
    parsed = [_typed(d) for d in _C.parse_plan(json.dumps(plan), "request plan", base,
                                               _table_text(record["table"]), record["qkv_attributes"])]
    module_set = modules if modules is not None else set(record["modules"])
    steps = []
    for i, d in enumerate(parsed):
        at = d.at
        path, _, side = at.rpartition(".")
        where = f"intervention {i} at {at}"
        if side not in ("input", "output") or path not in module_set:
            raise ValueError(f"{where}: no such location; expected <module path>.input or .output of this vLLM "
                             f"model (e.g. model.layers.0.mlp.down_proj.input){_did_you_mean(at, module_set)}")
        if side == "input" and path in record.get("logits_modules", ()):
            raise ValueError(f"{where}: vLLM's logits processor takes the LM head module first, not a tensor; "
                             "the hidden states it reads are the final norm's output (e.g. model.norm.output)")
        if at in record["refused"]:
            raise ValueError(f"{where}: {record['refused'][at]}")
        if record.get("compiled") and at not in (record.get("taps") or ()):
            raise ValueError(f"{where}: this vLLM engine is compiled (enforce_eager=False) and {at} is not tapped; "
                             "the compiled graph is fixed at start: declare it with LLM(..., additional_config="
                             f'{{"fragments_taps": ["{at}"]}}) (globs allowed), or use enforce_eager=True')
        if d.do == "call":
            raise ValueError(f'{where}: "call" (ad-hoc module calls, logit lens) is not supported inside vLLM yet')
        if d.visit not in (None, 0):
            raise ValueError(f'{where}: "visit" {d.visit}: vLLM calls each module once per forward; use 0')
        if d.index or isinstance(d.value, torch.Tensor):
            _check_fits(d, (record.get("widths") or {}).get(at), where, named[i])
        steps.append(Scheduled(d, step_sets[i], path in record.get("logits_modules", ())))
    return steps


_table_texts: dict = {}  # id(table) -> (the table, its JSON text): one model's table, written once


def _table_text(table) -> str:
    """The fragment table as the C++ parser reads it, written once per table (a worker parses every request's
    plan with the same one; the parser reads it only for "segment"/"heads" steps)."""
    kept = _table_texts.get(id(table))
    if kept is None or kept[0] is not table:
        _table_texts.clear()
        kept = _table_texts[id(table)] = (table, json.dumps(table))
    return kept[1]


def _typed(d: dict) -> Step:
    """A step as the C++ parser returns it (runtime::PlanStep's fields, "segment"/"heads" resolved into the index)."""
    return Step(at=d["at"], do=d["do"], as_=d["as"], by=d["by"], index=d["index"], visit=d["visit"],
                modules=d["modules"], value=d["value"], value_name=d["value_name"])


def _did_you_mean(at: str, modules) -> str:
    """The closest locations to a typo, as frag run's and LanguageModel's messages give them."""
    close = difflib.get_close_matches(at[:300], [f"{p}.{s}" for p in modules for s in ("input", "output")], n=3,
                                      cutoff=0.8)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _check_fits(d: Step, width: Optional[int], where: str, named) -> None:
    """An index or a value that cannot fit its location, refused at submission where the location's width is
    known (record["widths"]) and the index, if any, keeps the rows whole ("...,a:b", "segment"/"heads"): the
    index must select within the width, and a value's last dims must broadcast to the target's (the rows,
    unknown until it runs, must be 1 or match)."""
    index = d.index
    if width is None or (index and not index.lstrip().startswith("...")):
        return
    probe = torch.empty((1, width), device="meta")
    try:
        target = _C.index_view(index, probe, d.at) if index else probe
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{where}: index {index}: {e}") from None
    if d.do not in ("add", "set") or not isinstance(d.value, torch.Tensor):
        return
    value = tuple(d.value.shape)
    fits = len(value) <= len(target.shape) and all(
        v in (1, t) for v, t in zip(value[::-1], target.shape[1:][::-1]))
    if not fits:
        into = f"its index {index} selects [rows, {', '.join(map(str, target.shape[1:]))}]" if index else \
            f"it holds [rows, {width}]"
        raise ValueError(f"{where}: the value of shape {list(value)} ({named}) does not fit: {into}")


def engine_steps(value, i):
    if isinstance(value, str):
        if value not in _STEP_WORDS:
            raise ValueError(f'intervention {i}: "step" "{value}" is not one of {", ".join(_STEP_WORDS)} or a '
                             "step number")
        return value
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f'intervention {i}: "step" must be "all", "prefill", "decode", a step number '
                         f"(0 = prefill, k = k-th decode step) or a list of them, found {json.dumps(value)}")
    return frozenset(values)


_vectors_cache: Dict[str, Dict[str, str]] = {}


def registered_vectors() -> Dict[str, str]:
    """Vector name -> "abs/file.safetensors:name" from FRAGMENTS_VLLM_VECTORS (read once per value of the
    variable). Raises ValueError naming the file for a missing file or a name given twice."""
    spec = os.environ.get("FRAGMENTS_VLLM_VECTORS", "")
    if spec in _vectors_cache:
        return _vectors_cache[spec]
    from safetensors import safe_open
    vectors: Dict[str, str] = {}
    for path in filter(None, (p.strip() for p in spec.split(","))):
        path = os.path.abspath(path)
        try:
            with safe_open(path, framework="pt") as f:
                names = list(f.keys())
        except Exception as e:  # safetensors raises its own error types for a bad file
            raise ValueError(f"FRAGMENTS_VLLM_VECTORS: {path}: expected a safetensors file, found: {e}") from None
        for name in names:
            if name in vectors:
                raise ValueError(f"FRAGMENTS_VLLM_VECTORS: {path}: vector {name!r} is also in "
                                 f"{vectors[name].rsplit(':', 1)[0]}; names must be unique")
            vectors[name] = f"{path}:{name}"
    _vectors_cache[spec] = vectors
    return vectors


def vector_value(name: str, i: int) -> str:
    vectors = registered_vectors()
    if name not in vectors:
        known = ", ".join(sorted(vectors)) or "none (FRAGMENTS_VLLM_VECTORS is unset)"
        raise ValueError(f'intervention {i}: "value" "@{name}": no steering vector of that name; registered: '
                         f"{known}")
    return vectors[name]


# ---- plans from untrusted clients (the OpenAI server's bodies) ------------------------------------------
# Checked before the C++ parser or the engine sees them, so that any body costs the server a bounded time and
# memory and gets one line back. A valid plan is far inside every bound.
UNTRUSTED_SETTINGS = {
    "FRAGMENTS_VLLM_MAX_PLAN_BYTES": (256 << 10, "bytes of a plan's JSON text"),
    "FRAGMENTS_VLLM_MAX_PLAN_STEPS": (1024, "interventions in one plan"),
}
PLAN_DEPTH = 4  # plan object > "interventions" > a step > its list of "heads" or "step"
MAX_TEXT = 1024  # characters of one string (a location, an index, a name)
MAX_ITEMS = 4096  # items of a step's list ("heads", "step"), fields of an object
MAX_SCALE = 1e4  # |"by"|: a larger factor overflows half-precision activations (65504) from 6.6 up
MAX_INT = 1 << 53  # integers a double holds exactly (the C++ parser's JSON numbers)


def untrusted_setting(name: str) -> int:
    default, what = UNTRUSTED_SETTINGS[name]
    text = os.environ.get(name) or str(default)
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"{name}={text!r}: expected a positive whole number ({what}; default {default})")
    return int(text)


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number; plans hold finite numbers only")


def load_untrusted(spec) -> dict:
    """A plan as a client's body carries it (its JSON text, or the object the body's JSON held) -> the plan
    object, within the bounds above. Raises ValueError with the one line the client gets."""
    if isinstance(spec, str):
        limit = untrusted_setting("FRAGMENTS_VLLM_MAX_PLAN_BYTES")
        if len(spec) > limit:
            raise ValueError(f"the plan is {len(spec)} bytes of JSON, over the server's {limit} "
                             "(FRAGMENTS_VLLM_MAX_PLAN_BYTES)")
        try:
            spec = json.loads(spec, parse_constant=_no_constant)
        except RecursionError:
            raise ValueError(f"the plan is nested deeper than JSON can be read here; a plan nests at most "
                             f"{PLAN_DEPTH} levels (plan, interventions, step, a list of heads or steps)") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"expected a plan (JSON object or list), found invalid JSON: {e}") from None
    _bounded(spec)
    if isinstance(spec, list):
        spec = {"interventions": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"expected a plan object or list, found {type(spec).__name__}")
    steps = spec.get("interventions")
    limit = untrusted_setting("FRAGMENTS_VLLM_MAX_PLAN_STEPS")
    if isinstance(steps, list) and len(steps) > limit:
        raise ValueError(f"the plan has {len(steps)} interventions, over the server's {limit} "
                         "(FRAGMENTS_VLLM_MAX_PLAN_STEPS)")
    for i, step in enumerate(steps if isinstance(steps, list) else ()):
        by = step.get("by") if isinstance(step, dict) else None
        if isinstance(by, (int, float)) and not isinstance(by, bool) and abs(by) > MAX_SCALE:
            raise ValueError(f'intervention {i}: "by" {by:g} is larger than {MAX_SCALE:g} in size (it would '
                             "overflow half-precision activations); scale by less")
    return spec


def _bounded(value) -> None:
    """Depth, sizes and numbers of a parsed plan, walked without recursion."""
    stack = [(value, 0, "the plan")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= PLAN_DEPTH:
                raise ValueError(f"{where} nests deeper than a plan can: a plan nests at most {PLAN_DEPTH} levels "
                                 "(plan, interventions, step, a list of heads or steps)")
            items = list(v.items()) if isinstance(v, dict) else list(enumerate(v))
            if len(items) > MAX_ITEMS and depth > 0:
                raise ValueError(f"{where} has {len(items)} items; at most {MAX_ITEMS}")
            for k, item in items:
                if isinstance(k, str) and len(k) > MAX_TEXT:
                    raise ValueError(f"{where} has a field name of {len(k)} characters; at most {MAX_TEXT}")
                stack.append((item, depth + 1, f"{where}[{json.dumps(k) if isinstance(k, str) else k}]"[:200]))
        elif isinstance(v, str) and len(v) > MAX_TEXT:
            raise ValueError(f"{where} is a string of {len(v)} characters; at most {MAX_TEXT}")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{where} is {v}; plans hold finite numbers only")
        elif isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
            raise ValueError(f"{where} is an integer of {v.bit_length()} bits; at most 2^53 in size")

