"""The one executor of Python-side steps (fragments.core.step.PythonStep), wherever a whole value is:

  - `Hook`: the steps at one location and visit, as a callable the C++ engine runs at every visit (a rank of
    fragments.load or of a session: fragments.local.run registers it like `.apply`);
  - `run_on_rows`: one step on a request's rows of a whole in a vLLM worker (fragments.vllm._python schedules
    them among the request's plan steps);
  - `compute`: a saved expression after the forward, from the values its leaves saved.

`edit` is the one switch over what an edit does in Python (set, add, scale, zero); the C++ PlanBinder is the
one executor of plan steps (program/plan_binder.cpp), and a vLLM worker's plan steps on whole rows go through
`edit` too (fragments.vllm._worker).
"""
import hashlib

import torch

from . import graph
from .errors import FragmentsError, StepError, at


def edit(target, do, value=None, by=1.0):
    """`target` (a view of a whole the caller may write) set, added to, scaled or zeroed, in place. `value`: a
    tensor (on target's device) or a number; a scale by a tensor takes it as the factor. A value that does not
    fit the target (after broadcasting) is a ValueError."""
    if do == "zero":
        update = torch.zeros_like(target)
    elif do == "scale":
        update = target * (by if value is None else value)
    elif do == "add":
        update = target + (value.to(target.dtype) if isinstance(value, torch.Tensor) else value)
    elif do == "set":
        update = torch.as_tensor(value, dtype=target.dtype, device=target.device).expand_as(target)
    else:
        raise ValueError(f"unknown edit {do!r}")
    if update.shape != target.shape:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
        raise ValueError(f"value of shape {shape} does not fit {tuple(target.shape)}")
    target.copy_(update)


def step_value(step, env, like):
    """An edit step's value: its expression evaluated (`env(leaf)` gives a leaf's whole), or its constant; a
    tensor moved to `like`'s device and dtype."""
    value = graph.evaluate(step.value, env) if isinstance(step.value, graph.Node) else step.value
    if isinstance(value, torch.Tensor):
        value = value.to(device=like.device, dtype=like.dtype)
    return value


class Hook:
    """One location and visit's Python steps, in recorded order, on the whole tensor at every visit: the
    callable a rank registers there (it returns the replacement, or None when nothing changed). `live` is
    shared by a trace's hooks: each location's current whole, which edits elsewhere read; `weights`: whole
    parameters (a session's) by (module, attribute)."""

    def __init__(self, name, visit, live, weights=None):
        self.name, self.visit, self.live, self.weights = name, visit, live, weights or {}
        self.steps = []

    def __call__(self, whole):
        key = (self.name, self.visit)
        cur, changed = whole, False
        self.live[key] = cur
        for step in self.steps:
            if step.kind in ("save", "capture"):
                step.store.append(cur.detach().clone())
                continue
            try:
                if step.kind == "apply":
                    out = step.fn(cur)
                    if out is None:
                        continue
                    cur = out
                else:
                    value = step_value(step, self._leaf, cur)
                    if not changed:
                        cur = cur.clone()
                    edit(cur if step.index is None else cur[step.index], step.do, value)
                changed = True
            except StepError:
                raise
            except Exception as e:  # noqa: B902 - said at the user's line
                what = f"{self.name}.apply" if step.kind == "apply" else self.name
                raise at(step.where, f"{what}: {type(e).__name__}: {e}") from None
            self.live[key] = cur
        return cur if changed else None

    def _leaf(self, leaf):
        if isinstance(leaf, graph.Loc):
            key = leaf.key()
            if key not in self.live:
                raise FragmentsError(f"{leaf!r} is read before the forward reached it: a value can be used "
                                     "at a later location (or the same one), not an earlier one")
            return self.live[key]
        if isinstance(leaf, graph.Weight):
            return self.weights[(leaf.module, leaf.attr)]
        raise FragmentsError(f"{leaf!r} exists only after the forward: it cannot be the value of an edit")


def run_on_rows(step, view, env):
    """One Python step on `view` (a request's rows of a whole, which this step may write: a vLLM worker's);
    `env(leaf)` gives a location's rows. Returns whether `view` changed; raises what the step raised."""
    if step.kind == "apply":
        out = step.fn(view.detach().clone())
        if out is None:
            return False
        if not isinstance(out, torch.Tensor) or out.shape != view.shape:
            raise ValueError(f"apply's function returned {type(out).__name__}"
                             f"{' of shape ' + str(tuple(out.shape)) if isinstance(out, torch.Tensor) else ''}; "
                             f"expected None or a tensor of shape {tuple(view.shape)}")
        view.copy_(out.to(view.dtype))
        return True
    value = step_value(step, env, view)
    edit(view if step.index is None else view[step.index], step.do, value)
    return True


def compute(node, values, call, where):
    """A saved expression's value after the forward: `values[leaf_key]` the saved whole of each leaf (a list
    when the leaf was saved at several visits or generation steps: the expression then maps over them);
    `call(modules, x)` runs modules ad hoc. Errors are said at the user's line `where`."""
    leaves = {graph.leaf_key(leaf): values[graph.leaf_key(leaf)] for leaf in graph.leaves_of(node)}

    def one(env_values):
        def env(leaf):
            if isinstance(leaf, graph.Call):
                return call(leaf.modules, graph.evaluate(leaf.arg, env).contiguous())
            return env_values[graph.leaf_key(leaf)]
        return graph.evaluate(node, env)
    try:
        return detach(_map_lists(one, leaves))
    except StepError:
        raise
    except Exception as e:  # noqa: B902 - said at the user's line
        raise at(where, f"{type(e).__name__}: {e}") from None


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


def detach(value):
    """A computed value with its tensors detached and on the CPU (containers and named tuples kept)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        items = [detach(v) for v in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    return value


def digest(value):
    """A short digest of a computed value (its tensors' dtypes, shapes and bytes): what ranks compare."""
    h = hashlib.sha1()
    for t in (list(value) if isinstance(value, (list, tuple)) else [value]):
        if isinstance(t, torch.Tensor):
            t = t.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # 0-dim too
        else:
            h.update(repr(t).encode())
    return h.hexdigest()[:16]
