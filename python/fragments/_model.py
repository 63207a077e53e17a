"""The model object, its module tree, and traces that run as one typed plan in the C++ runtime.

`load(path)` returns a Model whose attributes mirror the module tree of the rank file. Inside
`with model.trace(ids):` reads (`.save()`), edits (`loc[...] += v`, `loc.output = t`, `*=`), ad-hoc
calls (`model.lm_head(model.model.norm(loc))`) and Python callables (`loc.apply(fn)`) are only
recorded; when the block ends they become one plan (steps of runtime/plan.h: each Step's to_json, the
format runtime/plan.schema.json defines, handed to C++'s plan parser as Python objects, never as text)
and one forward runs in C++ with the GIL released.
"""
import dataclasses
import difflib
import json
import numbers
import operator
import os
import warnings

import torch

from . import _C
from ._exported import ExportedRunner
from ._launch import rank_context


class FragmentsError(_C.FragError):
    """Misuse of the Python API, said in the user's words (a subclass of the runtime's FragError)."""


def _did_you_mean(name, candidates):
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


@dataclasses.dataclass
class Step:
    """One plan step (runtime::PlanStep), as recorded by a trace; to_json is the step in the plan format
    (fragments.plan/1, runtime/plan.schema.json), which C++ parses into the step it runs."""
    at: str
    do: str
    as_: str = ""
    by: float = 1.0
    index: str = None
    visit: int = None
    modules: list = dataclasses.field(default_factory=list)
    value: torch.Tensor = None
    value_name: str = ""
    steps: str = None   # generation steps it acts at ("prefill", "decode", "k", "a:b"); None: every step
    rows: list = None   # batch rows it acts on; None: all

    def to_json(self, value_ref=None):
        """The step as a JSON plan entry (`value_ref`: "file.safetensors:name" for set/add)."""
        out = {"at": self.at, "do": self.do}
        if self.as_:
            out["as"] = self.as_
        if self.do == "scale":
            out["by"] = self.by
        if self.index is not None:
            out["index"] = self.index
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


def _index_text(index, where):
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


class SavedValue:
    """What `.save()` returns: the whole tensor once its trace has run (a list when several visits)."""

    def __init__(self, what):
        self._what = what
        self._ready = False
        self._value = None
        self._post = None  # a view of the saved whole (a head), applied when the value arrives

    def _set(self, value):
        if self._post is not None:
            value = [self._post(v) for v in value] if isinstance(value, list) else self._post(value)
        self._value, self._ready = value, True

    @property
    def value(self):
        if not self._ready:
            raise FragmentsError(f"{self._what}.save() was read before its trace ran: a saved value exists "
                                 "once the `with model.trace(...)` block has ended")
        return self._value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.value if isinstance(x, SavedValue) else x  # noqa: E731
        args = [unwrap(a) for a in args]
        kwargs = {k: unwrap(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.value, name)

    def __getitem__(self, index):
        return self.value[index]

    def __len__(self):
        return len(self.value)

    def __repr__(self):
        return f"SavedValue({self._what}: {self._value!r})" if self._ready else f"SavedValue({self._what}, pending)"

    def __add__(self, other): return self.value + _unwrap(other)
    def __radd__(self, other): return _unwrap(other) + self.value
    def __sub__(self, other): return self.value - _unwrap(other)
    def __rsub__(self, other): return _unwrap(other) - self.value
    def __mul__(self, other): return self.value * _unwrap(other)
    def __rmul__(self, other): return _unwrap(other) * self.value
    def __truediv__(self, other): return self.value / _unwrap(other)
    def __neg__(self): return -self.value


def _unwrap(x):
    return x.value if isinstance(x, SavedValue) else x


class _Pending:
    """`loc[idx] += v` is `t = loc[idx]; t = t.__iadd__(v); loc[idx] = t`: the middle step makes this."""

    def __init__(self, location, index, do, operand):
        self.location, self.index, self.do, self.operand = location, index, do, operand


class _InPlaceEdits:
    """`+=`, `-=`, `*=` on a location or a selection of its whole tensor: each makes a _Pending edit of
    `_target()`, (the location, the index text or None for all of it)."""

    def _target(self):
        raise NotImplementedError

    def __iadd__(self, value):
        location, index = self._target()
        return _Pending(location, index, "add", value)

    def __isub__(self, value):
        location, index = self._target()
        if _is_expression(value):
            return _Pending(location, index, "add", -value)
        return _Pending(location, index, "add", -_as_tensor_or_number(value, location))

    def __imul__(self, value):
        location, index = self._target()
        return _Pending(location, index, "scale", value)


class _Expression:
    """A value of a trace that computes: arithmetic, indexing, tensor methods, torch functions, `.shape`
    and `.dtype` make an expression (fragments._proxy) whose `.save()` is computed after the forward, on
    this rank's whole tensors; as an edit's value it runs during the forward, as a callable (`.apply`)."""

    def _node(self):
        raise NotImplementedError

    def _model_here(self):
        raise NotImplementedError

    def _expression(self):
        from ._proxy import Proxy
        return Proxy(self._model_here()._active_trace("an expression"), self._node())

    def _tensor_attribute(self, name):
        if name in ("shape", "dtype", "ndim") or callable(getattr(torch.Tensor, name, None)):
            return getattr(self._expression(), name)
        return None

    def __getitem__(self, index):
        return self._expression()[index]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from ._proxy import Proxy
        to = lambda x: x._expression() if isinstance(x, _Expression) else x  # noqa: E731
        return Proxy.__torch_function__(func, types, [to(a) for a in args],
                                        {k: to(v) for k, v in (kwargs or {}).items()})

    def __neg__(self):
        return -self._expression()

    def __abs__(self):
        return abs(self._expression())

    def size(self, dim=None):
        return self._expression().size(dim)

    __hash__ = object.__hash__


def _forward_operator(name):
    return lambda self, other: getattr(self._expression(), name)(other)


for _name in ("add", "sub", "mul", "truediv", "matmul", "pow"):
    setattr(_Expression, f"__{_name}__", _forward_operator(f"__{_name}__"))
    setattr(_Expression, f"__r{_name}__", _forward_operator(f"__r{_name}__"))
for _name in ("floordiv", "mod", "lt", "le", "gt", "ge", "and", "or"):
    setattr(_Expression, f"__{_name}__", _forward_operator(f"__{_name}__"))


def _loc_node(location):
    from ._proxy import Loc
    node = Loc(location.name, location._visit)
    if getattr(location, "_invoke", None) is not None:  # a vLLM trace's invoke (prompt) the value belongs to
        node.invoke = location._invoke
    return node


def _is_expression(value):
    from ._proxy import Proxy
    return isinstance(value, (Proxy, _Expression))


class _View(_InPlaceEdits, _Expression):
    """`loc[idx]`: a selection of the whole tensor at a location: for in-place operators, and a value."""

    def __init__(self, location, index):
        self._location, self._python_index = location, index

    @property
    def _index(self):
        return _index_text(self._python_index, self._location.name)

    def _target(self):
        return self._location, self._index

    def _node(self):
        from ._proxy import Op
        import operator
        return Op(operator.getitem, (_loc_node(self._location), self._python_index))

    def _model_here(self):
        return self._location._model

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        found = self._tensor_attribute(name)
        if found is None:
            raise AttributeError(f"{self._location.name}[...] has no attribute {name!r}")
        return found

    def __itruediv__(self, value):
        if not isinstance(value, numbers.Real):
            raise FragmentsError(f"{self._location.name}: /= takes a number")
        return _Pending(self._location, self._index, "scale", 1.0 / value)

    def save(self):
        return self._expression().save()


def _as_tensor_or_number(value, location):
    value = _unwrap(value)
    if isinstance(value, (torch.Tensor, numbers.Real)):
        return value
    raise FragmentsError(f"{location.name}: an edit takes a tensor or a number, got {type(value).__name__}")


class Location(_InPlaceEdits, _Expression):
    """A location (`<module>.input`, `<module>.output`; the model's output is its logits)."""

    def __init__(self, model, name, visit=None):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_visit", visit)
        # fragments.vllm's traces: the invoke open when the location was taken (its value is that prompt's)
        object.__setattr__(self, "_invoke", getattr(getattr(model, "_trace", None), "_invoke_now", None))

    def _regions(self):
        return self._model._head_layout(self.name)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        regions = self._regions()
        if name == "heads" and "heads" in regions:  # o_proj.input: the heads are the whole width
            start, stop, head_dim = regions["heads"]
            return _Heads(_Region(self, start, stop, head_dim, self.name))
        if name in regions:
            start, stop, head_dim = regions[name]
            return _Region(self, start, stop, head_dim, f"{self.name}.{name}")
        if name == "heads":
            raise AttributeError(f"{self.name} has no heads of its own: take them from a segment "
                                 f"({', '.join('.' + r for r in regions) or 'none here'})")
        found = self._tensor_attribute(name)
        if found is not None:
            return found
        options = list(regions) + ["save", "apply", "visit", "all"]
        raise AttributeError(f"location {self.name} has no attribute {name!r}{_did_you_mean(name, options)}")

    def __setattr__(self, name, value):
        regions = self._regions()
        if name not in regions:
            raise AttributeError(f"location {self.name}: only its segments ({', '.join(regions) or 'none'}) "
                                 f"can be assigned, not {name!r}")
        start, stop, _ = regions[name]
        self._model._active_trace(f"{self.name}.{name} = ...")._edit(self, f"...,{start}:{stop}", value)

    def _where(self):
        return self.name + (f" (visit {self._visit})" if self._visit is not None else "")

    def visit(self, k):
        """Only the k-th call of the module in a forward (0-based)."""
        if not isinstance(k, numbers.Integral) or k < 0:
            raise FragmentsError(f"{self.name}: visit takes a non-negative integer, got {k!r}")
        return Location(self._model, self.name, int(k))

    def all(self):
        """Every visit (the default): `.save()` then gives a list when the module runs more than once."""
        return Location(self._model, self.name, None)

    def save(self):
        trace = self._model._active_trace(f"{self.name}.save()")
        return trace._save(self)

    def apply(self, fn):
        """Runs `fn(whole)` at every visit (or `.visit(k)`'s); it returns the replacement or None."""
        if not callable(fn):
            raise FragmentsError(f"{self.name}.apply takes a callable, got {type(fn).__name__}")
        trace = self._model._active_trace(f"{self.name}.apply()")
        trace._callables.append((self.name, fn, self._visit, f"apply#{len(trace._callables)}"))

    def __getitem__(self, index):
        return _View(self, index)

    def _node(self):
        return _loc_node(self)

    def _model_here(self):
        return self._model

    def __setitem__(self, index, value):
        self._model._active_trace(f"{self.name}[...] = ...")._edit(self, _index_text(index, self.name), value)

    def _target(self):
        return self, None

    def __repr__(self):
        return f"<location {self._where()}>"


class _Region(_InPlaceEdits, _Expression):
    """A part of a location's last dim in whole coordinates: a q/k/v segment, all heads, or one head
    (`.heads[i]`). Edits become plan steps with an index; a save is the whole location's, sliced after
    the trace. Across ranks the runtime takes reads from one copy of a replicated kv head and lands edits
    on every copy (the split of the segments rule)."""

    def __init__(self, location, start, stop, head_dim, what):
        self._location, self._start, self._stop, self._head_dim, self._what = location, start, stop, head_dim, what

    @property
    def index(self):
        return f"...,{self._start}:{self._stop}"

    @property
    def heads(self):
        return _Heads(self)

    def save(self):
        start, stop = self._start, self._stop
        trace = self._location._model._active_trace(f"{self._what}.save()")
        return trace._save(self._location, post=lambda t: t[..., start:stop], what=self._what)

    def _target(self):
        return self._location, self.index

    def _node(self):
        from ._proxy import Op
        import operator
        return Op(operator.getitem, (_loc_node(self._location), (Ellipsis, slice(self._start, self._stop))))

    def _model_here(self):
        return self._location._model

    def __repr__(self):
        return f"<{self._what}: [..., {self._start}:{self._stop}] of {self._location.name}>"


class _Heads:
    """`region.heads[i]`: head i of a segment (head_dim wide), in whole coordinates."""

    def __init__(self, region):
        self._region = region
        self._count = (region._stop - region._start) // region._head_dim

    def __len__(self):
        return self._count

    def __getitem__(self, i):
        if not isinstance(i, numbers.Integral) or not -self._count <= i < self._count:
            raise IndexError(f"{self._region._what}.heads[{i!r}]: it has {self._count} heads (0 to {self._count - 1})")
        i %= self._count
        r, d = self._region, self._region._head_dim
        return _Region(r._location, r._start + i * d, r._start + (i + 1) * d, d, f"{r._what}.heads[{i}]")

    def __setitem__(self, i, value):
        head = self[i]
        head._location._model._active_trace(f"{head._what} = ...")._edit(head._location, head.index, value)


class _Logits(Location):
    """`model.output`: the forward's result (logits; tokens under generate). Only `.save()`."""

    def save(self):
        return self._model._active_trace("model.output.save()")._save_output()

    def __setitem__(self, index, value):
        raise FragmentsError("model.output (the logits) cannot be edited: edit lm_head's input or output")

    def _node(self):
        from ._proxy import Output
        return Output()


class _CallChain(_Expression):
    """An ad-hoc call recorded at a location: `model.lm_head(model.model.norm(loc))`."""

    def __init__(self, location, modules):
        self._location, self._modules = location, modules

    def _node(self):
        from ._proxy import Call
        return Call(self._modules, _loc_node(self._location))

    def _model_here(self):
        return self._location._model

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        found = self._tensor_attribute(name)
        if found is None:
            raise AttributeError(f"{self._modules[-1]}(...) has no attribute {name!r}")
        return found

    def save(self):
        trace = self._location._model._active_trace(f"{self._modules[-1]}(...).save()")
        return trace._save_call(self._location, self._modules)


class Module:
    """A module of the rank file: attributes are its submodules, `.input`/`.output` its locations."""

    def __init__(self, model, path):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_numbered", None)  # a ModuleList's submodules by index, made once

    def _child(self, name):
        return f"{self._path}.{name}" if self._path else name

    def _location(self, side):
        name = self._child(side)
        if name not in self._model._location_kinds:
            known = [s for s in ("input", "output") if self._child(s) in self._model._location_kinds]
            raise AttributeError(f"{self._path or 'the model'} has no location .{side} "
                                 f"({'it has ' + ', '.join('.' + k for k in known) if known else 'none there'}; "
                                 "`frag inspect --all` lists every location)")
        return Location(self._model, name)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        children = self._model._children.get(self._path, [])
        if name in children:
            child = Module(self._model, self._child(name))
            if not hasattr(Module, name):  # kept as an attribute: the next walk (every save's) finds it at once
                object.__setattr__(self, name, child)
            return child
        if name in ("input", "output"):
            return self._location(name)
        options = list(children) + [s for s in ("input", "output") if self._child(s) in self._model._location_kinds]
        raise AttributeError(f"{self._path or 'the model'} has no attribute {name!r}{_did_you_mean(name, options)}")

    def __setattr__(self, name, value):
        if name not in ("input", "output"):
            raise AttributeError(f"{self._path or 'the model'}: only .input and .output can be assigned "
                                 f"(edits inside a trace), not {name!r}")
        location = self._location(name)
        self._model._active_trace(f"{location.name} = ...")._edit(location, None, value)

    def __getitem__(self, i):
        numbered = self._numbered
        if numbered is None:
            count = len([c for c in self._model._children.get(self._path, []) if c.isdigit()])
            numbered = [Module(self._model, self._child(str(k))) for k in range(count)]
            object.__setattr__(self, "_numbered", numbered)
        if not numbered:
            raise TypeError(f"{self._path or 'the model'} is not a ModuleList: it cannot be indexed")
        if not isinstance(i, numbers.Integral):
            raise TypeError(f"{self._path}[{i!r}]: index a ModuleList with an integer")
        n = len(numbered)
        if not -n <= i < n:
            raise IndexError(f"{self._path}[{i}]: it has {n} modules (0 to {n - 1})")
        return numbered[i]

    def __len__(self):
        return len([c for c in self._model._children.get(self._path, []) if c.isdigit()])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __call__(self, x):
        """Runs this module ad hoc on a whole tensor (recorded inside a trace when `x` is a location)."""
        if isinstance(x, (Location, _CallChain)):
            if isinstance(x, _Logits):
                raise FragmentsError("model.output (the logits) cannot feed an ad-hoc call")
            problem = self._model._c.callable(self._path)
            if problem:
                raise FragmentsError(problem)
            if isinstance(x, Location):
                return _CallChain(x, [self._path])
            return _CallChain(x._location, x._modules + [self._path])
        from ._proxy import Call, Proxy, as_node, user_line
        if isinstance(x, Proxy):  # an expression: the call runs after the forward, on its value
            problem = self._model._c.callable(self._path)
            if problem:
                raise FragmentsError(problem)
            node = Call([self._path], as_node(x))
            node.where = user_line()
            return Proxy(x._trace, node)
        x = _unwrap(x)
        if not isinstance(x, torch.Tensor):
            raise FragmentsError(f"{self._path}(...) takes a whole tensor or a location, got {type(x).__name__}")
        return self._model._c.call([self._path], x)

    def __repr__(self):
        return f"<module {self._path or '(root)'} ({self._model._classes.get(self._path, '?')})>"


class Trace:
    """The recording of one `with model.trace(ids):` block; runs when the block ends."""

    _plan = False  # model.plan()'s recording: it runs at run(ids), not at its block's end (a class default:
    # fragments.vllm's trace inherits __exit__)

    def __init__(self, model, ids, generate=0):
        self._model = model
        self._plan = ids is None
        self._ids, self.lengths = (None, None) if ids is None else _batch(ids)
        self._generate = generate
        self._captured, self._expressions = {}, []  # saved expressions: their leaves' saves, (value, node, line)
        self._hooks, self._live = {}, {}            # edits by expressions: callables at locations
        self._steps = _StepsWithLines()  # each step remembers the user's file:line (errors name it)
        self._callables = []
        self._saves = []   # (SavedValue, name) ; name None for the output
        self._key = None   # _plan_key(self._steps), taken at the first run: a run again reuses it
        self._ran = False
        self.output = None

    def __enter__(self):
        if self._model._trace is not None:
            raise FragmentsError("a trace of this model is already open: traces do not nest")
        self._model._trace = self
        return self

    def __exit__(self, kind, value, tb):
        self._model._trace = None
        if kind is None and not self._plan:
            self._run()
        return False

    def run(self, ids):
        """Runs this recording again on `ids` (a plan of `model.plan()`, or a trace after its block): one
        forward, with nothing recorded again and, while it is the plan this model ran last, nothing parsed
        or checked again. Its `.save()`s then hold this run's values (a `.value` read before keeps the
        earlier tensor); returns the output (the logits)."""
        if self._model._trace is self:
            raise FragmentsError("run(ids): the recording is still open: run it after its `with` block")
        if self._model._trace is not None:  # a forward now would run in the middle of another recording
            raise FragmentsError("run(ids) inside another trace of this model: run it after that block")
        self._ids, self.lengths = _batch(ids)
        self._run()
        return self.output

    def _name(self):
        return f"save{len(self._steps)}"

    def _save(self, location, post=None, what=None):
        step = Step(at=location.name, do="save", as_=self._name(), visit=location._visit)
        self._steps.append(step)
        saved = SavedValue(what or location._where())
        saved._post = post
        self._saves.append((saved, step.as_))
        return saved

    def _save_output(self):
        saved = SavedValue("model.output")
        self._saves.append((saved, None))
        return saved

    def _save_call(self, location, modules):
        step = Step(at=location.name, do="call", as_=self._name(), visit=location._visit, modules=list(modules))
        self._steps.append(step)
        saved = SavedValue(f"{'('.join(modules[::-1])}({location._where()}{')' * len(modules)}")
        self._saves.append((saved, step.as_))
        return saved

    def unpad(self, value):
        """Each row of a ragged batch's value trimmed to its prompt's tokens (a list of tensors)."""
        return unpad(value, self.lengths)

    def _save_node(self, node, where):
        """`.save()` of an expression: its locations saved by the plan, the value computed after the forward."""
        from . import _program
        from ._proxy import Node
        if getattr(self, "_expressions", None) is None:
            raise FragmentsError(f"{where}: expressions in fragments.load's model.generate: save the location and "
                                 "compute after, or use a LanguageModel")
        if not isinstance(node, Node):
            raise FragmentsError(f"{where}: save() of {type(node).__name__}: save a value of the trace")
        for leaf in _leaf_nodes(node, where):
            key = _program._leaf_key(leaf)
            if key not in self._captured:
                self._captured[key] = (self._save_output() if key[0] == "output"
                                       else self._save(Location(self._model, leaf.name, leaf.visit)))
        saved = SavedValue(repr(node))
        self._expressions.append((saved, node, where))
        return saved

    def _meta(self, node):
        """`node` on meta tensors (`.shape`, `.dtype`): each location's shape from one probe forward of this
        rank (once per model; in SPMD every rank asks alike, so the probe's collectives meet)."""
        from . import _proxy, _program
        if self._plan and self._ids is None:
            raise FragmentsError(f"{_proxy.user_line()}: a shape in model.plan(): a plan has no token ids until it "
                                 "runs; take shapes in model.trace(ids)")
        model = self._model
        if getattr(model, "_shapes", None) is None:
            open_trace, model._trace = model._trace, None
            try:
                model._shapes = _program.probe(model, (2, 3))
            finally:
                model._trace = open_trace
        probe, (batch, tokens) = model._shapes, tuple(self._ids.shape)

        def leaf(x, arg):
            if isinstance(x, _proxy.Call):
                shape, dtype = probe[f"{x.modules[-1]}.output"]
                return torch.empty(tuple(arg.shape[:-1]) + tuple(shape[-1:]), dtype=dtype, device="meta")
            name = "output" if isinstance(x, _proxy.Output) else getattr(x, "name", None)
            if name not in probe:
                raise FragmentsError(f"{x.where}: {x!r} has no shape here")
            from ._session import _scaled
            return torch.empty(_scaled(probe[name][0], batch, tokens), dtype=probe[name][1], device="meta")
        return _proxy.meta(node, leaf)

    def _edit_by_expression(self, location, index, do, node, where):
        """An edit whose value is an expression: a callable at the location (program._Hook) evaluates it
        on the whole during the forward, from the live values of the locations it reads (callables too)."""
        from . import _program
        from ._proxy import Loc
        if getattr(self, "_hooks", None) is None:
            raise FragmentsError(f"{where}: expressions in fragments.load's model.generate: use a LanguageModel")
        if _program._calls_in(node, []):
            raise FragmentsError(f"{where}: a module called ad hoc runs after the forward: it can be saved or "
                                 "computed with, not be an edit's value")

        def hook(name, visit):
            if (name, visit) not in self._hooks:
                self._hooks[(name, visit)] = _program._Hook(name, visit, self._live)
                self._hooks[(name, visit)].weights = {}
            return self._hooks[(name, visit)]
        for leaf in _leaf_nodes(node, where):
            if not isinstance(leaf, Loc):
                raise FragmentsError(f"{where}: model.output exists only after the forward: it cannot be an edit's value")
            hook(leaf.name, leaf.visit)
        python_index = None if index is None else _parse_index_text(index)
        hook(location.name, location._visit).steps.append(("edit", python_index, do, node, where))

    def _edit(self, location, index, value):
        if isinstance(value, _Pending):
            if value.location.name != location.name or value.index != index:
                raise FragmentsError(f"{location.name}: an in-place edit must assign back to where it read")
            do, operand = value.do, value.operand
        else:
            do, operand = "set", value
        if _is_expression(operand):
            from ._proxy import as_node, user_line
            node = operand._node() if isinstance(operand, _Expression) else as_node(operand)
            return self._edit_by_expression(location, index, do, node, user_line())
        where = location.name + (f"[{index}]" if index else "")
        if isinstance(operand, SavedValue) and not operand._ready:
            raise FragmentsError(f"{where}: {operand._what}.save() has no value yet; a value saved in a trace "
                                 "can be the edit of a later trace (activation patching), not of its own")
        operand = _unwrap(operand)
        step = Step(at=location.name, do=do, index=index, visit=location._visit)
        if do == "scale":
            if not isinstance(operand, numbers.Real):
                raise FragmentsError(f"{where} *= ...: multiply by a number (for a tensor use .apply)")
            step.by = float(operand)
        elif isinstance(operand, numbers.Real) and not isinstance(operand, bool):
            if do == "set" and operand == 0:
                step.do = "zero"
            else:
                step.value = torch.tensor(float(operand), dtype=self._model.dtype)
                step.value_name = f"{operand} given in Python"
        elif isinstance(operand, torch.Tensor):
            if operand.dtype != self._model.dtype:
                raise FragmentsError(f"{where}: the edit's tensor is {operand.dtype}, the model computes in "
                                     f"{self._model.dtype}")
            step.value = operand.detach().cpu().contiguous()
            step.value_name = "given in Python"
        else:
            raise FragmentsError(f"{where}: an edit takes a tensor or a number, got {type(operand).__name__}")
        self._steps.append(step)

    def plan_json(self, folder):
        """Writes this trace as a JSON plan for `frag run --plan` (values in values.safetensors); returns
        the plan's path. The same steps, for comparing with the CLI."""
        from safetensors.torch import save_file
        os.makedirs(folder, exist_ok=True)
        values, entries = {}, []
        for i, step in enumerate(self._steps):
            ref = None
            if step.value is not None:
                values[f"v{i}"] = step.value.reshape(step.value.shape).contiguous()
                ref = f"values.safetensors:v{i}"
            entries.append(step.to_json(ref))
        if values:
            save_file(values, os.path.join(folder, "values.safetensors"))
        path = os.path.join(folder, "plan.json")
        with open(path, "w") as f:
            json.dump({"format": _C.PLAN_FORMAT, "interventions": entries}, f, indent=1)
        return path

    def _run(self):
        if not self._ran:  # once: a run again (run(ids)) has these already
            for i, ((name, visit), hook) in enumerate(self._hooks.items()):
                self._callables.append((name, hook, visit, f"expression#{i}"))
            self._key = None if self._callables else _plan_key(self._steps)
            self._ran = True
        key = self._key
        same = key is not None and key == self._model._plan_key  # the same object when this plan ran last
        self._model._plan_key = None
        try:
            out, saved, unreached = self._model._c.run(self._steps, self._callables, self._ids, self._generate,
                                                       same)
        except _C.FragError as e:  # a step refused during the forward: said at the line that wrote it
            raise _at_line(e, self._steps) from None
        self._model._plan_key = key
        for line in unreached:
            warnings.warn(line)
        self.output = out
        for value, name in self._saves:
            if name is None:
                value._set(out)
            elif self._generate:
                value._set([saved[f"step{k}.{name}"][0] if len(saved[f"step{k}.{name}"]) == 1
                            else saved[f"step{k}.{name}"] for k in range(self._generate)
                            if f"step{k}.{name}" in saved])
            else:
                tensors = saved.get(name, [])
                value._set(tensors[0] if len(tensors) == 1 else tensors)
        if self._expressions:
            from . import _program
            saves = {i: ("expr", node, where) for i, (_, node, where) in enumerate(self._expressions)}
            values, _ = _program._results(self._model, saves, self._captured, {})
            for i, (value, _, _) in enumerate(self._expressions):
                value._set(values[i])


def _plan_key(steps):
    """What identifies a trace's plan, to tell C++ it repeats the last one (a decode loop's trace): every
    field of every Step (lists as tuples); None where a step carries a tensor, which only C++ compares
    byte for byte."""
    key = []
    for s in steps:
        if s.value is not None:
            return None
        fields = _STEP_FIELDS(s)  # one C call per step: a trace of many saves takes its key per call
        if s.modules or s.rows:
            fields = tuple(tuple(v) if isinstance(v, list) else v for v in fields)
        key.append(fields)
    return tuple(key)


_STEP_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(Step)))


def _leaf_nodes(node, where):
    from ._proxy import Loc, Output, _leaves_of
    leaves = _leaves_of(node)
    for leaf in leaves:
        if not isinstance(leaf, (Loc, Output)):
            raise FragmentsError(f"{where}: {leaf!r}: module weights are read whole in a LanguageModel session, "
                                 "not in fragments.load's traces (each rank holds its own piece)")
    return leaves


def _parse_index_text(text):
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


_STEP_LINES = True  # a session's rank (fragments._worker) replays steps whose lines the driver keeps


class _StepsWithLines(list):
    """A trace's steps; each appended step gets `where`, the user's "file:line" that recorded it."""

    def append(self, step):
        if _STEP_LINES:
            step.where = _user_line()
        super().append(step)


def _user_line():
    from ._proxy import user_line  # (_proxy imports this module)
    global _user_line
    _user_line = user_line
    return user_line()


def _at_line(error, steps):
    """`error` prefixed with the line of the first step whose location it names (else as it is)."""
    message = str(error)
    where = next((getattr(s, "where", None) for s in steps if s.at in message), None)
    return type(error)(f"{where}: {message}") if where else error


PAD_ID = 0  # the token a ragged batch is right-padded with (no real token attends to it: attention is causal)


def _token_rows(ids):
    """Token ids as rows of ints: a LongTensor [B, T] or [T], a list of ints, or lists of ints of any
    lengths (a ragged batch)."""
    if isinstance(ids, (list, tuple)) and ids and all(isinstance(r, (list, tuple, torch.Tensor)) for r in ids):
        rows = []
        for i, r in enumerate(ids):
            r = _token_ids(r)
            if r.shape[0] != 1:
                raise FragmentsError(f"token ids: prompt {i} must be one row of ids, got shape {list(r.shape)}")
            rows.append(r[0].tolist())
    else:
        rows = _token_ids(ids).tolist()
    for i, r in enumerate(rows):
        if not r:
            raise FragmentsError(f"token ids: prompt {i} has no tokens")
    return rows


def _padded(rows):
    """Rows of different lengths as one [B, longest] batch, right-padded with PAD_ID: each real token's
    position is its index, as in its own run, and causal attention keeps it from the pads after it."""
    longest = max(len(r) for r in rows)
    return torch.tensor([r + [PAD_ID] * (longest - len(r)) for r in rows], dtype=torch.long)


def unpad(value, lengths):
    """Each row of a ragged batch's value ([B, longest, ...], or a list of them per visit) trimmed to its
    prompt's tokens: a list of [length, ...] tensors."""
    if isinstance(value, SavedValue):
        value = value.value
    if isinstance(value, list):
        return [unpad(v, lengths) for v in value]
    if value.dim() < 2 or value.shape[0] != len(lengths):
        raise FragmentsError(f"unpad: a value of shape {list(value.shape)} is not [rows={len(lengths)}, tokens, ...]")
    return [value[b, :n] for b, n in enumerate(lengths)]


def _batch(ids):
    """(ids [B, T] as the forward takes them, each row's length): a tensor as it is (no round trip through
    lists; C++ moves it to the model's device, ShardedModel::forward), lists of ids right-padded."""
    if isinstance(ids, torch.Tensor):
        ids = _token_ids(ids)
        if ids.shape[1] == 0:
            raise FragmentsError("token ids: prompt 0 has no tokens")
        return ids, [ids.shape[1]] * ids.shape[0]
    rows = _token_rows(ids)
    return _padded(rows), [len(r) for r in rows]  # a ragged batch runs right-padded: see unpad()


def _token_ids(ids):
    if isinstance(ids, torch.Tensor):
        t = ids
    else:
        try:
            t = torch.tensor(ids, dtype=torch.long)
        except (TypeError, ValueError) as e:
            raise FragmentsError(f"token ids must be a LongTensor or lists of ints: {e}") from None
    if t.dtype != torch.long:
        raise FragmentsError(f"token ids must be integers (torch.long), got {t.dtype}")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise FragmentsError(f"token ids must be [batch, tokens] (or [tokens]), got shape {list(t.shape)}")
    return t.contiguous()


class Model:
    """One rank of a sharded model (see `load`)."""

    def __init__(self, path, device=None):
        context = rank_context()
        if device is None:  # NCCL ranks run on their GPU (LOCAL_RANK), Gloo ranks on the CPU
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if context.backend == "nccl" else "cpu"
        self.path = path.format(rank=context.rank) if "{rank}" in path else path
        self.device = torch.device(device)
        if _C.is_torch_export_archive(self.path):  # run by torch.export here, its plans by the C++ engine
            self._c = _C.ShardedModel.exported(context, self.path, device, ExportedRunner)
        else:
            self._c = _C.ShardedModel(context, self.path, device)
        self.rank, self.world_size = context.rank, context.world_size
        self.dtype = self._c.dtype
        self._location_kinds = {name: kind for name, kind, _ in self._c.locations()}
        self._classes, self._children = {}, {}
        for path_, cls in self._c.modules():
            self._classes[path_] = cls
            if path_:
                parent, _, leaf = path_.rpartition(".")
                self._children.setdefault(parent, []).append(leaf)
        self._trace = None
        self._plan_key = None  # the last trace's steps (_plan_key), if it ran without tensor values
        self._layouts = {}
        self._root = Module(self, "")

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        found = getattr(self._root, name)
        if isinstance(found, Module) and not hasattr(type(self), name):
            self.__dict__[name] = found  # `model.model` found at once by the next walk (every save's)
        return found

    @property
    def output(self):
        return _Logits(self, "output")

    def __call__(self, x):
        raise FragmentsError("call the model inside `with model.trace(ids):`, or call a submodule ad hoc")

    def locations(self):
        """What `frag inspect --json` lists for this rank file (format fragments.inspect/1)."""
        return json.loads(self._c.inspect_json())

    def trace(self, ids):
        """`with model.trace(ids):` records; the block's end runs one forward with it all (`tracer.run(ids)`
        runs it again on other ids)."""
        return Trace(self, ids)

    def plan(self):
        """`with model.plan() as plan:` records as a trace does, without ids and without running; then
        `logits = plan.run(ids)`, as often as wanted: one forward each, its saves refreshed. A decode loop
        records once instead of every step (with the same plan each call, C++ parses nothing again)."""
        return Trace(self, None)

    def generate(self, prompts, max_new_tokens, **options):
        """Generation as a trace (fragments._generate.Generation): recorded edits act at every step (narrow
        them with `gen.iter[a:b]`, `gen.prefill()`, `gen.decode()`, `gen.rows(...)`), saves are per-step
        lists, `model.output.save()` is the tokens. Prompts may differ in length (a KV cache batches them).
        Options: temperature, top_p, seed, eos_token_id, stop, tokenizer, on_token, max_len (the cache's
        tokens per row; default: the longest prompt plus max_new_tokens), batch_size (the cache's rows;
        default: the prompts'), batch_buckets (the batch sizes decode steps are padded to, program/decoder.h;
        default: powers of two on a GPU, none on a CPU)."""
        from ._generate import Generation
        return Generation(self, prompts, max_new_tokens, **options)

    def stream(self, prompts, max_new_tokens, **options):
        """Yields (step, [new token or None per row]) as generation runs (the options of generate)."""
        from ._generate import Generation
        generation = Generation(self, prompts, max_new_tokens, **options)
        yield from generation._run()

    def _head_layout(self, location):
        """name -> (start, stop, head_dim) on the last dim of the whole at `location`: q/k/v of a
        QKVParallelLinear's output, or "heads" of the o_proj input beside one; {} elsewhere. The C++
        ir::head_layout computes them, as for JSON plans' "segment"/"heads" and `frag inspect`."""
        if location not in self._layouts:
            self._layouts[location] = self._c.head_layout(location)
        return self._layouts[location]

    @property
    def cuda_graphs(self):
        """Whether traces on a GPU replay CUDA graphs (on by default): a plan and input shape seen twice is
        captured on its third forward and replayed after, bit-identical to running it op by op; ad-hoc calls
        recorded in a trace (a logit lens) replay with it. Traces with Python callables (`.apply`) run eagerly.
        Set False to turn it off."""
        return self._c.cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, on):
        self._c.cuda_graphs = bool(on)

    def graph_stats(self):
        """{"captures", "replays", "refusals"}: CUDA graphs this rank captured, replayed, and could not capture."""
        return self._c.graph_stats()

    @property
    def python_calls(self):
        """How many times Python callables (`.apply`) have run on this rank."""
        return self._c.python_calls

    def _active_trace(self, what):
        if self._trace is None:
            raise FragmentsError(f"{what} records an intervention: use it inside `with model.trace(ids):`")
        return self._trace


def load(path, device=None):
    """Loads this rank's file (`"dir/rank{rank}.pt"`: the rank from the launch context) onto `device`
    (default: the CPU, or under backend "nccl" the GPU of LOCAL_RANK). A TorchScript file (.pt) runs in
    C++; a torch.export archive (.pt2, plain or frag rewrite's) runs with torch.export in this process,
    its plans alike (fragments._exported)."""
    return Model(path, device)
