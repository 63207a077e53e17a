"""Values inside a trace: a Proxy records instead of computing.

`h = model.model.layers[3].output` is a Proxy of a leaf (a location, a weight, the logits, a value of an earlier
trace). Arithmetic, indexing, tensor methods and torch functions on proxies record `Op` nodes of the expression
graph (fragments.core.graph); `.save()` asks for the value after the trace, `.shape`/`.dtype` come from meta
tensors. In-place operators (`+=`, `-=`, `*=`, `/=`) are methods of Proxy: each makes a `Pending` edit, which
the assignment Python makes next (`loc[i] = loc[i].__iadd__(v)`) records at the location it was read from
(fragments.tracing.envoy.Location).
"""
import numbers
import operator

import torch

from ..core import graph
from ..core.errors import user_line
from ..core.saved import SavedValue


def as_node(x):
    """A proxy's node; a value of an earlier trace as a constant; containers element-wise; else `x`."""
    if isinstance(x, Proxy):
        return object.__getattribute__(x, "_node")
    if isinstance(x, SavedValue):  # a value of an earlier trace: its tensor travels
        return graph.Const(x.value)
    if isinstance(x, list):
        return [as_node(i) for i in x]
    if isinstance(x, tuple):
        return tuple(as_node(i) for i in x)
    if isinstance(x, dict):
        return {k: as_node(v) for k, v in x.items()}
    return x


def is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _binary(fn, reflected=False):
    def method(self, other):
        a, b = as_node(self), as_node(other)
        return self._derive(graph.Op(fn, (b, a) if reflected else (a, b)))
    return method


def _inplace(do, fn):
    """`x op= v`: the value `x op v`, remembering that it edits what `x` read (by `do`)."""
    def method(self, other):
        node = graph.Op(fn, (as_node(self), as_node(other)))
        node.where = user_line()
        return Pending(self._trace, node, as_node(self), do, other)
    return method


class Proxy:
    """A value inside a trace. Operators, indexing, tensor methods and torch functions record; `.save()` asks
    for the value after the trace. Locations (fragments.tracing.envoy.Location) add edits."""

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
        if name in ("shape", "dtype", "ndim"):  # from a fake run of the expression (see graph.meta)
            meta = self._trace._meta(self._node)
            return meta.dim() if name == "ndim" else getattr(meta, name)
        if name == "device":
            raise AttributeError(f"{self._node!r}.device: values live on the ranks' devices, not in this process")
        if name in ("T", "mT", "real", "imag"):
            return self._derive(graph.Op(getattr, (as_node(self), name)))
        if not callable(getattr(torch.Tensor, name, None)):
            raise AttributeError(f"{self._node!r} has no attribute {name!r} (a proxy has torch.Tensor's methods, "
                                 "save() and apply())")

        def method(*args, **kwargs):
            return self._derive(graph.Op(("method", name), (as_node(self),) + tuple(as_node(a) for a in args),
                                         {k: as_node(v) for k, v in kwargs.items()}))
        return method

    def __getitem__(self, index):
        return self._derive(graph.Op(operator.getitem, (as_node(self), as_node(index))))

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
        node = graph.Op(func, tuple(as_node(a) for a in args), {k: as_node(v) for k, v in (kwargs or {}).items()})
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
    __iadd__ = _inplace("add", operator.add)
    __isub__ = _inplace("sub", operator.sub)
    __imul__ = _inplace("scale", operator.mul)
    __itruediv__ = _inplace("div", operator.truediv)
    __hash__ = object.__hash__

    def __neg__(self):
        return self._derive(graph.Op(operator.neg, (as_node(self),)))

    def __abs__(self):
        return self._derive(graph.Op(operator.abs, (as_node(self),)))


class Pending(Proxy):
    """`loc[idx] += v`: Python reads `loc[idx]`, adds, and assigns back; this is the middle value: `x op v` as an
    expression, and the edit (`base` read, `do`, `operand`) that the assignment records."""

    def __init__(self, trace, node, base, do, operand):
        super().__init__(trace, node)
        object.__setattr__(self, "_edit", (base, do, operand))


def same_read(a, b):
    """Whether two nodes read the same thing (an in-place edit must assign back to where it read)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, graph.Loc):
        return a.key() == b.key()
    if isinstance(a, graph.Op):
        return a.fn == b.fn and len(a.args) == len(b.args) and all(
            same_read(x, y) if isinstance(x, graph.Node) else _eq(x, y) for x, y in zip(a.args, b.args))
    return a is b


def _eq(x, y):
    try:
        return bool(x == y)
    except Exception:  # noqa: B902 - tensors
        return x is y
