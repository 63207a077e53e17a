"""``--format export`` without the weights in memory: a rank's .pt2 skeleton, traced and saved from fake weights.

torch.export traces a module with fake tensors whatever its parameters hold, so the rank's kit model is built
with meta parameters (``layers.build_on_meta``), each parameter is replaced by a fake CPU tensor of a
``FakeTensorMode`` (shape and dtype only), and ``torch.export.export`` runs inside that mode with the real
example inputs (fragkit.export.export_program's ``fake_mode``): the program is the one the materializing
import exports from real weights, and so are its sample inputs. ``torch.export.save`` then writes the archive
with every fake weight as an empty record (``_get_raw_tensor_bytes`` writes b"" for a fake tensor); buffers
(rotary tables) are real and written whole. stream.write_ranks copies this skeleton record by record and
fills each empty weight record with the rank's slice from the checkpoint, tensor by tensor.

The one private seam: torch 2.11's archive writer (``torch.export.pt2_archive._package``) groups weights that
share a storage into one record by ``group_weights``, keyed by the storage's pointer -- which a fake tensor
does not have, so every fake weight of one dtype would land in one record. While the skeleton is saved,
``_package.group_weights`` is replaced by one that groups a fake tensor by its identity (a tied head and its
embedding are one tensor: one record, as the materializing import writes them) and a real one by its storage
pointer, as torch does. Everything the writer then does is torch's own. The skeleton is checked before use
(``weight_records``): each parameter named in ``data/weights/model_weights_config.json`` (the archive's
public layout), each distinct parameter in its own empty record, of the parameter's shape, contiguous. If a
later torch renames the function, stops writing fake tensors as empty records or changes the layout, the
import stops with a message saying so (``--format torchscript`` is unaffected).
"""
import contextlib
import json
import os
from typing import Dict, List, Tuple

import torch
from torch import nn

from .. import layers
from ..export import LAYERS_FORMAT, export_program, layer_configs
from .files import FileSink, write_failure
from .sources import CheckpointError

WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
WEIGHTS_DIR = "data/weights/"


def changed(what: str) -> CheckpointError:
    return CheckpointError("the streaming --format export relies on torch 2.11's pt2 archive writer, and torch %s "
                           "differs: %s (fragkit/checkpoint/pt2.py; --format torchscript is not affected)"
                           % (torch.__version__, what))


@contextlib.contextmanager
def fake_weights_grouped_by_identity():
    """While torch.export.save runs: each fake tensor is its own storage group (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensor

    try:
        from torch.export.pt2_archive import _package
    except ImportError:
        raise changed("no torch.export.pt2_archive._package") from None
    original = getattr(_package, "group_weights", None)
    if original is None:
        raise changed("torch.export.pt2_archive._package.group_weights is gone")

    def group_weights(all_weights):
        groups: Dict[tuple, List[Tuple[str, str]]] = {}
        for model_name, weights in all_weights.items():
            for weight_name, (tensor, _) in weights.items():
                key = ("fake", id(tensor)) if isinstance(tensor, FakeTensor) else \
                    ("storage", tensor.untyped_storage().data_ptr())
                groups.setdefault((key, tensor.dtype), []).append((model_name, weight_name))
        return list(groups.values())

    _package.group_weights = group_weights
    try:
        yield
    finally:
        _package.group_weights = original


def fake_rank_module(build, rank: int, tp: int):
    """(rank ``rank``'s kit model with fake CPU parameters and real buffers, its FakeTensorMode). A tied
    parameter stays one (fake) parameter."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with layers.build_on_meta():
        module = build(rank, tp).eval()
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes: Dict[int, nn.Parameter] = {}
    for path, meta in list(module.named_parameters(remove_duplicate=False)):
        owner_path, _, name = path.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        if id(meta) not in fakes:
            with mode:
                fakes[id(meta)] = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype), requires_grad=False)
        setattr(owner, name, fakes[id(meta)])
    return module, mode


def save_skeleton(build, rank: int, tp: int, skeleton_path: str) -> Tuple[nn.Module, dict]:
    """Export rank ``rank`` from fake weights and save the archive to ``skeleton_path``, extra/fragkit.json a
    placeholder (the writer puts the rank's record in its place). Returns the rank module (fake parameters,
    buffers moved to meta: the skeleton holds them) and the fields of fragkit.json that .pt2 files add (the
    layers' configs, as fragkit.export.export_ranks records them)."""
    module, mode = fake_rank_module(build, rank, tp)
    program = export_program(module, tp, fake_mode=mode)
    extra = {"layers_format": LAYERS_FORMAT, "layers": layer_configs(module)}

    # A file object, not a name: the archive's folder is then "archive", as for the materializing import's
    # in-memory save (a name would give it the file's name).
    sink = FileSink(skeleton_path)
    try:
        with fake_weights_grouped_by_identity():
            torch.export.save(program, sink, extra_files={"fragkit.json": "{}"})
    finally:
        sink.close()
    if sink.error is not None:  # a full disk
        raise CheckpointError(write_failure(skeleton_path + ".tmp", "the rank skeleton", sink.error,
                                            os.path.dirname(skeleton_path)))
    del program
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = buf.to("meta")
    return module, extra


def weight_records(reader, module: nn.Module) -> Dict[str, Tuple[str, nn.Parameter]]:
    """record -> (the first parameter path it holds, the parameter), checked against the skeleton's weights
    config: every parameter in an empty record of its own shape, one record per distinct parameter."""
    records = set(reader.get_all_records())
    if WEIGHTS_CONFIG not in records:
        raise changed("the archive has no %s" % WEIGHTS_CONFIG)
    try:
        config = json.loads(bytes(reader.get_record(WEIGHTS_CONFIG)))["config"]
    except (ValueError, KeyError, TypeError) as e:
        raise changed("%s is not {\"config\": ...}: %s" % (WEIGHTS_CONFIG, e)) from None
    params = dict(module.named_parameters(remove_duplicate=False))
    out: Dict[str, Tuple[str, nn.Parameter]] = {}
    for path, p in params.items():
        entry = config.get(path)
        if not isinstance(entry, dict) or "path_name" not in entry:
            raise changed("%s has no entry for the parameter %s" % (WEIGHTS_CONFIG, path))
        if entry.get("use_pickle"):
            raise changed("%s: the parameter %s is pickled, not raw bytes" % (WEIGHTS_CONFIG, path))
        record = WEIGHTS_DIR + entry["path_name"]
        meta = entry.get("tensor_meta") or {}
        sizes = [s.get("as_int") for s in meta.get("sizes", [])]
        strides = [s.get("as_int") for s in meta.get("strides", [])]
        contiguous = list(torch.empty(p.shape, device="meta").stride())
        if sizes != list(p.shape) or strides != contiguous or (meta.get("storage_offset") or {}).get("as_int") != 0:
            raise changed("%s: the parameter %s is recorded as sizes %s strides %s, expected %s contiguous"
                           % (WEIGHTS_CONFIG, path, sizes, strides, list(p.shape)))
        if record not in records or len(bytes(reader.get_record(record))) != 0:
            raise changed("the fake parameter %s's record %s is not an empty record" % (path, record))
        if record in out and out[record][1] is not p:
            raise changed("the parameters %s and %s share the record %s" % (out[record][0], path, record))
        out.setdefault(record, (path, p))
    return out
