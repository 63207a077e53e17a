"""A session trace as a rank runs it: the driver's recording (fragments._session) replayed on this rank's
`fragments.Model`, every rank alike.

What needs no Python during the forward stays a plan step of the C++ engine (a save of a location, an
edit by a number or a tensor, `.apply`). Expressions (fragments._proxy) run in Python on whole tensors:
  - an edit whose value reads a location (patching one prompt into another, `h * 2` put back) is a
    callable at the locations it reads and writes (`Location.apply`), so the ranks compare its result as
    they do for `.apply`; every step at such a location then runs in that callable, in recorded order;
  - a saved expression is computed after the forward from the plan's saves (or the callables' copies),
    module calls (`model.lm_head(...)`) run ad hoc then; the ranks compare a digest of each result.
Nothing of this runs where a trace has no expressions.
"""
import hashlib
import torch

from . import _C, _proxy
from ._model import FragmentsError


class StepError(FragmentsError):
    """A failure of one recorded step, reported at the user's line (`where`)."""


def _at(where, message):
    return StepError(f"{where}: {message}")


def _weights_env(weights):
    return lambda leaf: weights[(leaf.module, leaf.attr)]


def _digest(value):
    h = hashlib.sha1()
    for t in (value if isinstance(value, (list, tuple)) else [value]):
        if isinstance(t, torch.Tensor):
            t = t.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # 0-dim too
        else:
            h.update(repr(t).encode())
    return h.hexdigest()[:16]


def _map_lists(fn, leaves):
    """fn over leaves' values; a leaf with several values (visits, generation steps) maps over them."""
    lengths = {len(v) for v in leaves.values() if isinstance(v, list) and len(v) != 1}
    if not lengths:
        return fn({k: (v[0] if isinstance(v, list) else v) for k, v in leaves.items()})
    if len(lengths) > 1:
        raise FragmentsError(f"values computed from locations visited different numbers of times ({sorted(lengths)})")
    n = lengths.pop()
    return [fn({k: (v[i] if isinstance(v, list) and len(v) == n else (v[0] if isinstance(v, list) else v))
                for k, v in leaves.items()}) for i in range(n)]


def _leaf_key(leaf):
    if isinstance(leaf, _proxy.Loc):
        return ("loc",) + leaf.key()
    if isinstance(leaf, _proxy.Output):
        return ("output",)
    if isinstance(leaf, _proxy.Weight):
        return ("weight", leaf.module, leaf.attr)
    raise TypeError(leaf)


def _has_locations(node):
    return any(isinstance(leaf, (_proxy.Loc, _proxy.Output)) for leaf in _proxy._leaves_of(node))


def _calls_in(node, out):
    if isinstance(node, _proxy.Call):
        out.append(node)
    elif isinstance(node, _proxy.Op):
        for a in list(node.args) + list(node.kwargs.values()):
            _calls_in(a, out)
    elif isinstance(node, (list, tuple)):
        for a in node:
            _calls_in(a, out)
    return out


class _Hook:
    """One location and visit's callable: the steps recorded there, in order, on the whole tensor."""

    def __init__(self, name, visit, live):
        self.name, self.visit, self.live = name, visit, live
        self.steps = []

    def __call__(self, whole):
        key = (self.name, self.visit)
        cur, changed = whole, False
        self.live[key] = cur
        env = lambda leaf: self._leaf(leaf)  # noqa: E731
        for step in self.steps:
            kind = step[0]
            if kind == "save":
                _, store, where = step
                store.append(cur.detach().clone())
            elif kind == "edit":
                _, index, do, value, where = step
                try:
                    v = _proxy.evaluate(value, env) if isinstance(value, _proxy.Node) else value
                    if isinstance(v, torch.Tensor):
                        v = v.to(device=cur.device, dtype=cur.dtype)
                    if not changed:
                        cur, changed = cur.clone(), True
                    target = cur if index is None else cur[index]
                    if do == "set":
                        if index is None:
                            cur = torch.broadcast_to(torch.as_tensor(v, dtype=cur.dtype), cur.shape).clone()
                        else:
                            cur[index] = v
                    elif do == "add":
                        target += v
                    elif do == "scale":
                        target *= v
                    else:
                        raise FragmentsError(f"unknown edit {do}")
                except StepError:
                    raise
                except Exception as e:  # noqa: B902 - said at the user's line
                    raise _at(where, f"{self.name}: {type(e).__name__}: {e}") from None
                self.live[key] = cur
            elif kind == "apply":
                _, fn, where = step
                try:
                    out = fn(cur)
                except Exception as e:  # noqa: B902
                    raise _at(where, f"{self.name}.apply: {type(e).__name__}: {e}") from None
                if out is not None:
                    if not changed:
                        changed = True
                    cur = out
                    self.live[key] = cur
            elif kind == "capture":
                _, store = step
                store.append(cur.detach().clone())
        return cur if changed else None

    def _leaf(self, leaf):
        if isinstance(leaf, _proxy.Loc):
            key = leaf.key()
            if key not in self.live:
                raise FragmentsError(f"{leaf!r} is read before the forward reached it: a value can be used "
                                     "at a later location (or the same one), not an earlier one")
            return self.live[key]
        if isinstance(leaf, _proxy.Weight):
            return self.weights[(leaf.module, leaf.attr)]
        raise FragmentsError(f"{leaf!r} exists only after the forward: it cannot be the value of an edit")


def _location(model, name, visit):
    """The Model's location object for a name ("model.layers.3.output")."""
    if name == "output":
        return model.output
    from ._model import Location
    loc = Location(model, name)
    return loc if visit is None else loc.visit(visit)


def run(model, program, weights):
    """Runs one recorded trace on this rank. Returns {key: value} of the saves, {key: digest} of the
    computed ones (the driver compares them across ranks), and the forward's unreached-visit lines."""
    ids, generate, steps = program["ids"], program["generate"], program["steps"]
    # Locations whose steps run in a callable: those an edit by an expression writes or reads.
    hooked = set()
    for step in steps:
        if step[0] == "edit" and isinstance(step[5], _proxy.Node) and _has_locations(step[5]):
            hooked.add((step[1], step[2]))
            for leaf in _proxy._leaves_of(step[5]):
                if isinstance(leaf, _proxy.Output):
                    raise _at(step[6], "model.output exists only after the forward: it cannot be an edit's value")
                hooked.add(leaf.key())
            if _calls_in(step[5], []):
                raise _at(step[6], "a module called ad hoc runs after the forward: it can be saved or computed "
                                   "with, not be an edit's value")
    hook_names = {name for name, _ in hooked}
    live, hooks = {}, {}
    for name, visit in hooked:
        hooks[(name, visit)] = _Hook(name, visit, live)
        hooks[(name, visit)].weights = weights

    def hook_for(name, visit, where):
        if (name, visit) in hooks:
            return hooks[(name, visit)]
        if name in hook_names:  # another visit of a location that runs in callables: one of its own
            hooks[(name, visit)] = _Hook(name, visit, live)
            hooks[(name, visit)].weights = weights
            return hooks[(name, visit)]
        return None

    saves = {}        # key -> SavedValue or list (a hook's copies) or ("expr", node, leaves)
    captured = {}     # leaf key -> SavedValue / list, for expressions computed after the forward
    trace = model.generate(ids, generate) if generate else model.trace(ids)
    try:
        _record(model, trace, steps, hooks, hook_for, saves, captured, weights)
    except StepError:
        raise
    except _C.FragError as e:  # a plan step refused at the forward: said at the line that wrote it
        message = str(e)
        where = next((s[-1] for s in steps if len(s) > 2 and isinstance(s[1], str) and s[1] in message), None)
        raise (_at(where, message) if where else e) from None
    return _results(model, saves, captured, weights)


def _record(model, trace, steps, hooks, hook_for, saves, captured, weights):
    with trace:
        def capture(leaf, where):
            key = _leaf_key(leaf)
            if key in captured or key[0] == "weight":
                return
            if key[0] == "output":
                captured[key] = model.output.save()
                return
            hook = hook_for(leaf.name, leaf.visit, where)
            if hook is not None:
                store = []
                hook.steps.append(("capture", store))
                captured[key] = store
            else:
                try:
                    captured[key] = _location(model, leaf.name, leaf.visit).save()
                except FragmentsError as e:
                    raise _at(where, str(e)) from None

        for step in steps:
            kind = step[0]
            if kind == "save":
                _, node, key, where = step
                if isinstance(node, _proxy.Loc) and hook_for(node.name, node.visit, where) is None:
                    try:
                        saves[key] = _location(model, node.name, node.visit).save()
                    except FragmentsError as e:
                        raise _at(where, str(e)) from None
                elif isinstance(node, _proxy.Loc):
                    store = []
                    hook_for(node.name, node.visit, where).steps.append(("save", store, where))
                    saves[key] = store
                elif isinstance(node, _proxy.Output):
                    saves[key] = model.output.save()
                else:
                    for leaf in _proxy._leaves_of(node):
                        capture(leaf, where)
                    saves[key] = ("expr", node, where)
            elif kind == "edit":
                _, name, visit, index, do, value, where = step
                hook = hook_for(name, visit, where)
                if hook is not None:
                    if isinstance(value, _proxy.Node) and not _has_locations(value):
                        value = _proxy.evaluate(value, _weights_env(weights))
                    hook.steps.append(("edit", index, do, value, where))
                    continue
                if isinstance(value, _proxy.Node):
                    value = _proxy.evaluate(value, _weights_env(weights))
                try:
                    _plan_edit(model, name, visit, index, do, value)
                except FragmentsError as e:
                    raise _at(where, str(e)) from None
            elif kind == "apply":
                _, name, visit, fn, where = step
                hook = hook_for(name, visit, where)
                if hook is not None:
                    hook.steps.append(("apply", fn, where))
                else:
                    _location(model, name, visit).apply(_labelled(fn, where, name))
        for (name, visit), hook in hooks.items():
            _location(model, name, visit).apply(hook)


def _labelled(fn, where, name):
    def call(whole):
        try:
            return fn(whole)
        except Exception as e:  # noqa: B902
            raise _at(where, f"{name}.apply: {type(e).__name__}: {e}") from None
    return call


def _plan_edit(model, name, visit, index, do, value):
    """An edit by a number or a tensor: a plan step through the Model's own API."""
    if name == "output":
        raise FragmentsError("model.output (the logits) cannot be edited: edit lm_head's input or output")
    loc = _location(model, name, visit)
    if isinstance(value, torch.Tensor) and value.dtype != model.dtype and value.is_floating_point():
        value = value.to(model.dtype)
    view = loc if index is None else loc[index]
    if do == "set":
        if index is None:
            model._active_trace("edit")._edit(loc, None, value)
        else:
            loc[index] = value
        return
    if do == "add":
        pending = view.__iadd__(value)
    elif do == "scale":
        if not _proxy.is_number(value):
            raise FragmentsError(f"{name} *= ...: multiply by a number here (a tensor factor: compute "
                                 f"`loc[...] = loc[...] * t`)")
        pending = view.__imul__(value)
    else:
        raise FragmentsError(f"unknown edit {do}")
    if index is None:
        model._active_trace("edit")._edit(loc, None, pending)
    else:
        loc[index] = pending


def _value_of(saved):
    if isinstance(saved, list):  # a hook's copies: one per visit
        return saved[0] if len(saved) == 1 else saved
    return saved.value


def _results(model, saves, captured, weights):
    out, digests = {}, {}
    values = {k: _value_of(v) for k, v in captured.items()}

    def compute(node, where):
        leaves = {}
        for leaf in _proxy._leaves_of(node):
            key = _leaf_key(leaf)
            leaves[key] = weights[(leaf.module, leaf.attr)] if key[0] == "weight" else values[key]

        def one(env_values):
            def env(leaf):
                if isinstance(leaf, _proxy.Call):
                    x = _proxy.evaluate(leaf.arg, env)
                    return model._c.call(leaf.modules, x.contiguous())
                return env_values[_leaf_key(leaf)]
            return _proxy.evaluate(node, env)
        try:
            return _map_lists(one, leaves)
        except StepError:
            raise
        except Exception as e:  # noqa: B902 - said at the user's line
            raise _at(where, f"{type(e).__name__}: {e}") from None

    for key, saved in saves.items():
        if isinstance(saved, tuple) and saved and saved[0] == "expr":
            value = compute(saved[1], saved[2])
            value = _detach(value)
            out[key] = value
            digests[key] = _digest(value if not isinstance(value, tuple) else list(value))
        else:
            out[key] = _value_of(saved)
    return out, digests


def _detach(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        items = [_detach(v) for v in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    return value



def probe(model, shape):
    """{location: (shape, dtype)} of every location at its first visit, and "output", in one forward of
    pad tokens of `shape` ([rows, tokens]); every rank runs it alike (the saves gather). Locations that no
    rank holds whole (rank-local ones, refused by the plan) are left out."""
    import re
    import warnings
    from ._model import PAD_ID, Location
    ids = torch.full(tuple(shape), PAD_ID, dtype=torch.long)
    names = list(model._location_kinds)
    while True:
        try:
            with warnings.catch_warnings(), model.trace(ids):  # locations a forward never reaches: no shape
                warnings.simplefilter("ignore")
                saves = {name: Location(model, name).visit(0).save() for name in names}
                out = model.output.save()
            break
        except _C.FragError as e:
            local = re.search(r"at (\S+)\): \1 is rank-local", str(e))
            if local is None or local.group(1) not in names:
                raise
            names.remove(local.group(1))
    shapes = {name: (tuple(v.value.shape), v.value.dtype) for name, v in saves.items()
              if isinstance(v.value, torch.Tensor)}
    shapes["output"] = (tuple(out.value.shape), out.value.dtype)
    return shapes
