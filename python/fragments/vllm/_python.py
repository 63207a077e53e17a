"""Python steps of fragments.vllm.VLLM's traces, run inside vLLM's workers on whole values.

A trace's `.apply(fn)`, its edits whose value is read from a location (activation patching within one
forward: another location of the same prompt, or another invoke's prompt) and the captures those reads need
are Python steps (fragments.core.step.PythonStep), not plan JSON. The driver sends them once per trace,
cloudpickled, to every worker (collective_rpc "fragments_python_steps": the RPC only an in-process `LLM` can
make; the OpenAI server refuses a body that names them, _server.py) under a fresh group id; each request's plan
names the group and its invoke (`"python_steps": [group, invoke]`). Here they become steps of that request's
plan (_plan.Scheduled), hooked and scheduled like the JSON steps (_worker.py: same locations, same engine
steps, same rows), and run in _worker.WorkerState._act on the request's rows of the whole value by the one
executor of Python steps (fragments.core.executor.run_on_rows):

  capture  keeps a copy of the request's rows (after its steps there) per engine step, until the trace drops
           its program: for reads at later locations, and by later invokes;
  apply    fn(a copy of the rows) -> the replacement, or None for no change;
  edit     "set"/"add"/"scale" of the rows (or an index of them) by an expression (fragments.core.graph) whose
           leaves are locations at the same engine step: at the location being run, the named request's
           current rows when it is in this forward; else its capture at this step (the request's own: from
           this forward). vLLM may run an earlier invoke's prefill before a later invoke arrives, so a capture
           of another request can be from an earlier forward. A location later in the forward, or a value no
           forward has made yet, fails the request with the reason.

Every rank holds the same whole values and runs the same steps, so every rank computes the same edit and
cuts its own piece back out; an exception in a step fails its request alone, on every rank alike.
"""
from __future__ import annotations

import json

from ..core import executor, graph
from . import _plan


def key_of(group, invoke) -> str:
    """The request key of a trace's invoke (fragments.vllm._trace gives its requests these keys)."""
    return f"{group}.{invoke}"


def attach(state, plan, spec) -> None:
    """Adds the Python steps of the request's trace (spec["python_steps"] = [group, invoke]) to `plan`, or records
    why they cannot run. Never raises."""
    if plan.error:
        return
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            return
    ref = spec.get("python_steps") if isinstance(spec, dict) else None
    if ref is None:
        return
    group, invoke = ref
    python = state.python_steps.get(group)
    if python is None:
        plan.error = (f"fragments plan of request {plan.key}: Python steps {group} are not registered in this "
                      "worker (fragments.vllm.VLLM's traces register theirs; a request cannot bring them)")
        return
    # In recording order: a step's `pos` is (how many of the request's plan steps were recorded before it, its
    # place among the Python steps); captures have none: they run last and keep the value that flows on.
    logits = set(state.logits_modules)
    mine = [s for s in python if s.invoke in (None, invoke)]
    last = (float("inf"), 0)
    mine.sort(key=lambda s: tuple(s.pos or last))  # (plan steps before it, recording order)

    def scheduled(s):
        when = _plan.engine_steps("all" if s.steps is None else s.steps, 0)
        return _plan.Scheduled(s, when, s.at.rpartition(".")[0] in logits, group)
    steps, k = [], 0
    for i, s in enumerate(plan.steps):
        while k < len(mine) and tuple(mine[k].pos or last)[0] <= i:
            steps.append(scheduled(mine[k]))
            k += 1
        steps.append(s)
    steps += [scheduled(s) for s in mine[k:]]
    plan.steps[:] = steps


def run(state, location, step, work_item, view, rows_of) -> bool:
    """Runs one Python step (a Scheduled whose `step` is a PythonStep) on `view` (the request's rows of the whole at
    `location`, editable in place); `rows_of(key)` gives another request's rows of this whole (None when it has no
    work here). Returns whether `view` changed; a failure fails the request (state._fail) and changes nothing."""
    live = state.py_live
    python = step.step
    try:
        if python.kind == "capture":
            live[(work_item.key, location, work_item.at_step)] = (state.py_forward, view.detach().clone())
            return False

        def env(leaf):
            if not isinstance(leaf, graph.Loc):
                raise ValueError(f"{leaf!r} cannot be read during vLLM's forward")
            key = work_item.key if leaf.invoke is None else key_of(step.group, leaf.invoke)
            who = "this prompt" if leaf.invoke is None else f"invoke {leaf.invoke}"
            stage = state.stage_of.get(leaf.name, state.stage)
            if stage != state.stage:  # its value never reaches this stage's workers
                raise ValueError(f"{leaf.name} is on pipeline stage {stage} and {location} on stage {state.stage}: "
                                 "a Python step reads values of its own stage only (save the value instead)")
            if leaf.name == location:
                rows = rows_of(key)
                if rows is not None:  # in this forward: its rows as they are now
                    return rows
            forward, rows = live.get((key, leaf.name, work_item.at_step), (None, None))
            if rows is None or (key == work_item.key and forward != state.py_forward):
                raise ValueError(f"{leaf.name} of {who} at step {work_item.at_step} is not available when {location} "
                                 "runs: a value can be written at a later location (or the same one) of this "
                                 "forward, or come from an invoke that vLLM ran before this one at the same step "
                                 "(an earlier invoke), not from a later location")
            return rows
        return executor.run_on_rows(python, view, env)
    except Exception as e:  # noqa: B902 - a user's function or expression: its request fails, alone
        state._fail(work_item.key, f"{location} ({python.kind} recorded at {python.where}) at step "
                                   f"{work_item.at_step}: {type(e).__name__}: {e}")
        return False
