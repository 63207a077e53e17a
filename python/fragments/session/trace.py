"""A session's trace: recorded here (fragments.tracing), sent once to every rank, run there as fragments.load's
model runs a trace (fragments.local.run), rank 0's values sent back once.

Prompts of different lengths run as one right-padded batch (`tracer.lengths`, `tracer.unpad(v)`); within
`tracer.invoke(...)` a location is that invoke's rows and its own tokens (fragments.core.regions.Part): its node
reads them, an index written in the invoke is composed into one of the whole batch, `.apply(fn)` sees them only.
"""
import operator

from ..core import graph
from ..core.errors import FragmentsError, user_line
from ..core.regions import Part, RowsApply, compose
from ..core.saved import unpad
from ..core.tokens import padded
from ..local.trace import meta_of
from ..tracing.tracer import Tracer


class SessionTrace(Tracer):
    """The recording of one `with model.trace(...)` (or `model.generate(...)`) block of a LanguageModel."""

    def __init__(self, session, prompt, generate, options=None):
        super().__init__(session, generate)
        self._options = dict(options or {})
        self._given = None if prompt is None else session._rows(prompt)
        self._invokes = []  # token-id rows per invoke
        self._opened_at = user_line()
        self.lengths = None if self._given is None else [len(r) for r in self._given]

    def invoke(self, prompt):
        """`with tracer.invoke(prompt):` one or more prompts as rows of this trace's batch; locations read
        and edited in the block are those rows' (and their own tokens, where another invoke's prompts are
        longer: `[:, -1]` is this invoke's last token). A value of one invoke can be used in a later one."""
        if self._given is not None and not self._invokes:
            raise FragmentsError("invoke: this trace was given its prompt already; use model.trace() with invokes")
        return _Invoke(self, self._model._rows(prompt))

    def unpad(self, value):
        """Each row of a value of this trace's whole batch trimmed to its prompt's tokens (a list)."""
        return unpad(value, self.lengths)

    # ---- invokes: a location's rows and tokens (`_context`: the open invoke's Part)
    def _locate(self, name, visit, context):
        node = super()._locate(name, visit, context)
        return node if context is None else graph.Op(operator.getitem, (node, context.index()))

    def _whole_index(self, context, index):
        return compose(context, index)

    def _apply_fn(self, fn, context):
        return fn if context is None else RowsApply(fn, context.rows, context.length)

    def _all_rows(self):
        rows = [r for inv in self._invokes for r in inv] if self._invokes else self._given
        if rows is None:
            raise FragmentsError(f"{user_line()}: the trace has no prompt yet: give one to model.trace(...) "
                                 "or use tracer.invoke(...) first")
        return rows

    def _meta(self, node):
        """`node` on meta tensors: the shapes of the batch so far (rows and longest prompt), the rest of each
        location's shape from one probe forward of the ranks (once per session)."""
        rows = self._all_rows()
        session = self._model
        return meta_of(node, session._probe(), (len(rows), max(len(r) for r in rows)), self._generate,
                       weight=lambda leaf: session._weight_value(leaf.module, leaf.attr))

    # ---- running on the ranks
    def _finish(self):
        rows = self._all_rows()
        self.lengths = [len(r) for r in rows]
        if self._generate and self._invokes and len({len(r) for r in rows}) > 1:
            raise FragmentsError(
                f"{self._opened_at}: generation with invokes of prompts of different numbers of tokens "
                f"({sorted({len(r) for r in rows})}): give them as one list, `model.generate([...])`")
        ids = rows if self._generate else padded(rows)  # generation pads (and tracks positions) itself
        replies = self._model._request("run", (self._recording(), ids, self._generate, self._options))
        values, computed, digests = replies[0]
        for r in range(1, len(replies)):
            for i, d in enumerate(replies[r][2]):
                if digests[i] != d:
                    where = self._recorded.expressions[i][1]
                    raise FragmentsError(f"a value computed in the trace differs across ranks (expression {i}, "
                                         f"recorded at {where}: rank 0 {digests[i]}, rank {r} {d}): the "
                                         "computation must be deterministic")
        self._deliver(values, computed)


class _Invoke:
    def __init__(self, trace, rows):
        self._trace, self._ids = trace, rows

    def __enter__(self):
        t = self._trace
        start = sum(len(i) for i in t._invokes)
        t._invokes.append(self._ids)
        length = None if t._generate else max(len(r) for r in self._ids)
        t._context = Part(slice(start, start + len(self._ids)), length)
        return t

    def __exit__(self, *exc):
        self._trace._context = None
        return False
