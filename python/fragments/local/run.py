"""A recording (fragments.tracing.tracer.Recording) as this rank runs it: a trace of fragments.load, or of a
session, whose ranks run exactly this.

What needs no Python during the forward stays a plan step of the C++ engine (a save of a location, an edit by a
number or a tensor, a module call) and `.apply` a C++ callable. Where an edit's value reads locations (patching
one prompt into another, `h * 2` put back), the locations it writes and reads run a Hook (fragments.core.executor)
as a callable, which the ranks compare as they do for `.apply`; every step at such a location then runs in that
Hook, in recorded order. Saved expressions are computed after the forward from the saves of their leaves (module
calls run ad hoc then). Nothing of this runs where a trace has no Python steps.
"""
import types
import warnings

from ..core import executor, graph
from ..core.errors import FragmentsError
from ..core.step import PythonStep, Step, parse_index_text, plan_key


_NONE = types.MappingProxyType({})  # (read-only: an empty default shared by every Prepared)


class Prepared:
    """A recording as this rank's engine takes it: `steps` for the plan, `callables` ((location, fn, visit,
    label) for fragments._C), `key` (plan_key, when there are no callables), and where each save's value is."""

    _stores = _NONE  # save name -> (modules, copies) of the saves a Hook keeps (see _python_step)

    def __init__(self, recording, weights=None, generate=0):
        self.recording = recording
        self.weights = weights or _NONE
        if not recording.python:  # the common trace: its plan steps as they are
            self.steps, self.callables = recording.steps, []
        else:
            _unscoped(recording.python, generate)
            self._hooks, self._live, self._stores = {}, {}, {}
            self.steps, self.callables = self._split(recording)
        self.key = None if self.callables else plan_key(self.steps)
        # each save the engine's own tensor, nothing computed after: a trace hands them on as they come
        self.direct = not self._stores and not recording.expressions

    def _split(self, recording):
        """(plan steps, callables): the steps at a location where Python runs go into its Hook, in recorded
        order; an `.apply` elsewhere is a callable of its own; then each Hook is one."""
        order = _hooked(recording.python)
        self._hooked, self._hooked_names = set(order), {name for name, _ in order}
        for name, visit in order:
            self._hook(name, visit)
        steps, callables = [], []
        for record in _in_order(recording.steps, recording.python):
            hook = self._hook(record.at, record.visit)
            if isinstance(record, Step):
                if hook is None:
                    steps.append(record)
                else:
                    hook.steps.append(self._python_step(record))
            elif hook is not None:
                hook.steps.append(record)
            else:  # an .apply where no Python edit runs
                callables.append((record.at, record.fn, record.visit, f"apply#{len(callables)}"))
        for i, ((name, visit), hook) in enumerate(self._hooks.items()):
            callables.append((name, hook, visit, f"expression#{i}"))
        return steps, callables

    def records(self):
        """Every step, for naming the user's line of an error (fragments.core.errors.at_line)."""
        return list(self.recording.steps) + list(self.recording.python)

    def _hook(self, name, visit):
        key = (name, visit)
        if key not in self._hooks and (key in self._hooked or name in self._hooked_names):
            # (another visit of a location that runs in Python: a Hook of its own)
            self._hooks[key] = executor.Hook(name, visit, self._live, self.weights)
        return self._hooks.get(key)

    def _python_step(self, step):
        """A plan step at a location where Python runs, as the Hook runs it: a save keeps copies of the whole (a
        module call is made on them after the forward), an edit by a constant edits it."""
        if step.do in ("save", "call"):
            store = []
            self._stores[step.as_] = (step.modules if step.do == "call" else None, store)
            return PythonStep(kind="save", at=step.at, visit=step.visit, store=store, where=step.where)
        value = step.by if step.do == "scale" else step.value
        return PythonStep(kind="edit", at=step.at, visit=step.visit, do=step.do, value=value, where=step.where,
                          index=None if step.index is None else parse_index_text(step.index))

    def results(self, out, saved, generate, call):
        """(each save's value in the recording's order, each saved expression's value) after the forward:
        `saved` the engine's saves (name -> tensors; "step{k}.name" under generation), `call(modules, x)` an
        ad-hoc module call."""
        if self._stores or generate:
            values = [out if name is None else self._value(name, saved, generate, call)
                      for name in self.recording.saves]
        else:  # a forward's own saves: each the tensor (a list when several visits)
            values = [out if name is None else one_or_all(saved.get(name, [])) for name in self.recording.saves]
        computed = []
        if self.recording.expressions:
            leaves = {key: values[i] for key, i in self.recording.captured.items()}
            leaves.update({("weight",) + key: w for key, w in self.weights.items()})
            computed = [executor.compute(node, leaves, call, where) for node, where in self.recording.expressions]
        return values, computed

    def _value(self, name, saved, generate, call):
        if name in self._stores:  # copies a Hook kept: one per visit (and generation step)
            modules, store = self._stores[name]
            if modules is not None:
                store = [call(modules, t.contiguous()) for t in store]
            return store[0] if len(store) == 1 else store
        if generate:
            return [saved[f"step{k}.{name}"][0] if len(saved[f"step{k}.{name}"]) == 1 else saved[f"step{k}.{name}"]
                    for k in range(generate) if f"step{k}.{name}" in saved]
        return one_or_all(saved.get(name, []))


def one_or_all(tensors):
    """A save's value: the tensor of its one visit, else the list (of each visit's; empty when none came)."""
    return tensors[0] if len(tensors) == 1 else tensors


def _hooked(python):
    """(location, visit) pairs where Python runs, in recorded order: those an edit by an expression reads, then
    the one it writes."""
    hooked = {}
    for step in python:
        if step.kind == "edit" and isinstance(step.value, graph.Node):
            hooked.update((leaf.key(), None) for leaf in graph.leaves_of(step.value) if isinstance(leaf, graph.Loc))
            hooked[(step.at, step.visit)] = None
    return list(hooked)


def _in_order(steps, python):
    """Plan steps and Python steps merged back in recorded order (a Python step's pos[0]: the plan steps before
    it)."""
    python = sorted(python, key=lambda p: p.pos)
    k = 0
    for i, step in enumerate(steps):
        while k < len(python) and python[k].pos[0] <= i:
            yield python[k]
            k += 1
        yield step
    yield from python[k:]


def _unscoped(python, generate):
    """Refuses a Python step recorded inside a generation scope: a C++ callable runs at every step."""
    for step in python:
        if generate and (step.steps is not None or step.rows is not None):
            raise FragmentsError(f"{step.where}: {step.at}: a Python step (.apply, an edit that reads a location) acts "
                                 "at every generation step here: record it outside gen.iter[...], prefill(), decode() "
                                 "and rows()")


def warn_unreached(lines):
    for line in lines:
        warnings.warn(line)
