"""The steps a trace records: plan steps (Step, run by the C++ engine) and Python steps (PythonStep, run by
fragments.core.executor wherever the whole value is: a rank of fragments.load or of a session, a vLLM worker).

A Step crosses into C++ as it is: fragments._C reads its fields into a runtime::PlanStep (no JSON in between);
`to_json` writes the plan format (fragments.plan/1, runtime/plan.schema.json) only where a plan leaves the
process: a file for `frag run --plan`, a vLLM request.
"""
import dataclasses
import numbers
import operator

import torch

from .errors import FragmentsError


@dataclasses.dataclass
class Step:
    """One plan step: runtime::PlanStep field for field (runtime/plan.h), in Python's names:

        at, do (PlanStep::action as its word), as_ (as), value (value_tensor), value_name (value: what the value
        is, for messages), by, index (the index's text), segment, heads, visit, modules, steps (the generation
        steps it acts at, as written: "prefill", "decode", "k", "a:b"; None: every step), rows (None: all)

    A recorder also sets `where` (the user's file:line) and, in a vLLM trace, `invoke`; neither is a field of
    the plan."""
    at: str
    do: str
    as_: str = ""
    by: float = 1.0
    index: str = None
    visit: int = None
    modules: list = dataclasses.field(default_factory=list)
    value: torch.Tensor = None
    value_name: str = ""
    steps: str = None
    rows: list = None
    segment: str = ""
    heads: list = None

    where = "?"
    invoke = None

    def to_json(self, value_ref=None):
        """The step as a plan entry (`value_ref`: "file.safetensors:name" for set/add)."""
        out = {"at": self.at, "do": self.do}
        if self.as_:
            out["as"] = self.as_
        if self.do == "scale":
            out["by"] = self.by
        if self.index is not None:
            out["index"] = self.index
        if self.segment:
            out["segment"] = self.segment
        if self.heads is not None:
            out["heads"] = list(self.heads)
        if self.visit is not None:
            out["visit"] = self.visit
        if self.modules:
            out["modules"] = list(self.modules)
        if value_ref is not None:
            out["value"] = value_ref
        if self.steps is not None:
            out["steps"] = self.steps
        if self.rows is not None:
            out["rows"] = list(self.rows)
        return out


_STEP_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(Step)))


def plan_key(steps):
    """What identifies a trace's plan, to tell C++ it repeats the last one (a decode loop's trace): every field
    of every Step (lists as tuples); None where a step carries a tensor, which only C++ compares byte for byte."""
    key = []
    for s in steps:
        if s.value is not None:
            return None
        fields = _STEP_FIELDS(s)  # one C call per step: a trace of many saves takes its key per call
        if s.modules or s.rows or s.heads:
            fields = tuple(tuple(v) if isinstance(v, list) else v for v in fields)
        key.append(fields)
    return tuple(key)


@dataclasses.dataclass
class PythonStep:
    """A step that runs in Python on the whole value at `at` (fragments.core.executor), in recorded order with
    the plan steps there:

        kind "edit"     do ("set", "add", "scale") the whole, or `index` of it, by `value` (an expression of
                        the graph, evaluated from the live values of the locations it reads, or a constant)
        kind "apply"    `fn(whole)` returns the replacement or None
        kind "save"     a copy of the whole into `store` (a plan save at a location where Python runs)
        kind "capture"  a copy of the whole kept for an expression computed after the forward

    `steps`/`rows`: the generation scope it was recorded in; `invoke`, `pos`: a vLLM trace's request and its
    place among that request's plan steps (fragments.vllm._python)."""
    kind: str
    at: str
    visit: int = None
    index: object = None
    do: str = None
    value: object = None
    fn: object = None
    where: str = "?"
    steps: str = None
    rows: list = None
    invoke: int = None
    pos: tuple = None
    store: list = None


def index_text(index, where):
    """A basic index (ints, slices, ...) as the plan's text ("...,0:8"); anything else is refused."""
    items = index if isinstance(index, tuple) else (index,)
    parts = []
    for item in items:
        if item is Ellipsis:
            parts.append("...")
        elif isinstance(item, slice):
            for bound in (item.start, item.stop, item.step):
                if bound is not None and not isinstance(bound, numbers.Integral):
                    raise FragmentsError(f"{where}: slice bounds must be integers, got {item}")
            text = f"{'' if item.start is None else item.start}:{'' if item.stop is None else item.stop}"
            parts.append(text + (f":{item.step}" if item.step is not None else ""))
        elif isinstance(item, numbers.Integral) and not isinstance(item, bool):
            parts.append(str(int(item)))
        else:
            raise FragmentsError(f"{where}: only basic indices (integers, slices, ...) select part of a whole "
                                 f"tensor, got {item!r}")
    return ",".join(parts)


def is_basic_index(index):
    """Whether `index` is made of integers, slices and `...` only (what a plan step's index can say)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(item is Ellipsis or (isinstance(item, slice) and all(
        b is None or (isinstance(b, numbers.Integral) and not isinstance(b, bool))
        for b in (item.start, item.stop, item.step))) or (isinstance(item, numbers.Integral) and not isinstance(
            item, bool)) for item in items)


def parse_index_text(text):
    """The plan's index text ("...,0:8", "1,2") back as a Python index."""
    items = []
    for part in text.split(","):
        if part == "...":
            items.append(Ellipsis)
        elif ":" in part:
            items.append(slice(*[int(b) if b else None for b in part.split(":")]))
        else:
            items.append(int(part))
    return tuple(items)
