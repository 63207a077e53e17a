"""The recorder: what one `with model.trace(...)` block records, the same on every backend.

Proxies (fragments.tracing.proxy, .envoy) call it; it turns each user action into typed steps at once:

  loc.save()                          Step save (a part of a location: the location's save, viewed after)
  model.output.save()                 the forward's result
  model.lm_head(model.model.norm(h))  Step call (a chain of modules on a location's whole)
  loc[i] = t, loc *= 0.5, heads[h]=0  Step set/add/scale/zero (values: tensors, numbers, earlier saves)
  loc[i] = <expression of locations>  PythonStep edit (runs on the whole where it is written, fragments.core.executor)
  loc.apply(fn)                       PythonStep apply
  (anything computed).save()          an expression: its leaves saved, its value computed after the forward

`_steps` are the plan steps in recorded order, `_python` the Python steps, each with `pos` (how many plan steps
were recorded before it); a backend's `_finish` runs them (fragments.local, .session, .vllm). Generation scopes
(`gen.iter[a:b]`, `prefill()`, `decode()`, `rows()`) stamp the steps recorded inside them.
"""
import contextlib
import dataclasses
import numbers

import torch

from ..core import graph
from ..core.errors import FragmentsError, user_line
from ..core.saved import SavedValue
from ..core.step import PythonStep, Step, index_text
from .proxy import Proxy, as_node, is_number


@dataclasses.dataclass
class Recording:
    """What a trace recorded, as it runs where the whole values are (this process, or a session's ranks):
    `steps` (Step) and `python` (PythonStep, each with `pos`); `saves`: each SavedValue's plan step name ("as";
    None: the forward's output), in order; `expressions`: (node, where) of the saved expressions, computed after
    the forward from `captured` (leaf key -> index in `saves`)."""
    steps: list
    python: list
    saves: list
    expressions: list
    captured: dict


class Scope:
    """The generation steps (plan text: "prefill", "decode", "k", "a:b"; None: every step) and rows that steps
    recorded inside a scope act at (a scope opened inside another is a new Scope: none is changed)."""

    def __init__(self, steps=None, rows=None):
        self.steps = steps
        self.rows = rows


_EVERY = Scope()  # outside any scope: every generation step, all rows


class Iter:
    """`gen.iter[a:b]` / `gen.iter[k]`: a scope of generation steps."""

    def __init__(self, tracer):
        self._tracer = tracer

    def __getitem__(self, item):
        if isinstance(item, slice):
            if item.step not in (None, 1):
                raise FragmentsError(f"gen.iter[{item}]: steps are a contiguous range")
            start = 0 if item.start is None else int(item.start)
            text = f"{start}:" + ("" if item.stop is None else str(int(item.stop)))
        elif isinstance(item, numbers.Integral):
            text = str(int(item))
        else:
            raise FragmentsError(f"gen.iter[{item!r}]: index with a step number or a slice")
        return self._tracer._scoped(steps=text)


class Tracer:
    """The recording of one block; a backend's subclass runs it (`_finish`) and may add invokes (`_context`: what a
    location taken now belongs to, None outside an invoke: a session's Part, a vLLM trace's invoke number;
    `_locate`, `_whole_index`), checks (`_check`) and shapes (`_meta`)."""

    def __init__(self, model, generate=0):
        self._model = model
        self._generate = generate
        # The Recording is made as the block records (what runs reads it as it is, no copy per run); beside it
        # the SavedValues its saves and expressions deliver to, in the same order.
        self._recorded = recorded = Recording([], [], [], [], {})
        self._steps, self._python = recorded.steps, recorded.python
        self._saves = []          # a SavedValue per recorded.saves name
        self._expressions = []    # a SavedValue per recorded.expressions (node, where)
        self._scope = _EVERY
        self._context = None      # the open invoke (see the class's docstring)
        self.output = None

    @property
    def iter(self):
        """`gen.iter[a:b]` / `gen.iter[k]`: steps recorded inside act at those generation steps."""
        return Iter(self)

    # ---- the block
    def __enter__(self):
        if self._model._trace is not None:
            raise FragmentsError("a trace of this model is already open: traces do not nest")
        self._model._trace = self
        return self

    def __exit__(self, kind, value, tb):
        self._model._trace = None
        if kind is None:
            self._finish()
        return False

    def _finish(self):
        raise NotImplementedError

    def _recording(self):
        return self._recorded

    def _deliver(self, values, computed):
        """The values the run gave back (in the order of `_recording`'s saves and expressions) to the SavedValues."""
        for saved, value in zip(self._saves, values):
            saved._set(value)
        if computed:
            for saved, value in zip(self._expressions, computed):
                saved._set(value)

    # ---- generation scopes (nnsight's tracer.all() / tracer.iter[...])
    @contextlib.contextmanager
    def _scoped(self, steps=None, rows=None):
        old = self._scope
        self._scope = Scope(old.steps if steps is None else steps, old.rows if rows is None else rows)
        try:
            yield self
        finally:
            self._scope = old

    def all(self):
        """Steps recorded inside act at every generation step (the default)."""
        return self._scoped()

    def prefill(self):
        """Steps recorded inside act at the prefill only (step 0)."""
        return self._scoped(steps="prefill")

    def decode(self):
        """Steps recorded inside act at every decode step (steps 1 on)."""
        return self._scoped(steps="decode")

    def rows(self, rows):
        """Steps recorded inside act on these rows only: the prompts' indices, which are the rows' stable ids
        (program/decoder.h: a row keeps its id while others stop or are dropped)."""
        rows = [int(r) for r in ([rows] if isinstance(rows, numbers.Integral) else rows)]
        return self._scoped(rows=rows)

    # ---- what a backend with invokes or checks changes
    def _locate(self, name, visit, context):
        """The node of a location taken in `context`."""
        return graph.Output() if name == "output" else graph.Loc(name, visit)

    def _whole_index(self, context, index):
        """An index written in `context` as an index of the whole value."""
        return index

    def _check(self, name, where):
        """Refuses a location no rank holds whole, at the user's line."""
        tree = self._model._tree
        if tree.locations.get(name) == "rank_local":
            raise FragmentsError(f"{where}: {tree.rank_local.get(name, f'{name} is rank-local: no rank holds its whole value')}")

    def _meta(self, node):
        raise FragmentsError(f"{user_line()}: {node!r}: shapes are not known in this trace: save the value and read "
                             "its shape after the block")

    def _apply_fn(self, fn, context):
        return fn

    # ---- recording
    def _add(self, step, where):
        step.where = where
        step.steps, step.rows = self._scope.steps, self._scope.rows
        self._steps.append(step)

    def _position(self):
        """Where a Python step runs among the plan steps at its location: after those recorded before it."""
        return (len(self._steps), len(self._python))  # (each is appended to _python next)

    def _save_node(self, node, where, location=None, region=None):
        """`.save()` of a value of the trace: a location's save, the output, a module call's, or an expression."""
        if isinstance(node, graph.Loc):
            what = location._where() if location is not None else repr(node)
            return self._save_location(node.name, node.visit, where, what)
        if isinstance(node, graph.Output):
            return self._save_output()
        if region is not None and isinstance(node.args[0], graph.Loc):  # a part of a location: saved whole, viewed
            start, stop, what = region
            return self._save_location(node.args[0].name, node.args[0].visit, where, what,
                                       post=lambda t: t[..., start:stop])
        if isinstance(node, graph.Call) and isinstance(node.arg, graph.Loc):
            return self._save_call(node.arg, node.modules, where)
        if not isinstance(node, graph.Node):
            raise FragmentsError(f"{where}: save() of {type(node).__name__}: save a value of the trace")
        return self._save_expression(node, where)

    def _save_location(self, name, visit, where, what, post=None):
        """A plan save of the location `name` (at `visit`); `what` names it in messages, `post` views the value."""
        self._check(name, where)
        step = Step(at=name, do="save", as_=f"save{len(self._steps)}", visit=visit)
        self._add(step, where)
        saved = SavedValue(what, post)
        self._saves.append(saved)
        self._recorded.saves.append(step.as_)
        return saved

    def _save_output(self):
        saved = SavedValue("model.output")
        self._saves.append(saved)
        self._recorded.saves.append(None)
        return saved

    def _save_call(self, node, modules, where):
        self._check(node.name, where)
        step = Step(at=node.name, do="call", as_=f"save{len(self._steps)}", visit=node.visit, modules=list(modules))
        self._add(step, where)
        where_ = node.name + (f" (visit {node.visit})" if node.visit is not None else "")
        saved = SavedValue(f"{'('.join(modules[::-1])}({where_}{')' * len(modules)}")
        self._saves.append(saved)
        self._recorded.saves.append(step.as_)
        return saved

    def _save_expression(self, node, where):
        """An expression's leaves saved by the plan (once each); its value computed after the forward."""
        captured = self._recorded.captured  # leaf key -> the index of the save that keeps its whole
        for leaf in graph.leaves_of(node):
            key = graph.leaf_key(leaf)
            if key in captured or key[0] == "weight":
                continue
            captured[key] = len(self._saves)
            if key[0] == "output":
                self._save_output()
            else:
                self._save_location(leaf.name, leaf.visit, where, repr(leaf))
        saved = SavedValue(repr(node))
        self._expressions.append(saved)
        self._recorded.expressions.append((node, where))
        return saved

    def _leaf_proxy(self, node):
        """A parameter read whole inside the trace (a session's): a leaf of the expression graph."""
        node.where = user_line()
        self._model._weight_value(node.module, node.attr)  # gathered once; the ranks keep it
        return Proxy(self, node)

    def _edit(self, location, index, do, operand, where):
        """`location[index]` (index None: all of it) edited: a plan step by a constant, a Python step by an
        expression that reads locations."""
        self._check(location.name, where)
        if isinstance(operand, (Proxy, graph.Node)):
            node = as_node(operand)
            if graph.reads_locations(node):
                return self._edit_by_expression(location, index, do, node, where)
            operand = self._constant(node, where)
        text = location.name + (f"[{index_text(index, location.name)}]" if index is not None else "")
        if isinstance(operand, SavedValue):
            if not operand._ready:
                raise FragmentsError(f"{where}: {text}: {operand._what}.save() has no value yet; a value saved in a "
                                     "trace can be the edit of a later trace (activation patching), not of its own")
            operand = operand.value
        step = Step(at=location.name, do=do, index=None if index is None else index_text(index, location.name),
                    visit=location._visit)
        self._typed_value(step, operand, f"{where}: {text}")
        self._add(step, where)

    def _typed_value(self, step, operand, where):
        """The step's operand as the plan takes it: `by` for a scale, a tensor in the model's dtype, `zero`."""
        dtype = self._model._tree.dtype
        if step.do == "scale":
            if not is_number(operand):
                raise FragmentsError(f"{where} *= ...: multiply by a number (for a tensor use .apply)")
            step.by = float(operand)
        elif is_number(operand):
            if step.do == "set" and operand == 0:
                step.do = "zero"
            else:
                step.value = torch.tensor(float(operand), dtype=dtype)
                step.value_name = f"{operand} given in Python"
        elif isinstance(operand, torch.Tensor):
            if operand.dtype != dtype:
                if not operand.is_floating_point():
                    raise FragmentsError(f"{where}: the edit's tensor is {operand.dtype}, the model computes in "
                                         f"{dtype}")
                operand = operand.to(dtype)
            step.value = operand.detach().cpu().contiguous()
            step.value_name = "given in Python"
        else:
            raise FragmentsError(f"{where}: an edit takes a tensor or a number, got {type(operand).__name__}")

    def _constant(self, node, where):
        """An expression of constants (and whole weights) only, computed here: the edit is then a plain step."""
        weights = lambda leaf: self._model._weight_value(leaf.module, leaf.attr)  # noqa: E731
        try:
            return graph.evaluate(node, weights)
        except Exception as e:  # noqa: B902 - said at the user's line
            raise FragmentsError(f"{where}: {type(e).__name__}: {e}") from None

    def _edit_by_expression(self, location, index, do, node, where):
        """An edit whose value reads locations: a Python step at the location, evaluated on the whole during the
        forward from the live values of the locations it reads."""
        if graph.calls_in(node):
            raise FragmentsError(f"{where}: a module called ad hoc runs after the forward: it can be saved or "
                                 "computed with, not be an edit's value")
        for leaf in graph.leaves_of(node):
            if isinstance(leaf, graph.Output):
                raise FragmentsError(f"{where}: model.output exists only after the forward: it cannot be an edit's "
                                     "value")
            if isinstance(leaf, graph.Loc):
                self._check(leaf.name, where)
        self._python.append(PythonStep(kind="edit", at=location.name, visit=location._visit, index=index, do=do,
                                       value=node, where=where, steps=self._scope.steps, rows=self._scope.rows,
                                       pos=self._position()))

    def _apply(self, location, fn, where):
        if location.name == "output":
            raise FragmentsError(f"{where}: model.output (the logits) cannot be edited: apply at lm_head's input or "
                                 "output")
        self._check(location.name, where)
        self._python.append(PythonStep(kind="apply", at=location.name, visit=location._visit,
                                       fn=self._apply_fn(fn, location._context), where=where,
                                       steps=self._scope.steps, rows=self._scope.rows, pos=self._position()))
