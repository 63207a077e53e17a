"""Python steps of fragments.vllm.VLLM's traces, run inside vLLM's workers on whole values.

A trace's `.apply(fn)`, its edits whose value is read from a location (activation patching within one
forward: another location of the same prompt, or another invoke's prompt) and the captures those reads need
are Python, not plan JSON. The driver sends them once per trace, cloudpickled, to every worker
(collective_rpc "fragments_program": the RPC only an in-process `LLM` can make; the OpenAI server refuses a
body that names a program, _server.py) under a fresh group id; each request's plan names the group and its
invoke (`"program": [group, invoke]`). Here they become steps of that request's plan (PyStep), hooked and
scheduled like the JSON steps (_worker.py: same locations, same engine steps, same rows), and run in
_worker.WorkerState._act on the request's rows of the whole value:

  capture  keeps a copy of the request's rows (after its steps there) per engine step, until the trace drops
           its program: for reads at later locations, and by later invokes;
  apply    fn(a copy of the rows) -> the replacement, or None for no change;
  edit     "set"/"add"/"scale" of the rows (or an index of them) by an expression (fragments._proxy) whose
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

import torch

from . import _plan


class PyStep:
    """One Python step of a request's plan (the attributes _worker reads from plan steps)."""
    __slots__ = ("at", "kind", "fn", "node", "index", "op", "where", "steps", "logits", "group", "invoke")
    do = "python"
    as_ = None
    runs_at = _plan.Step.runs_at

    def __init__(self, entry, group, invoke, logits):
        self.at, self.kind, self.where = entry["at"], entry["kind"], entry.get("where", "?")
        self.fn, self.node, self.index, self.op = entry.get("fn"), entry.get("node"), entry.get("index"), entry.get("do")
        self.steps = _plan._steps(entry.get("step", "all"), 0)
        self.logits, self.group, self.invoke = logits, group, invoke


def key_of(group, invoke) -> str:
    """The request key of a trace's invoke (fragments.vllm._trace gives its requests these keys)."""
    return f"{group}.{invoke}"


def attach(state, plan, spec) -> None:
    """Adds the steps of the request's program (spec["program"] = [group, invoke]) to `plan`, or records
    why it cannot run. Never raises."""
    if plan.error:
        return
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            return
    ref = spec.get("program") if isinstance(spec, dict) else None
    if ref is None:
        return
    group, invoke = ref
    program = state.programs.get(group)
    if program is None:
        plan.error = (f"fragments plan of request {plan.key}: Python program {group} is not registered in this "
                      "worker (fragments.vllm.VLLM's traces register theirs; a request cannot bring one)")
        return
    # In recording order: an entry's "pos" is (how many of the request's plan steps were recorded before it,
    # its place among the Python steps); captures have none: they run last and keep the value that flows on.
    logits = set(state.logits_modules)
    mine = [e for e in program if e["invoke"] in (None, invoke)]
    last = (float("inf"), 0)
    mine.sort(key=lambda e: tuple(e.get("pos", last)))  # (plan steps before it, recording order)
    steps, k = [], 0
    for i, s in enumerate(plan.steps):
        while k < len(mine) and tuple(mine[k].get("pos", last))[0] <= i:
            steps.append(PyStep(mine[k], group, invoke, mine[k]["at"].rpartition(".")[0] in logits))
            k += 1
        steps.append(s)
    steps += [PyStep(e, group, invoke, e["at"].rpartition(".")[0] in logits) for e in mine[k:]]
    plan.steps[:] = steps


def run(state, location, step, work_item, view, rows_of) -> bool:
    """Runs one PyStep on `view` (the request's rows of the whole at `location`, editable in place);
    `rows_of(key)` gives another request's rows of this whole (None when it has no work here). Returns
    whether `view` changed; a failure fails the request (state._fail) and changes nothing."""
    live = state.py_live
    try:
        if step.kind == "capture":
            live[(work_item.key, location, work_item.at_step)] = (state.py_forward, view.detach().clone())
            return False
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
        from .._proxy import Loc, evaluate

        def env(leaf):
            if not isinstance(leaf, Loc):
                raise ValueError(f"{leaf!r} cannot be read during vLLM's forward")
            invoke = getattr(leaf, "invoke", None)
            key = work_item.key if invoke is None else key_of(step.group, invoke)
            who = "this prompt" if invoke is None else f"invoke {invoke}"
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

        value = evaluate(step.node, env)
        if isinstance(value, torch.Tensor):
            value = value.to(device=view.device, dtype=view.dtype)
        target = view if step.index is None else view[step.index]
        if step.op == "set":
            target.copy_(torch.broadcast_to(torch.as_tensor(value, dtype=view.dtype), target.shape))
        elif step.op == "add":
            target += value
        elif step.op == "scale":
            target *= value
        else:
            raise ValueError(f"unknown edit {step.op!r}")
        return True
    except Exception as e:  # noqa: B902 - a user's function or expression: its request fails, alone
        state._fail(work_item.key, f"{location} ({step.kind} recorded at {step.where}) at step "
                                   f"{work_item.at_step}: {type(e).__name__}: {e}")
        return False
