"""The model as a trace sees it, the same on every backend: modules (Envoy) whose attributes are their
submodules, locations (`.input`, `.output`: Location, a Proxy that can also be edited), parts of a location's
last dim laid out in heads (Region, Heads) and nnsight's `.inputs`.

What a backend's model object gives them: `_tree` (fragments.tracing.tree.ModelTree), `_trace` (the open
recording, or None) and `_active_trace(what)`, `_callable(path)` (why a module cannot be called ad hoc, or
None), `_call(modules, x)` (an ad-hoc call outside a trace) and, where parameters are read whole (a session),
`_weight_value(path, attr)`.
"""
import numbers
import operator

import torch

from ..core import graph
from ..core.errors import FragmentsError, did_you_mean, user_line
from ..core.regions import head_bounds, head_count, region_index
from ..core.saved import SavedValue
from .proxy import Pending, Proxy, as_node, is_number, same_read

_METHODS = ("save", "apply", "visit", "all")


class Envoy:
    """A module of the model: attributes are its submodules, `.input`/`.output` its locations (`.inputs`: nnsight's
    `(args, kwargs)` of them), `m[i]` a ModuleList's members; `m(x)` runs it ad hoc on a whole tensor (recorded
    inside a trace when `x` is a value of the trace)."""

    def __init__(self, model, path):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_numbered", None)  # a ModuleList's members, made once

    def _child(self, name):
        return f"{self._path}.{name}" if self._path else name

    def _what(self):
        return self._path or "the model"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        tree = self._model._tree
        if name in tree.children.get(self._path, ()):
            child = Envoy(self._model, self._child(name))
            if not hasattr(Envoy, name):  # kept as an attribute: the next walk (every save's) finds it at once
                object.__setattr__(self, name, child)
            return child
        if name in ("input", "output"):
            return self._location(name)
        if name == "inputs":
            return self._inputs()
        if self._reads_weight(name):
            return self._weight(name)
        options = list(tree.children.get(self._path, [])) + tree.sides(self._path)
        raise AttributeError(f"{self._what()} ({tree.classes.get(self._path, '?')}) has no attribute {name!r}"
                             f"{did_you_mean(name, options)}")

    def __dir__(self):
        tree = self._model._tree
        return sorted(set(tree.children.get(self._path, [])) | set(tree.sides(self._path)) | {"inputs"}
                      | set(object.__dir__(self)))

    def _reads_weight(self, name):
        return hasattr(self._model, "_weight_value") and self._path in self._model._tree.classes and (
            name in ("weight", "bias") or name.endswith("weight"))

    def _weight(self, name):
        """A parameter read whole: a leaf of the trace inside one, else the tensor."""
        trace = self._model._trace
        if trace is not None:
            return trace._leaf_proxy(graph.Weight(self._path, name))
        try:
            return self._model._weight_value(self._path, name)
        except FragmentsError as e:
            raise AttributeError(f"{self._what()}: {e}") from None

    def _location(self, side):
        tree = self._model._tree
        name = self._child(side)
        alias = _hidden_state_alias(tree, self._path) if side == "input" and tree.hidden_state_inputs else None
        if alias is not None:
            name = alias
        elif name not in tree.locations:
            known = tree.sides(self._path)
            raise AttributeError(f"{self._what()} has no location .{side} "
                                 f"({'it has ' + ', '.join('.' + k for k in known) if known else 'none there'}; "
                                 "`frag inspect --all` lists every location)")
        return Location(self._model, name)

    def _inputs(self):
        """nnsight's `(args, kwargs)` of this module's inputs where the rank file has them: a decoder layer's hidden
        states (its first input in transformers) and, by name, the kit's `positions`; elsewhere the first input.
        `.inputs["name"]` reads one by name."""
        tree = self._model._tree
        raw = self._child("input")
        if raw not in tree.locations:
            raise AttributeError(f"{self._what()} has no inputs in this rank file "
                                 f"(it has {', '.join(tree.sides(self._path)) or 'no location'})")
        alias = _hidden_state_alias(tree, self._path)
        if alias is None:
            return Inputs(self._path, (Location(self._model, raw),), {})
        return Inputs(self._path, (Location(self._model, alias),), {"positions": Location(self._model, raw)},
                      names=("hidden_states",))

    def __setattr__(self, name, value):
        if name not in ("input", "output"):
            raise AttributeError(f"{self._what()}: only .input and .output can be assigned (edits inside a trace), "
                                 f"not {name!r}")
        self._location(name)._assign(None, value)

    def __getitem__(self, i):
        numbered = self._numbered
        if numbered is None:
            count = self._model._tree.numbered(self._path)
            numbered = [Envoy(self._model, self._child(str(k))) for k in range(count)]
            object.__setattr__(self, "_numbered", numbered)
        if not numbered:
            raise TypeError(f"{self._what()} is not a ModuleList: it cannot be indexed")
        if not isinstance(i, numbers.Integral):
            raise TypeError(f"{self._path}[{i!r}]: index a ModuleList with an integer")
        n = len(numbered)
        if not -n <= i < n:
            raise IndexError(f"{self._path}[{i}]: it has {n} modules (0 to {n - 1})")
        return numbered[i]

    def __len__(self):
        return self._model._tree.numbered(self._path)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __call__(self, x, *rest):
        """Runs this module ad hoc on a whole tensor; on a value of a trace, the call is recorded (a logit lens:
        `model.lm_head(model.model.norm(h))`) and runs on the whole value."""
        if rest:
            raise FragmentsError(f"{self._path}(...) takes one whole tensor here")
        if isinstance(x, Proxy):
            node = as_node(x)
            if isinstance(node, graph.Output):
                raise FragmentsError("model.output (the logits) cannot feed an ad-hoc call")
            problem = self._model._callable(self._path)
            if problem:
                raise FragmentsError(problem)
            call = graph.Call([self._path], node)
            if isinstance(node, graph.Call):  # a chain: norm then lm_head, one call of the engine
                call = graph.Call(node.modules + [self._path], node.arg)
            call.where = user_line()
            return Proxy(x._trace, call)
        if isinstance(x, SavedValue):
            x = x.value
        if not isinstance(x, torch.Tensor):
            raise FragmentsError(f"{self._path}(...) takes a whole tensor or a value of a trace, got {type(x).__name__}")
        return self._model._call([self._path], x)

    def __repr__(self):
        head = f"<module {self._path or '(root)'} ({self._model._tree.classes.get(self._path, '?')})>"
        return "\n".join([head] + self._model._tree.render(self._path, "  "))


class Location(Proxy):
    """A location (`<module>.input`, `<module>.output`; `model.output` is the logits): the whole tensor there, a
    value of the trace that can also be edited (`loc[...] = v`, `loc += v`, `.apply(fn)`) and saved; its segments
    (`.q`, `.k`, `.v`) and heads (`.heads[i]`) where it is laid out in attention heads."""

    def __init__(self, model, name, visit=None, context=None):
        trace = model._trace  # a session's invoke (its rows), a vLLM trace's invoke: where the value was taken
        self.__dict__.update(_model=model, name=name, _visit=visit,
                             _context=context if context is not None or trace is None else trace._context)

    @property
    def _trace(self):
        return self._model._active_trace(self.name)

    @property
    def _node(self):
        trace = self._model._trace
        if trace is None:
            return graph.Output() if self.name == "output" else graph.Loc(self.name, self._visit)
        return trace._locate(self.name, self._visit, self._context)

    def _regions(self):
        return {} if self.name == "output" else self._model._tree.head_layout(self.name)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        regions = self._regions()
        if name == "heads" and "heads" in regions:  # o_proj.input: the heads are the whole width
            return Heads(Region(self, *regions["heads"], self.name))
        if name in regions:
            return Region(self, *regions[name], f"{self.name}.{name}")
        if name == "heads":
            raise AttributeError(f"{self.name} has no heads of its own: take them from a segment "
                                 f"({', '.join('.' + r for r in regions) or 'none here'})")
        if name in ("shape", "dtype", "ndim", "device", "T", "mT", "real", "imag") or \
                callable(getattr(torch.Tensor, name, None)):
            return super().__getattr__(name)
        raise AttributeError(f"location {self.name} has no attribute {name!r}"
                             f"{did_you_mean(name, list(regions) + list(_METHODS))}")

    def __dir__(self):
        return sorted(set(object.__dir__(self)) | set(self._regions()) | set(_METHODS))

    def __setattr__(self, name, value):
        regions = self._regions()
        if name not in regions:
            raise AttributeError(f"location {self.name}: only its segments ({', '.join(regions) or 'none'}) "
                                 f"can be assigned, not {name!r}")
        start, stop, _ = regions[name]
        self._assign(region_index(start, stop), value)

    def _where(self):
        return self.name + (f" (visit {self._visit})" if self._visit is not None else "")

    def visit(self, k):
        """Only the k-th call of the module in a forward (0-based)."""
        if not isinstance(k, numbers.Integral) or k < 0:
            raise FragmentsError(f"{self.name}: visit takes a non-negative integer, got {k!r}")
        return Location(self._model, self.name, int(k), self._context)

    def all(self):
        """Every visit (the default): `.save()` then gives a list when the module runs more than once."""
        return Location(self._model, self.name, None, self._context)

    def save(self):
        trace = self._model._trace or self._model._active_trace(f"{self.name}.save()")
        if self._context is not None:  # taken in an invoke: its node says which part
            return trace._save_node(self._node, user_line(), self)
        if self.name == "output":  # (as _save_node saves the nodes of these two, without making them)
            return trace._save_output()
        return trace._save_location(self.name, self._visit, user_line(), self._where())

    def apply(self, fn):
        """Runs `fn(whole)` at every visit (or `.visit(k)`'s); it returns the replacement or None."""
        if not callable(fn):
            raise FragmentsError(f"{self.name}.apply takes a callable, got {type(fn).__name__}")
        trace = self._model._active_trace(f"{self.name}.apply()")
        trace._apply(self, fn, user_line())

    def __setitem__(self, index, value):
        self._assign(index, value)

    def _assign(self, index, value):
        """`self[index] = value` (index None: all of it), `value` a tensor, a number, an earlier trace's saved
        value, a value of this trace, or the Pending edit of an in-place operator on what this reads."""
        where = user_line()
        trace = self._model._active_trace(f"{self.name}[...] = ...")
        if self.name == "output":
            raise FragmentsError(f"{where}: model.output (the logits) cannot be edited: edit lm_head's input or output")
        do, operand = "set", value
        if isinstance(value, Pending):
            base, kind, operand = value._edit
            if not same_read(base, as_node(self if index is None else self[index])):
                raise FragmentsError(f"{where}: {self.name}: an in-place edit must assign back to where it read")
            if kind == "sub":
                kind, operand = "add", -operand
            elif kind == "div":
                kind, operand = "scale", 1.0 / operand
            do = kind
            if do == "scale" and not is_number(operand):  # a tensor factor: set the product
                do, operand = "set", value
        trace._edit(self, trace._whole_index(self._context, index), do, operand, where)

    def __repr__(self):
        return f"<location {self._where()}>"


class Region(Proxy):
    """A part of a location's last dim in whole coordinates: a q/k/v segment, all heads, or one head
    (`.heads[i]`): a value, a place to edit, and `.heads`. Across ranks the runtime takes reads from one copy of
    a replicated kv head and lands edits on every copy (the split of the segments rule)."""

    def __init__(self, location, start, stop, head_dim, what):
        object.__setattr__(self, "_parts", (location, start, stop, head_dim, what))

    @property
    def _trace(self):
        return self._parts[0]._trace

    @property
    def _node(self):
        location, start, stop = self._parts[:3]
        return graph.Op(operator.getitem, (location._node, region_index(start, stop)))

    @property
    def index(self):
        return f"...,{self._parts[1]}:{self._parts[2]}"

    @property
    def heads(self):
        return Heads(self)

    def save(self):
        location, start, stop, _, what = self._parts
        trace = location._model._active_trace(f"{what}.save()")
        return trace._save_node(self._node, user_line(), location, region=(start, stop, what))

    def _assign(self, value):
        self._parts[0]._assign(region_index(*self._parts[1:3]), value)

    def __repr__(self):
        location, start, stop, _, what = self._parts
        return f"<{what}: [..., {start}:{stop}] of {location.name}>"


class Heads:
    """`region.heads[i]`: head i of a segment (head_dim wide), in whole coordinates; read, assign, `*=`."""

    def __init__(self, region):
        self._region = region
        _, start, stop, head_dim, _ = region._parts
        self._count = head_count(start, stop, head_dim)

    def __len__(self):
        return self._count

    def __getitem__(self, i):
        location, start, stop, head_dim, what = self._region._parts
        a, b = head_bounds(start, stop, head_dim, i, what)
        return Region(location, a, b, head_dim, f"{what}.heads[{i % self._count}]")

    def __setitem__(self, i, value):
        self[i]._assign(value)


class Inputs(tuple):
    """`module.inputs`: `(args, kwargs)` as nnsight gives them; `inputs["name"]` is one input by name."""

    _TRANSFORMERS = ("attention_mask", "position_ids", "position_embeddings", "past_key_value",
                     "past_key_values", "cache_position", "use_cache", "output_attentions")

    def __new__(cls, path, args, kwargs, names=()):
        self = super().__new__(cls, (tuple(args), dict(kwargs)))
        self._path, self._names = path, dict(zip(names, args))
        self._names.update(kwargs)
        return self

    def __getitem__(self, key):
        if not isinstance(key, str):
            return super().__getitem__(key)
        if key in self._names:
            return self._names[key]
        there = ", ".join(self._names) or "its first input only (`.input`)"
        why = (" (a transformers input: the kit's layer takes `positions` and builds its own mask and rotary "
               "embedding, so it has no such input)" if key in self._TRANSFORMERS else "")
        raise KeyError(f"{self._path}.inputs has no {key!r}{why}; it has: {there}{did_you_mean(key, self._names)}")


def _hidden_state_alias(tree, path):
    """A decoder layer's hidden states where the rank file's first input is something else (the kit's and vLLM's
    decoder layers take `positions` first): the previous layer's output, or the embedding's for layer 0."""
    parent, _, index = path.rpartition(".")
    if not index.isdigit() or not parent.endswith("layers"):
        return None
    if int(index) > 0:
        alias = f"{parent}.{int(index) - 1}.output"
    else:
        root = parent.rpartition(".")[0]
        alias = f"{root}.embed_tokens.output" if root else "embed_tokens.output"
    return alias if alias in tree.locations else None


class TracedModel:
    """What the backends' model objects share: their modules as attributes (`model.model.layers[0]`),
    `model.output` (the logits), the open trace, and `dir()` and a `repr` that show the module tree (a notebook
    completes names from them). A backend sets `_tree` and `_title()`."""

    _trace = None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        found = getattr(self._root, name)
        if isinstance(found, Envoy) and not hasattr(type(self), name):
            self.__dict__[name] = found  # `model.model` found at once by the next walk (every save's)
        return found

    @property
    def _root(self):
        root = self.__dict__.get("_root_envoy")
        if root is None:
            root = self.__dict__["_root_envoy"] = Envoy(self, "")
        return root

    @property
    def output(self):
        """The forward's result: the logits (the tokens, in a generation)."""
        return Location(self, "output")

    def __dir__(self):
        return sorted(set(object.__dir__(self)) | set(self._tree.children.get("", [])))

    def __repr__(self):
        return "\n".join([self._title()] + self._tree.render("", "  "))

    def _title(self):
        return f"<{type(self).__name__}>"

    def _active_trace(self, what):
        if self._trace is None:
            raise FragmentsError(f"{what} records an intervention: use it inside `with model.trace(ids):`")
        return self._trace
