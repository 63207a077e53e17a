"""Export one file per tensor-parallel rank: TorchScript (``rank{r}.pt``) or torch.export (``rank{r}.pt2``).

``build(tp_rank, tp_size)`` returns an nn.Module made of kit layers and ordinary modules.  The tp_size 1
build (with its random init, under ``seed``) is the whole model; each rank's module gets its slice of it:
kit layers through ``load_full_weights`` (vLLM's weight-loader layout), every other module gets its own
direct parameters and buffers copied whole (norms, routers, rotary caches...).

Each file also carries ``fragkit.json`` (an extra file beside the code): ``{"export_id", "tp_size",
"tp_rank", "model"}``.  The export id is a digest of the whole model's weights and tp_size, so every rank
file of one export has the same id and the runner can refuse rank files mixed from different exports.

``format="export"`` writes ``rank{r}.pt2`` with ``torch.export.export`` (batch and sequence dims dynamic)
and ``torch.export.save``.  An exported program keeps no module attributes, so ``fragkit.json`` (the
archive's ``extra/fragkit.json``) then also records every kit layer's config: ``"layers"`` is a list, in
``named_modules`` order, of ``{"path", "class", "config": {CONTRACT_ATTRIBUTES of the class},
"parameters": {name: shape}}`` (format ``"fragkit.layers/1"``), which the C++ pass classifies exactly as
it classifies a TorchScript module's attributes.

``kv_cache=True`` (with ``format="export"``) exports the cached forward instead:
``forward(input_ids, positions, kv_cache, cache_len)`` (batch, length, cache rows and slots dynamic;
cache_len the constant 0: the span attended is the cache view's length), the one program for plain forwards, prefill and decode steps; ``fragkit.json`` then records
``"kv_cache": {"layers", "kv_heads", "head_size", "max_positions"}`` (this rank's cache
[layers, 2, rows, kv_heads, slots, head_size]), which is how a runner knows the archive takes a cache.
A plain forward of such an archive runs the cached forward over a scratch cache of the sequence's length.
"""
import contextlib
import hashlib
import io
import json
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import ops
from .layers import CONTRACT_ATTRIBUTES, KIT_LAYERS

Builder = Callable[[int, int], nn.Module]


@torch.no_grad()
def load_rank_from_full(module: nn.Module, full: nn.Module) -> None:
    """Fill ``module`` (one rank) from ``full`` (the same model built at tp_size 1)."""
    full_modules: Dict[str, nn.Module] = dict(full.named_modules())
    rank_modules: Dict[str, nn.Module] = dict(module.named_modules())
    if set(full_modules) != set(rank_modules):
        only_full = sorted(set(full_modules) - set(rank_modules))[:5]
        only_rank = sorted(set(rank_modules) - set(full_modules))[:5]
        raise ValueError("module trees differ: only in full %s, only in rank %s" % (only_full, only_rank))
    for name, mod in rank_modules.items():
        src = full_modules[name]
        if type(src) is not type(mod):
            raise TypeError("%s: %s in the rank module, %s in the full one"
                            % (name or "<root>", type(mod).__name__, type(src).__name__))
        if isinstance(mod, KIT_LAYERS):
            mod.load_full_weights(src)
            continue
        src_tensors = dict(src.named_parameters(recurse=False))
        src_tensors.update(dict(src.named_buffers(recurse=False)))
        dst_tensors = dict(mod.named_parameters(recurse=False))
        dst_tensors.update(dict(mod.named_buffers(recurse=False)))
        if set(src_tensors) != set(dst_tensors):
            raise ValueError("%s: parameters/buffers differ: %s vs %s"
                             % (name or "<root>", sorted(dst_tensors), sorted(src_tensors)))
        for tname, dst in dst_tensors.items():
            s = src_tensors[tname]
            if s is None or dst is None:
                if (s is None) != (dst is None):
                    raise ValueError("%s.%s: None in one model only" % (name, tname))
                continue
            if s.shape != dst.shape:
                raise ValueError("%s.%s: a non-kit module must hold the whole tensor on every rank "
                                 "(%s here, %s in the full model)" % (name, tname, tuple(dst.shape), tuple(s.shape)))
            dst.copy_(s)


def stabilize_script_types(module: nn.Module) -> None:
    """Give every module class in the tree its own ``__annotations__`` dict before scripting.

    On Python >= 3.10 a class without annotations of its own first resolves ``__annotations__`` to a base
    class's dict (nn.Module's), and later to an empty dict of its own that scripting creates on it.  The two
    give different TorchScript module types, so the second rank file would get ``___torch_mangle_N`` class
    names.  Creating the class's own dict first makes every scripting infer the same type."""
    for sub in module.modules():
        cls = type(sub)
        if "__annotations__" not in cls.__dict__:
            try:
                cls.__annotations__  # noqa: B018  (creates the class's own empty dict on Python >= 3.10)
            except AttributeError:
                pass


def shard_model(build: Builder, tp_size: int, seed: int = 0) -> Tuple[nn.Module, List[nn.Module]]:
    """(full model, [rank modules]) in eval mode, not scripted."""
    torch.manual_seed(seed)
    full = build(0, 1).eval()
    ranks = []
    for r in range(tp_size):
        m = build(r, tp_size).eval()
        load_rank_from_full(m, full)
        ranks.append(m)
    return full, ranks


FORMATS = ("torchscript", "export")
LAYERS_FORMAT = "fragkit.layers/1"


def export(build: Builder, tp_size: int, out_dir: str, seed: int = 0, format: str = "torchscript",
           kv_cache: bool = False) -> List[str]:
    """Save ``out_dir/rank{r}.pt`` (TorchScript) or ``rank{r}.pt2`` (``format="export"``: torch.export) for
    r in range(tp_size); ``kv_cache``: a .pt2 with the cached forward (see the module's doc).  Returns the
    paths."""
    if tp_size < 1:
        raise ValueError("tp_size must be >= 1")
    _check_format(format)
    torch.manual_seed(seed)
    full = build(0, 1).eval()
    return export_ranks(full, build, tp_size, out_dir, format=format, kv_cache=kv_cache)


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError("format must be one of %s, got %r" % (", ".join(FORMATS), format))


def layer_configs(module: nn.Module) -> List[dict]:
    """Every kit layer's contract config (``CONTRACT_ATTRIBUTES``) and parameter shapes, in ``named_modules``
    order: what the C++ pass reads from a TorchScript module's attributes, for formats that keep none."""
    layers = []
    for path, sub in module.named_modules():
        # A subclass of a kit layer keeps its own class name (a rules file may alias it) and its base's contract.
        contract = next((CONTRACT_ATTRIBUTES[c.__name__] for c in type(sub).__mro__
                         if c.__module__ == KIT_LAYERS[0].__module__ and c.__name__ in CONTRACT_ATTRIBUTES), None)
        if contract is None:
            continue
        cls = type(sub).__name__
        config = {}
        for name, kind in contract.items():
            value = getattr(sub, name)
            config[name] = [int(v) for v in value] if kind is list else kind(value)
        params = {name: list(p.shape) for name, p in sub.named_parameters(recurse=False)}
        layers.append({"path": path, "class": cls, "config": config, "parameters": params})
    return layers


def example_input_ids() -> Tensor:
    """The traced input of a kit model: token ids [batch, seq]; both dims are exported dynamic."""
    return torch.zeros(2, 8, dtype=torch.long)


def kv_cache_record(module: nn.Module) -> dict:
    """What a runner needs to allocate this rank's cache for a cached .pt2 (fragkit.json's ``"kv_cache"``)."""
    layers, _, _, kv_heads, _, head_size = module.kv_cache_shape(1, 1)
    return {"layers": int(layers), "kv_heads": int(kv_heads), "head_size": int(head_size),
            "max_positions": int(module.max_positions())}


def example_cached_inputs(module: nn.Module) -> Tuple[Tensor, Tensor, Tensor, int]:
    """The traced inputs of the cached forward: 2 rows of 8 new tokens into a cache of 16 slots, attended over
    the whole cache (cache_len 0: the cache's slots, a constant of the program)."""
    ids = example_input_ids()
    positions = torch.arange(ids.size(1)).unsqueeze(0).expand(ids.size(0), -1).contiguous()
    return ids, positions, module.new_kv_cache(ids.size(0), 16), 0


def export_program(module: nn.Module, tp_size: int, kv_cache: bool = False,
                   fake_mode=None) -> "torch.export.ExportedProgram":
    """``torch.export`` of one rank's kit model (``forward(input_ids)``), batch and sequence dims dynamic;
    ``kv_cache``: ``forward(input_ids, positions, kv_cache, cache_len)``, every size dynamic and cache_len the
    constant 0: a step attends over the cache it is given, so a runner passes the cache narrowed to the slots
    it attends (a view: the new k/v land in the cache itself). A symbolic int cannot cross a preserved module
    call, so the span travels as the view's length.

    Every submodule's call signature is preserved: the graph is flat, and ``module_call_graph`` then names
    each module call's input and output values, which is where fragments' locations (``<path>.input`` /
    ``<path>.output``) are.  The graph's ops are the same as without it.

    The cached program records guards that a length is not 1 (reshapes of strided views); its ops hold for
    one token too (a decode step), so runners call it without the guards (``module(check_guards=False)``,
    NativeRT checks none); the tests compare decode steps with the eager module's.

    ``fake_mode``: the module's parameters are fake tensors of this FakeTensorMode (the streaming import's
    skeleton, fragkit.checkpoint.pt2): the trace runs inside it, the example inputs stay real, so the program
    and its sample inputs are those of the same module with real weights."""
    dim = torch.export.Dim.DYNAMIC
    calls = tuple(name for name, _ in module.named_modules() if name)
    if kv_cache:
        args = example_cached_inputs(module)
        shapes = ({0: dim, 1: dim}, {0: dim, 1: dim}, {2: dim, 4: dim}, None)
    else:
        args, shapes = (example_input_ids(),), ({0: dim, 1: dim},)
    with ops.tracing_group_size(tp_size), torch.no_grad(), (fake_mode or contextlib.nullcontext()):
        return torch.export.export(module, args, dynamic_shapes=shapes, preserve_module_call_signature=calls)


def export_ranks(full: nn.Module, build: Builder, tp_size: int, out_dir: str, info: Optional[dict] = None,
                 progress: Optional[Callable[[int], None]] = None, format: str = "torchscript",
                 kv_cache: bool = False) -> List[str]:
    """Slice ``full`` (the model built at tp_size 1, weights loaded) into ``build(r, tp_size)`` for each rank,
    script and save ``out_dir/rank{r}.pt`` (or export ``rank{r}.pt2``, ``format="export"``); ``info`` joins
    ``fragkit.json``; ``kv_cache``: a .pt2's cached forward.  Each file is written under a temporary name and
    renamed when all are written, so a failure leaves no rank file behind."""
    if tp_size < 1:
        raise ValueError("tp_size must be >= 1")
    _check_format(format)
    if kv_cache and format != "export":
        raise ValueError("kv_cache=True is for format=\"export\": a TorchScript file always has the cached forward")
    if kv_cache and not hasattr(full, "kv_cache_shape"):
        raise ValueError("kv_cache=True: %s has no kv_cache_shape (not a kit model with a KV cache)"
                         % type(full).__name__)
    os.makedirs(out_dir, exist_ok=True)
    export_id = _export_id(full, tp_size)
    written = []
    try:
        for r in range(tp_size):
            m = full if tp_size == 1 else build(r, tp_size).eval()
            if m is not full:
                load_rank_from_full(m, full)
            meta = dict(info or {}, export_id=export_id, tp_size=tp_size, tp_rank=r, model=type(full).__name__)
            if format == "export":
                path = os.path.join(out_dir, "rank%d.pt2" % r)
                meta.update(layers_format=LAYERS_FORMAT, layers=layer_configs(m))
                if kv_cache:
                    meta.update(kv_cache=kv_cache_record(m))
                program = export_program(m, tp_size, kv_cache=kv_cache)
                written.append(path)
                buffer = io.BytesIO()  # saved in memory: the archive's folder name comes from a file's name
                torch.export.save(program, buffer, extra_files={"fragkit.json": json.dumps(meta, sort_keys=True)})
                with open(path + ".tmp", "wb") as f:
                    f.write(buffer.getvalue())
                del program, buffer
            else:
                stabilize_script_types(m)
                scripted = torch.jit.script(m)
                path = os.path.join(out_dir, "rank%d.pt" % r)
                written.append(path)
                scripted.save(path + ".tmp", _extra_files={"fragkit.json": json.dumps(meta, sort_keys=True)})
                del scripted
            del m
            if progress is not None:
                progress(r)
        for path in written:
            os.replace(path + ".tmp", path)
    finally:
        for path in written:
            if os.path.exists(path + ".tmp"):
                os.remove(path + ".tmp")
    return written


def _export_id(full: nn.Module, tp_size: int) -> str:
    """Digest of the whole model's weights and the tp size: equal for every rank file of one export."""
    digest = hashlib.sha256(("tp_size=%d;" % tp_size).encode())
    for name, tensor in sorted(full.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def export_full(build: Builder, out_dir: str, seed: int = 0) -> List[str]:
    return export(build, 1, out_dir, seed)
