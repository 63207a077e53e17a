"""The expression graph a trace records (fragments.tracing makes it) and its evaluation wherever the whole
values are (fragments.core.executor, the backends).

Leaves are a location's whole value (`Loc`), the forward's result (`Output`), a module's parameter read whole
(`Weight`, a session's) and constants; `Call` runs modules of the model ad hoc on a value; `Op` is any function
or tensor method. Nodes are plain picklable objects: a function travels by reference (`torch.topk`,
`operator.mul`) or, for `.apply`, by value through cloudpickle.
"""
import torch


class Node:
    """A value of the expression graph. `where`: the user's file:line that made it."""

    where = "?"

    def leaves(self):
        return []


class Loc(Node):
    """The whole tensor at a location (`name`), at visit `visit` (None: the current/every visit); `invoke`: a
    vLLM trace's invoke (prompt) the value belongs to (None: the one being run)."""

    def __init__(self, name, visit=None, invoke=None):
        self.name, self.visit = name, visit
        if invoke is not None:
            self.invoke = invoke

    invoke = None

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
    """Modules of the rank file called ad hoc on a value (`model.lm_head(model.model.norm(h))`)."""

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
            out += leaves_of(a)
        return out

    def __repr__(self):
        name = self.fn[1] if isinstance(self.fn, tuple) else getattr(self.fn, "__name__", "fn")
        return f"{name}(...)"


def leaves_of(x):
    """The leaves under `x` (a node, or containers of nodes)."""
    if isinstance(x, Node):
        return x.leaves()
    if isinstance(x, (list, tuple)):
        return [leaf for item in x for leaf in leaves_of(item)]
    if isinstance(x, dict):
        return [leaf for item in x.values() for leaf in leaves_of(item)]
    return []


def calls_in(node, out=None):
    """The Call nodes under `node`."""
    out = [] if out is None else out
    if isinstance(node, Call):
        out.append(node)
    elif isinstance(node, Op):
        for a in list(node.args) + list(node.kwargs.values()):
            calls_in(a, out)
    elif isinstance(node, (list, tuple)):
        for a in node:
            calls_in(a, out)
    return out


def reads_locations(node):
    """Whether `node` reads a location or the output (else it is computed from constants and weights)."""
    return any(isinstance(leaf, (Loc, Output)) for leaf in leaves_of(node))


def leaf_key(leaf):
    """The key a leaf's value is kept under: ("loc", name, visit), ("output",), ("weight", module, attr)."""
    if isinstance(leaf, Loc):
        return ("loc",) + leaf.key()
    if isinstance(leaf, Output):
        return ("output",)
    if isinstance(leaf, Weight):
        return ("weight", leaf.module, leaf.attr)
    raise TypeError(leaf)


def evaluate(node, env, const=None):
    """The value of `node`; `env(leaf)` gives a leaf's (or a Call's) whole tensor; `const(x)`, if given, maps
    constants."""
    if isinstance(node, (Loc, Output, Weight, Call)):
        return env(node)
    if isinstance(node, Const):
        return node.value if const is None else const(node.value)
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


def meta(node, leaf):
    """What `node` would be, computed on meta tensors (shape and dtype, no data): `leaf(l, arg)` gives a leaf's
    meta tensor (a Call's `arg`: its argument's). A trace's `.shape` and `.dtype` come from this; nothing runs on
    the ranks."""
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


def to_device(value, device):
    """Tensors in a recording (its constants, the nodes' tensors) moved to `device`: the ranks compute on their
    device, the driver gets CPU tensors."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Const):
        return Const(to_device(value.value, device))
    if isinstance(value, Op):
        node = Op(value.fn, to_device(value.args, device), to_device(value.kwargs, device))
        node.where = value.where
        return node
    if isinstance(value, Call):
        node = Call(value.modules, to_device(value.arg, device))
        node.where = value.where
        return node
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    if isinstance(value, tuple):
        items = [to_device(v, device) for v in value]
        if hasattr(value, "_fields"):
            return type(value)(*items)
        return tuple(items) if type(value) is tuple else type(value)(items)
    return value
