"""The trace of fragments.load's model: a recording (fragments.tracing.tracer) run on this rank as one plan of
the C++ engine (fragments.local.run), and the shapes `.shape`/`.dtype` read inside it (one probe forward).
"""
import json
import os
import warnings

import torch

from .. import _C
from ..core import graph
from ..core.errors import FragmentsError, at_line, user_line
from ..core.saved import unpad
from ..core.tokens import PAD_ID, batch
from ..tracing.envoy import Location
from ..tracing.tracer import Tracer
from . import run


class Trace(Tracer):
    """The recording of one `with model.trace(ids):` block; runs when the block ends (a plan of
    `model.plan()`: at each `run(ids)`)."""

    def __init__(self, model, ids, generate=0):
        Tracer.__init__(self, model, generate)  # (not super(): a trace per call, its cost counted)
        self._plan = ids is None
        self._ids, self.lengths = (None, None) if ids is None else batch(ids)
        self._prepared = None  # run.Prepared, made at the first run: a run again reuses it

    def _finish(self):
        if not self._plan:
            self._run()

    def run(self, ids):
        """Runs this recording again on `ids` (a plan of `model.plan()`, or a trace after its block): one
        forward, with nothing recorded again and, while it is the plan this model ran last, nothing parsed
        or checked again. Its `.save()`s then hold this run's values (a `.value` read before keeps the
        earlier tensor); returns the output (the logits)."""
        if self._model._trace is self:
            raise FragmentsError("run(ids): the recording is still open: run it after its `with` block")
        if self._model._trace is not None:  # a forward now would run in the middle of another recording
            raise FragmentsError("run(ids) inside another trace of this model: run it after that block")
        self._ids, self.lengths = batch(ids)
        self._run()
        return self.output

    def unpad(self, value):
        """Each row of a ragged batch's value trimmed to its prompt's tokens (a list of tensors)."""
        return unpad(value, self.lengths)

    def _meta(self, node):
        """`node` on meta tensors (`.shape`, `.dtype`): each location's shape from one probe forward of this
        rank (once per model; in SPMD every rank asks alike, so the probe's collectives meet)."""
        if self._plan and self._ids is None:
            # user_line(): a location read has no line of its own; `.shape` is asked on the user's line
            raise FragmentsError(f"{user_line()}: a shape in model.plan(): a plan has no token ids until it runs; "
                                 "take shapes in model.trace(ids)")
        return meta_of(node, probed(self._model), tuple(self._ids.shape), self._generate)

    def plan_json(self, folder):
        """Writes this trace as a JSON plan for `frag run --plan` (values in values.safetensors); returns
        the plan's path. The same steps, for comparing with the CLI."""
        from safetensors.torch import save_file
        os.makedirs(folder, exist_ok=True)
        values, entries = {}, []
        for i, step in enumerate(self._steps):
            ref = None
            if step.value is not None:
                values[f"v{i}"] = step.value.reshape(step.value.shape).contiguous()
                ref = f"values.safetensors:v{i}"
            entries.append(step.to_json(ref))
        if values:
            save_file(values, os.path.join(folder, "values.safetensors"))
        path = os.path.join(folder, "plan.json")
        with open(path, "w") as f:
            json.dump({"format": _C.PLAN_FORMAT, "interventions": entries}, f, indent=1)
        return path

    def _prepare(self):
        if self._prepared is None:  # once: a run again has it already
            self._prepared = run.Prepared(self._recorded, None, self._generate)
        return self._prepared

    def _run(self):
        prepared = self._prepare()
        model, key = self._model, prepared.key
        same = key is not None and key == model._plan_key  # the same object when this plan ran last
        model._plan_key = None
        try:
            out, saved, unreached = model._c.run(prepared.steps, prepared.callables, self._ids, self._generate, same)
        except _C.FragError as e:  # a step refused during the forward: said at the line that wrote it
            raise at_line(e, prepared.records()) from None
        model._plan_key = key
        if unreached:
            run.warn_unreached(unreached)
        self.output = out
        if prepared.direct and not self._generate and prepared.recording is self._recorded:
            # this trace's own saves, each the engine's tensor: handed to its SavedValues as they come
            for value, name in zip(self._saves, self._recorded.saves):
                if name is None:
                    value._set(out)
                else:  # (run.one_or_all, inline: a call per save is a tenth of this loop)
                    tensors = saved.get(name, [])
                    value._set(tensors[0] if len(tensors) == 1 else tensors)
            return
        self._results = prepared.results(out, saved, self._generate, model._call)
        self._deliver(*self._results)


def probed(model):
    """{location: (shape, dtype)} of one probe forward of this rank (made once per model)."""
    if getattr(model, "_shapes", None) is None:
        open_trace, model._trace = model._trace, None
        try:
            model._shapes = probe(model, PROBE_SHAPE)
        finally:
            model._trace = open_trace
    return model._shapes


PROBE_SHAPE = (2, 3)  # the probe forward's [rows, tokens]


def probe(model, shape):
    """{location: (shape, dtype)} of every location at its first visit, and "output", in one forward of pad
    tokens of `shape` ([rows, tokens]); every rank runs it alike (the saves gather). Rank-local locations (no rank
    holds them whole) and locations no forward reaches are left out."""
    ids = torch.full(tuple(shape), PAD_ID, dtype=torch.long)
    names = [name for name, kind in model._tree.locations.items() if kind != "rank_local"]
    with warnings.catch_warnings(), Trace(model, ids):  # locations a forward never reaches: no shape
        warnings.simplefilter("ignore")
        saves = {name: Location(model, name).visit(0).save() for name in names}
        out = model.output.save()
    shapes = {name: (tuple(v.value.shape), v.value.dtype) for name, v in saves.items()
              if isinstance(v.value, torch.Tensor)}
    shapes["output"] = (tuple(out.value.shape), out.value.dtype)
    return shapes


def scaled(shape, batch_size, tokens):
    """A location's shape in the probe forward, for a batch of `batch_size` rows of `tokens` tokens: [B, T, ...]
    values, and [T, ...] ones (a decoder layer's positions)."""
    shape = tuple(shape)
    if shape[:2] == PROBE_SHAPE:
        return (batch_size, tokens) + shape[2:]
    if shape[:1] == PROBE_SHAPE[1:]:
        return (tokens,) + shape[1:]
    return shape


def meta_of(node, probe_shapes, ids_shape, generate=0, weight=None):
    """`node` on meta tensors, each location's shape scaled from the probe to a batch of `ids_shape`
    ([rows, longest prompt]); `weight(leaf)`: a whole parameter's meta tensor (a session's)."""
    batch_size, tokens = ids_shape

    def leaf(x, arg):
        if isinstance(x, graph.Weight):
            return graph.as_meta(weight(x))
        if isinstance(x, graph.Call):
            shape, dtype = probe_shapes[f"{x.modules[-1]}.output"]
            return torch.empty(tuple(arg.shape[:-1]) + tuple(shape[-1:]), dtype=dtype, device="meta")
        name = "output" if isinstance(x, graph.Output) else x.name
        if name == "output" and generate:
            return torch.empty((batch_size, tokens + generate), dtype=torch.long, device="meta")
        if name not in probe_shapes:
            raise FragmentsError(f"{x.where}: {name} was not reached by a forward: it has no shape")
        return torch.empty(scaled(probe_shapes[name][0], batch_size, tokens), dtype=probe_shapes[name][1],
                           device="meta")
    return graph.meta(node, leaf)
