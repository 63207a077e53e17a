"""A torch.export rank file (.pt2) run by PyTorch under fragments' C++ plan engine.

The C++ side prepares the archive (program/pt2_program.h: checks across ranks, rewrites a plain export
in memory, indexes the fragment table) and owns the plan: checks, saves, edits, cross-rank agreement, width
probes and call wrappers (program::ShardedModel). This module is the program it runs
(program::RankProgram, bound in _C.cpp as Pt2TorchExportProgram):

  rewritten archive ──torch.export.load──▶ ExportedProgram ──.module()──▶ fx.GraphModule
    its frag.gather/intervene/split (location names, the file's form) rebound to the table's ids
    (the ``.at`` overloads the kernels resolve by index) ─▶ the forward
    a forward keeping only some locations' ops: a copy of that graph without the others' (cached, LRU)
  the same program, fragment ops dropped (the export's own graph again), unflattened
    (torch.export.unflatten) ─▶ the module tree that ad-hoc calls (a logit lens) run: each module's own
    code, as TorchScript's submodule methods are

Every graph here runs eagerly node by node, as the original exported program's module() does.
"""
import collections
import contextlib
import copy
import io
import warnings

import torch
import torch.export.passes

_FRAGMENT_OPS = {"gather", "intervene", "split"}
_CACHE = 8  # specialized forwards kept, as program/forward_cache.h


def _fragment_op(node):
    """"gather", "intervene" or "split" for a fragment op in the file's form, else None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    name = node.target.name()  # "frag::gather", overload "default"
    if not name.startswith("frag::") or node.target._overloadname != "default":
        return None
    op = name[len("frag::"):]
    return op if op in _FRAGMENT_OPS else None


def _location_of(node):
    return node.args[2] if _fragment_op(node) == "split" else node.args[1]


def _passthrough(node):
    """What the model gets where the op is dropped: the piece (split) or the value (gather, intervene)."""
    return node.args[1] if _fragment_op(node) == "split" else node.args[0]


def _drop_fragment_ops(graph, keep=lambda location: False):
    """Removes the fragment ops at locations `keep` refuses, users last first (split, intervene, gather)."""
    for node in reversed(list(graph.nodes)):
        if _fragment_op(node) and not keep(_location_of(node)):
            node.replace_all_uses_with(_passthrough(node))
            graph.erase_node(node)


def _bind(graph, ids, source):
    """The file's form (location names) rebound to location ids: gather.at, intervene.at, split.at."""
    ops = torch.ops.frag
    for node in graph.nodes:
        op = _fragment_op(node)
        if op is None:
            continue
        location = _location_of(node)
        if location not in ids:
            raise RuntimeError(f"{source}: the fragment op {node.name} names {location}, which the archive's "
                               "fragment table does not list")
        if op == "gather":
            node.target, node.args = ops.gather.at, (node.args[0], ids[location])
        elif op == "intervene":
            node.target, node.args = ops.intervene.at, (node.args[0], ids[location], node.args[2])
        else:
            node.target, node.args = ops.split.at, (node.args[0], node.args[1], ids[location])


class Pt2Runner:
    """One rank's .pt2 program: forward, and the module tree for call wrappers."""

    def __init__(self, path, rewritten, locations, device):
        """`rewritten`: the archive's bytes where C++ rewrote a plain export, else b"" (the file is one
        frag rewrite wrote); `locations`: the fragment table's location names in id order."""
        self.path = path
        with warnings.catch_warnings():  # weights are read from the archive's read-only buffer
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self._program = torch.export.load(io.BytesIO(rewritten) if rewritten else path)
        self._device = torch.device(device)
        if self._device.type != "cpu":  # the graph names the device it was exported on (arange, to): rewrite it
            self._program = torch.export.passes.move_to_device_pass(self._program, self._device)
        self._ids = {name: i for i, name in enumerate(locations)}
        self._names = list(locations)
        # The file's form: specializations start here. Without the export's guards: a cached archive's
        # guard that a length is not 1 is one its ops do not need (fragkit/export.py), and a decode step
        # is one token; the input shapes' ranges are still checked.
        self._file_module = self._program.module(check_guards=False)
        self._full = self._specialized(None)
        self._forwards = collections.OrderedDict()  # tuple(kept ids) -> GraphModule, least recent first
        self._tree = None

    def _specialized(self, kept):
        """A GraphModule over the file's module (its parameters shared) keeping the ops at `kept` (all if None),
        bound to ids."""
        graph = copy.deepcopy(self._file_module.graph)  # with its codegen: module()'s pytree in/out handling
        if kept is not None:
            names = {self._names[i] for i in kept}
            _drop_fragment_ops(graph, lambda location: location in names)
        _bind(graph, self._ids, self.path)
        module = torch.fx.GraphModule(self._file_module, graph)
        for name in ("_in_spec", "_out_spec"):
            if hasattr(self._file_module, name):
                setattr(module, name, getattr(self._file_module, name))
        return module

    @property
    def device(self):
        return str(self._device)

    def forward(self, ids, kept, once, positions=None, kv_cache=None):
        """The logits of `ids` under the current rank context and intervention runtime (C++ sets both on
        this thread); `kept`: ascending location ids whose ops must act (None: every location's). A cached
        archive takes `positions` and `kv_cache` (written in place; its slots are the span attended)."""
        if kept is None:
            module = self._full
        else:
            key = tuple(kept)
            module = self._forwards.get(key)
            if module is None:
                module = self._specialized(key)
                if not once:
                    self._forwards[key] = module
                    if len(self._forwards) > _CACHE:
                        self._forwards.popitem(last=False)
            elif not once:
                self._forwards.move_to_end(key)
        with torch.no_grad():
            if kv_cache is None:
                out = module(ids.to(self._device))
            else:
                out = module(ids.to(self._device), positions.to(self._device), kv_cache, 0)
        if isinstance(out, (tuple, list)):
            out = out[0]
        return out

    def _modules(self):
        """The unflattened module tree of the program without fragment ops (built on first use: unflattening
        costs). The ops go before unflattening, not after: the graph is then the export's own, whose module
        boundaries unflatten knows (a partial sum's ops inside one module and its reduction in another are
        not)."""
        if self._tree is None:
            program = self._program  # module() made the forward's own copy of the graph at load
            graph = program.graph_module.graph
            renamed = {}
            for node in reversed(list(graph.nodes)):
                if _fragment_op(node):
                    source = _passthrough(node)
                    renamed[node.name] = source.name
                    node.replace_all_uses_with(source)
                    graph.erase_node(node)
            program.graph_module.recompile()
            for spec in program.graph_signature.output_specs:  # the rewrite named the ops' outputs there
                name = getattr(spec.arg, "name", None)
                while name in renamed:
                    name = renamed[name]
                if name is not None and name != spec.arg.name:
                    spec.arg = type(spec.arg)(name=name)
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                # PyTorch 2.11's unflatten prints a debug line per value crossing modules ("Checking
                # mutability"), and warns of get_attr nodes for a cached program's mutated input (the cache)
                warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
                tree = torch.export.unflatten(program)
            self._tree = tree
        return self._tree

    def arity(self, path):
        """None if `path` names no module; else the number of tensors its forward takes (-1: not known)."""
        try:
            module = self._modules().get_submodule(path)
        except AttributeError:
            return None
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            return -1
        return sum(1 for node in graph.nodes if node.op == "placeholder")

    def run(self, path, inputs):
        """`path`'s own forward on `inputs` (no fragment ops); its first output."""
        with torch.no_grad():
            out = self._modules().get_submodule(path)(*inputs)
        if isinstance(out, (tuple, list)):
            out = out[0]
        return out
