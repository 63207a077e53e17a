"""What the recorder knows of a model, whatever runs it: its module tree, its locations and their kinds (a
rank-local one with why no rank holds it whole), its dtype and the head layout of a location.

Each backend describes its model once (fragments.local: the rank file, through fragments._C; a session: rank
0's, sent to the driver; fragments.vllm: the workers' model record). `render` is the tree `repr(model)` prints.
"""


def rank_local_reason(location, derived_from, whole_at=None):
    """Why a rank-local location has no whole value (the words of program/plan_binder.cpp's refusal)."""
    if whole_at:
        return (f"{location} is rank-local (derived from {derived_from}): no rank holds its whole value here; the "
                f"same value is whole at {whole_at}: intervene there instead")
    return (f"{location} is rank-local (derived from {derived_from}): no rank holds its whole value; intervene at "
            "a fragmented location (`frag inspect` lists them), e.g. the input of the parallel layer it flows into")


class ModelTree:
    """`modules`: [(path, class name)] in pre-order, the root as ""; `locations`: name -> "fragmented" | "whole" |
    "rank_local"; `rank_local`: name -> the sentence that says why it has no whole; `heads`: name -> {region:
    (start, stop, head_dim)} (or a callable of the name, asked once per location); `hidden_state_inputs`: a
    decoder layer's `.input` is its hidden states (the previous layer's output), as transformers and nnsight
    have it, where the rank file's first input is `positions` (a session's choice)."""

    def __init__(self, modules, locations, rank_local=None, dtype=None, heads=None, hidden_state_inputs=False):
        self.classes, self.children = {}, {}
        for path, cls in modules:
            self.classes[path] = cls
            if path:
                parent, _, leaf = path.rpartition(".")
                self.children.setdefault(parent, []).append(leaf)
        self.locations = dict(locations)
        self.rank_local = dict(rank_local or {})
        self.dtype = dtype
        self.hidden_state_inputs = hidden_state_inputs
        self._source = heads if callable(heads) else None
        self._heads = {} if heads is None or callable(heads) else dict(heads)

    def resolved(self):
        """This tree with the head layout of every location asked now: what travels to another process."""
        for name in self.locations:
            self.head_layout(name)
        return self

    def __getstate__(self):
        return dict(self.__dict__, _source=None)  # a lazy source stays with the process that has it

    def head_layout(self, location):
        """name -> (start, stop, head_dim) on the last dim of the whole at `location` (ir::head_layout); {}."""
        if location not in self._heads and self._source is not None:
            self._heads[location] = self._source(location)
        return self._heads.get(location, {})

    def numbered(self, path):
        """How many numbered submodules (a ModuleList's) `path` has."""
        return sum(1 for c in self.children.get(path, ()) if c.isdigit())

    def child(self, path, name):
        return f"{path}.{name}" if path else name

    def sides(self, path):
        """The location sides ("input", "output") that module `path` has."""
        return [s for s in ("input", "output") if self.child(path, s) in self.locations]

    def render(self, path="", indent=""):
        """The module tree as text: one line per module (its class), a ModuleList's equal members once."""
        lines = []
        children = self.children.get(path, [])
        i = 0
        while i < len(children):
            name = children[i]
            full = self.child(path, name)
            same = 1
            if name.isdigit():  # a run of members with the same tree: written once, as torch does
                while i + same < len(children) and children[i + same].isdigit() and \
                        self._shape(self.child(path, children[i + same])) == self._shape(full):
                    same += 1
            label = name if same == 1 else f"{name}-{children[i + same - 1]}: {same} x"
            lines.append(f"{indent}({label}) {self.classes.get(full, '?')}{self._where(full)}")
            lines += self.render(full, indent + "  ")
            i += same
        return lines

    def _where(self, path):
        sides = self.sides(path)
        return f"  [{', '.join('.' + s for s in sides)}]" if sides else ""

    def _shape(self, path):
        return (self.classes.get(path), tuple(self.sides(path)),
                tuple((c, self._shape(self.child(path, c))) for c in self.children.get(path, [])))
