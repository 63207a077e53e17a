"""What `.save()` returns, on every backend: a SavedValue that holds the whole tensor once its trace ran."""
from .errors import FragmentsError


class SavedValue:
    """What `.save()` returns: the whole tensor once its trace has run (a list when several visits)."""

    _ready = False
    _value = None

    def __init__(self, what, post=None):
        self._what = what
        self._post = post  # a view of the saved whole (a head), applied when the value arrives

    def _set(self, value):
        if self._post is not None:
            value = [self._post(v) for v in value] if isinstance(value, list) else self._post(value)
        self._value, self._ready = value, True

    @property
    def value(self):
        if not self._ready:
            raise FragmentsError(f"{self._what}.save() was read before its trace ran: a saved value exists "
                                 "once the `with model.trace(...)` block has ended")
        return self._value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        args = [unwrap(a) for a in args]
        kwargs = {k: unwrap(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.value, name)

    def __getitem__(self, index):
        return self.value[index]

    def __len__(self):
        return len(self.value)

    def __repr__(self):
        return f"SavedValue({self._what}: {self._value!r})" if self._ready else f"SavedValue({self._what}, pending)"

    def __add__(self, other): return self.value + unwrap(other)
    def __radd__(self, other): return unwrap(other) + self.value
    def __sub__(self, other): return self.value - unwrap(other)
    def __rsub__(self, other): return unwrap(other) - self.value
    def __mul__(self, other): return self.value * unwrap(other)
    def __rmul__(self, other): return unwrap(other) * self.value
    def __truediv__(self, other): return self.value / unwrap(other)
    def __neg__(self): return -self.value


def unwrap(x):
    """A SavedValue's tensor; anything else as it is."""
    return x.value if isinstance(x, SavedValue) else x


def unpad(value, lengths):
    """Each row of a ragged batch's value ([B, longest, ...], or a list of them per visit) trimmed to its
    prompt's tokens: a list of [length, ...] tensors."""
    if isinstance(value, SavedValue):
        value = value.value
    if isinstance(value, list):
        return [unpad(v, lengths) for v in value]
    if value.dim() < 2 or value.shape[0] != len(lengths):
        raise FragmentsError(f"unpad: a value of shape {list(value.shape)} is not [rows={len(lengths)}, tokens, ...]")
    return [value[b, :n] for b, n in enumerate(lengths)]
