"""The index arithmetic every backend shares, written once.

Heads: a location laid out in attention heads (ir::head_layout: q/k/v segments of qkv_proj's output, the heads
of o_proj's input) has regions `name -> (start, stop, head_dim)` on its last dim, in whole coordinates; a region
is the index `[..., start:stop]`, head i of it `[..., start + i*head_dim : start + (i+1)*head_dim]`.

Invokes: an invoke of a session's trace is some rows of the batch and their own tokens (`Part`); an index the
user writes within it counts in those rows and tokens, `compose` turns it into an index of the whole batch.
"""
import numbers

from .errors import FragmentsError


def region_index(start, stop):
    """A region of the last dim as an index."""
    return (Ellipsis, slice(start, stop))


def head_count(start, stop, head_dim):
    return (stop - start) // head_dim


def head_bounds(start, stop, head_dim, i, what):
    """(start, stop) of head `i` (negative: from the end) of the region [start, stop); IndexError names `what`."""
    count = head_count(start, stop, head_dim)
    if not isinstance(i, numbers.Integral) or not -count <= i < count:
        raise IndexError(f"{what}.heads[{i!r}]: it has {count} heads (0 to {count - 1})")
    a = start + (i % count) * head_dim
    return a, a + head_dim


class Part:
    """An invoke's part of the batch: its rows, and its tokens (`length`: the longest of its prompts; the batch is
    right-padded past it when another invoke's prompts are longer). `length` None: every token (generation,
    where a decode step has one)."""

    def __init__(self, rows, length):
        self.rows, self.length = rows, length

    def index(self):
        return (self.rows,) if self.length is None else (self.rows, slice(0, self.length))


def compose(part, index):
    """An index within an invoke's rows and tokens as an index of the whole batch."""
    if part is None:
        return index
    rows = part.rows
    items = () if index is None else (index if isinstance(index, tuple) else (index,))
    if not items:
        return part.index()
    first, rest = items[0], items[1:]
    if first is Ellipsis:
        return part.index() + (Ellipsis,) + rest
    if isinstance(first, numbers.Integral):
        n = rows.stop - rows.start
        if not -n <= first < n:
            raise FragmentsError(f"row {first} of an invoke of {n} prompt(s)")
        row = rows.start + first % n
    elif isinstance(first, slice) and first.step in (None, 1):
        start, stop, _ = first.indices(rows.stop - rows.start)
        row = slice(rows.start + start, rows.start + stop)
    else:
        raise FragmentsError(f"index {index!r} of an invoke's rows: use integers or slices")
    if part.length is None:
        return (row,) + rest
    return (row,) + _tokens(rest, part.length, index)


def _tokens(rest, length, index):
    """The token part of an invoke's index, counted within its own `length` tokens (`-1`: its last)."""
    if not rest:
        return (slice(0, length),)
    second, after = rest[0], rest[1:]
    if second is Ellipsis:
        return (slice(0, length), Ellipsis) + after
    if isinstance(second, numbers.Integral):
        if not -length <= second < length:
            raise FragmentsError(f"token {second} of an invoke's prompts of {length} tokens")
        return (second % length,) + after
    if isinstance(second, slice):
        return (slice(*second.indices(length)),) + after
    raise FragmentsError(f"index {index!r} of an invoke's tokens: use integers, slices or ...")


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
