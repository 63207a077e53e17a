"""Values computed inside a trace: an expression graph recorded in the driver, evaluated on the ranks.

`h = model.model.layers[3].output` in a session trace is a `Proxy` of a leaf (a location, a weight, the
logits, a value of an earlier trace). Arithmetic, indexing, tensor methods and torch functions on proxies
record `Op` nodes instead of computing; `.save()` marks a node to be sent back. The ranks evaluate the same
graph on whole tensors (fragments._program): the saved value of an expression is its result, not the
tensors it was computed from (a logit lens can keep the top 5 of every layer).

Nodes are plain picklable objects: a function travels by reference (`torch.topk`, `operator.mul`) or, for
`.apply`, by value through cloudpickle.
"""
import numbers
import operator
import os
import sys

import torch

_PACKAGE = os.path.dirname(os.path.abspath(__file__))

_OURS = {}  # co_filename -> whether it is this package's (or importlib's): asked once per file


def _ours(filename):
    verdict = _OURS.get(filename)
    if verdict is None:
        path = os.path.abspath(filename)
        verdict = _OURS[filename] = path.startswith(_PACKAGE + os.sep) or "importlib" in path
    return verdict


def user_line():
    """"file:line" of the first frame outside this package (where the user wrote the step). Every step of
    every trace asks, so it walks frames with sys._getframe and judges each file once."""
    frame = sys._getframe(1)
    try:
        while frame is not None:
            if not _ours(frame.f_code.co_filename):
                return f"{frame.f_code.co_filename}:{frame.f_lineno}"
            frame = frame.f_back
        return "?"
    finally:
        del frame


class Node:
    """A value of the expression graph. `where`: the user's file:line that made it."""

    where = "?"

    def leaves(self):
        return []


class Loc(Node):
    """The whole tensor at a location (`name`), at visit `visit` (None: the current/every visit)."""

    def __init__(self, name, visit=None):
        self.name, self.visit = name, visit

    def leaves(self):
        return [self]

    def key(self):
        return (self.name, self.visit)

    def __repr__(self):
        return self.name + (f".visit({self.visit})" if self.visit is not None else "")


class Output(Node):
    """The forward's result: logits (tokens under generate)."""

    def leaves(self):
        return [self]

    def __repr__(self):
        return "model.output"


class Weight(Node):
    """A parameter of a module, whole (gathered across ranks once per session, then cached)."""

    def __init__(self, module, attr):
        self.module, self.attr = module, attr

    def leaves(self):
        return [self]

    def __repr__(self):
        return f"{self.module}.{self.attr}"


class Const(Node):
    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return f"<{type(self.value).__name__}>"


class Call(Node):
    """Modules of the rank file called ad hoc on a location (`model.lm_head(model.model.norm(h))`)."""

    def __init__(self, modules, arg):
        self.modules, self.arg = list(modules), arg

    def leaves(self):
        return self.arg.leaves()

    def __repr__(self):
        return "(".join(self.modules[::-1]) + f"({self.arg!r}" + ")" * len(self.modules)


class Op(Node):
    """`fn(*args, **kwargs)`; `fn` a callable or ("method", name) for a tensor method."""

    def __init__(self, fn, args, kwargs=None):
        self.fn, self.args, self.kwargs = fn, tuple(args), dict(kwargs or {})

    def leaves(self):
        out = []
        for a in list(self.args) + list(self.kwargs.values()):
            out += _leaves_of(a)
        return out

    def __repr__(self):
        name = self.fn[1] if isinstance(self.fn, tuple) else getattr(self.fn, "__name__", "fn")
        return f"{name}(...)"


def _leaves_of(x):
    if isinstance(x, Node):
        return x.leaves()
    if isinstance(x, (list, tuple)):
        return [leaf for item in x for leaf in _leaves_of(item)]
    if isinstance(x, dict):
        return [leaf for item in x.values() for leaf in _leaves_of(item)]
    return []


def evaluate(node, env, const=None):
    """The value of `node`; `env(leaf)` gives a leaf's whole tensor; `const(x)`, if given, maps constants."""
    if isinstance(node, (Loc, Output, Weight)):
        return env(node)
    if isinstance(node, Const):
        return node.value if const is None else const(node.value)
    if isinstance(node, Call):
        return env(node)
    if isinstance(node, Op):
        args = [_evaluate_any(a, env, const) for a in node.args]
        kwargs = {k: _evaluate_any(v, env, const) for k, v in node.kwargs.items()}
        if isinstance(node.fn, tuple):
            return getattr(args[0], node.fn[1])(*args[1:], **kwargs)
        return node.fn(*args, **kwargs)
    return node if const is None else const(node)


def _evaluate_any(x, env, const=None):
    if isinstance(x, Node):
        return evaluate(x, env, const)
    if isinstance(x, list):
        return [_evaluate_any(i, env, const) for i in x]
    if isinstance(x, tuple):
        return tuple(_evaluate_any(i, env, const) for i in x)
    if isinstance(x, dict):
        return {k: _evaluate_any(v, env, const) for k, v in x.items()}
    return x if const is None else const(x)


def as_node(x):
    """A proxy's node; a tensor or number as a constant; containers element-wise."""
    if isinstance(x, Proxy):
        return object.__getattribute__(x, "_node")
    from ._model import SavedValue
    if isinstance(x, SavedValue):  # a value of an earlier trace: its tensor travels
        return Const(x.value)
    if isinstance(x, list):
        return [as_node(i) for i in x]
    if isinstance(x, tuple):
        return tuple(as_node(i) for i in x)
    if isinstance(x, dict):
        return {k: as_node(v) for k, v in x.items()}
    return x


def _binary(fn, reflected=False):
    def method(self, other):
        a, b = as_node(self), as_node(other)
        return self._derive(Op(fn, (b, a) if reflected else (a, b)))
    return method


class Proxy:
    """A value inside a trace. Operators, indexing, tensor methods and torch functions record; `.save()`
    asks for the value after the trace. Subclasses (session locations) add edits."""

    def __init__(self, trace, node):
        object.__setattr__(self, "_trace", trace)
        object.__setattr__(self, "_node", node)

    def _derive(self, node):
        node.where = user_line()
        return Proxy(self._trace, node)

    def save(self):
        return self._trace._save_node(as_node(self), user_line())

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in ("shape", "dtype", "ndim"):  # from a fake run of the expression (see `meta`)
            meta = self._trace._meta(self._node)
            return meta.dim() if name == "ndim" else getattr(meta, name)
        if name == "device":
            raise AttributeError(f"{self._node!r}.device: values live on the ranks' devices, not in this process")
        if name in ("T", "mT", "real", "imag"):
            return self._derive(Op(getattr, (as_node(self), name)))
        if not callable(getattr(torch.Tensor, name, None)):
            raise AttributeError(f"{self._node!r} has no attribute {name!r} (a proxy has torch.Tensor's methods, "
                                 "save() and apply())")

        def method(*args, **kwargs):
            return self._derive(Op(("method", name), (as_node(self),) + tuple(as_node(a) for a in args),
                                   {k: as_node(v) for k, v in kwargs.items()}))
        return method

    def __getitem__(self, index):
        return self._derive(Op(operator.getitem, (as_node(self), as_node(index))))

    def __iter__(self):
        raise TypeError("a value inside a trace has no length yet: index it (`h[0]`) instead of iterating")

    def __bool__(self):
        raise TypeError("a value inside a trace has no truth value yet (it exists on the ranks once the forward "
                        "runs): compute with it, or save it and decide after the trace")

    def size(self, dim=None):
        shape = self.shape
        return shape if dim is None else shape[dim]

    def __len__(self):
        return self.shape[0]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        trace = next(x._trace for x in list(args) + list((kwargs or {}).values()) if isinstance(x, Proxy))
        node = Op(func, tuple(as_node(a) for a in args), {k: as_node(v) for k, v in (kwargs or {}).items()})
        node.where = user_line()
        return Proxy(trace, node)

    def __repr__(self):
        return f"<value in a trace: {self._node!r}>"

    __add__, __radd__ = _binary(operator.add), _binary(operator.add, True)
    __sub__, __rsub__ = _binary(operator.sub), _binary(operator.sub, True)
    __mul__, __rmul__ = _binary(operator.mul), _binary(operator.mul, True)
    __truediv__, __rtruediv__ = _binary(operator.truediv), _binary(operator.truediv, True)
    __matmul__, __rmatmul__ = _binary(operator.matmul), _binary(operator.matmul, True)
    __pow__, __rpow__ = _binary(operator.pow), _binary(operator.pow, True)
    __floordiv__ = _binary(operator.floordiv)
    __mod__ = _binary(operator.mod)
    __lt__, __le__ = _binary(operator.lt), _binary(operator.le)
    __gt__, __ge__ = _binary(operator.gt), _binary(operator.ge)
    __eq__, __ne__ = _binary(operator.eq), _binary(operator.ne)
    __and__, __or__ = _binary(operator.and_), _binary(operator.or_)
    __hash__ = object.__hash__

    def __neg__(self):
        return self._derive(Op(operator.neg, (as_node(self),)))

    def __abs__(self):
        return self._derive(Op(operator.abs, (as_node(self),)))


def is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def meta(node, leaf):
    """What `node` would be, computed on meta tensors (shape and dtype, no data): `leaf(l)` gives a leaf's
    meta tensor. A trace's `.shape` and `.dtype` come from this; nothing runs on the ranks."""
    def env(x):
        if isinstance(x, Call):
            return leaf(x, evaluate(x.arg, env, as_meta))
        return leaf(x, None)
    try:
        out = evaluate(node, env, as_meta)
    except Exception as e:  # noqa: B902 - what the ranks would say, at the user's line
        raise TypeError(f"{node.where}: {node!r}: {type(e).__name__}: {e}") from None
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{node!r} is a {type(out).__name__}, not a tensor: it has no shape")
    return out


def as_meta(x):
    """A tensor's stand-in for `meta` (a constant of the trace)."""
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x


class RowsApply:
    """`.apply(fn)` inside an invoke: `fn` sees (and may replace) the invoke's rows and tokens only."""

    def __init__(self, fn, rows, length):
        self.fn, self.rows, self.length = fn, rows, length

    def __call__(self, whole):
        part = (self.rows, slice(0, self.length)) if whole.dim() > 1 else (self.rows,)
        out = self.fn(whole[part])
        if out is None:
            return None
        new = whole.clone()
        new[part] = out
        return new
