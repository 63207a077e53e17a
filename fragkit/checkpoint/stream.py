"""Streaming import: rank files written a tensor at a time from views of the checkpoint, never the whole model.

For each rank the kit model is built with meta parameters (``layers.build_on_meta``: shapes, no memory),
scripted, and saved in memory: TorchScript writes a meta tensor's storage as an empty record, so this
skeleton is the rank file without its weights (code, constants, the pickled module, real buffers such as
rotary tables). The rank file is then written record by record with PyTorch's own zip writer
(``torch._C.PyTorchFileWriter``, which computes each record's CRC): the skeleton's records as they are,
except that each empty weight record gets its tensor, sliced from the checkpoint by the layer's
``rank_slice`` (layers.py, the same layout code as ``load_full_weights``), and ``data.pkl`` says ``cpu``
where the skeleton said ``meta`` (pickletools finds the storage locations).

Every rank's file is open at once and the tensors are written in the models' order, one kit tensor at a
time for every rank: each kit tensor is read whole once (``TensorReader``: pread into a reused buffer, the
next tensor read in a thread while this one is written), every rank's slice is cut from it and written (a
row slice straight from the buffer, a column slice copied once into another reused buffer). The checkpoint
is read once, and the memory held is the skeletons plus the reader's buffers. A tensor that several
attributes hold (a tied LM head) is one record, written once. Files are written as ``rank{r}.pt.tmp`` and
renamed when all are complete, and removed on any error.

``--format export``: the same writer fills a .pt2 skeleton (pt2.py: the program traced from fake weights,
its weight records empty), record by record in torch.export.save's order; the file is written through
``FileSink`` (PyTorchFileWriter's buffer constructor), so the archive's folder is "archive" as torch names
it for a buffer, and a failed write is checked after each record.

Records carry no CRC-32 unless ``crc32=True``: PyTorch's zip writer computes it at ~400 MB/s, slower than
the disk, and PyTorch's readers (torch.load, torch.jit.load, LibTorch) never check it (as with
``torch.serialization.set_crc32_options(False)``); zip tools then report CRC errors.

The export id (``fragkit.json``) digests the checkpoint's identity (each file's path, size and
modification time), the config, tp, dtype and format: equal for every rank of one export, different for
another checkpoint or another import of it, without a pass over the weights.
"""
import contextlib
import hashlib
import io
import json
import os
import pickle
import pickletools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import layers
from ..export import stabilize_script_types
from ..layers import KIT_LAYERS
from . import pt2
from .families import family_for
from .files import DTYPES, FileSink, free_bytes, write_failure
from .sources import CheckpointError, open_checkpoint
from .views import Arena, TensorView, View, read_into

# Records PyTorchFileWriter writes itself at the end of a file.
_WRITER_RECORDS = ("version", "byteorder", ".data/serialization_id")
_EXTRA = "extra/fragkit.json"
# The same for a .pt2 archive (torch.export.save's writer; pt2.py).
_PT2_OWN_RECORDS = (".data/version", "byteorder", ".data/serialization_id", "version")
# Per record: local header, central directory entry (zip64 extras included) and the 64-byte alignment.
_RECORD_OVERHEAD = 256


# ----------------------------------------------------------------------------------------------------------
# the skeleton: which storage record holds which parameter

class _Obj:
    """A TorchScript object (module) as unpickled: its attributes."""

    def __init__(self, *args):
        self.state = {}

    def __setstate__(self, state):
        self.state = state if isinstance(state, dict) else {"__state__": state}


@dataclass
class _TensorRef:
    key: str
    location: str
    numel: int
    offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]


class _SkeletonUnpickler(pickle.Unpickler):
    """Reads a TorchScript data.pkl into plain objects: module attributes and tensor references."""

    def find_class(self, module, name):
        if module.startswith("__torch__"):
            return type(name, (_Obj,), {})
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: _TensorRef(storage[0], storage[1], storage[2],
                                                                          offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        if module == "torch.jit._pickle":
            return lambda *args: args[0] if args else None
        raise CheckpointError("internal: unexpected global %s.%s in a rank module's data.pkl" % (module, name))

    def persistent_load(self, pid):
        kind, _, key, location, numel = pid
        return (key, location, numel)


def _tensor_paths(data_pkl: bytes) -> Dict[str, Tuple[str, _TensorRef]]:
    """storage key -> (attribute path, e.g. "model.layers.0.mlp.down_proj.weight", its reference): the first
    path of a tensor that several attributes hold (a tied LM head, the layers' one rotary table)."""
    return {key: (paths[0], ref) for key, (paths, ref) in _tensor_uses(data_pkl).items()}


def _tensor_uses(data_pkl: bytes) -> Dict[str, Tuple[List[str], _TensorRef]]:
    """storage key -> (every attribute path that holds it, its reference). TorchScript pickles a tensor held
    by several attributes once and refers back to it (so it loads as one tensor); any other sharing of a
    storage (two views of it) is refused: the writer fills a record from one parameter."""
    root = _SkeletonUnpickler(io.BytesIO(data_pkl)).load()
    out: Dict[str, Tuple[List[str], _TensorRef]] = {}

    def walk(obj, prefix):
        if isinstance(obj, _Obj):
            for name, value in obj.state.items():
                walk(value, prefix + name if not prefix else prefix + "." + name)
        elif isinstance(obj, _TensorRef):
            if obj.key in out and out[obj.key][1] is not obj:
                raise CheckpointError("internal: storage %s is shared by %s and %s" % (obj.key, out[obj.key][0][0],
                                                                                       prefix))
            out.setdefault(obj.key, ([], obj))[0].append(prefix)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, "%s.%d" % (prefix, i))

    walk(root, "")
    return out


def _meta_to_cpu(data_pkl: bytes, meta_keys: List[str]) -> bytes:
    """data.pkl with the storages' location 'meta' made 'cpu'. TorchScript memoizes strings, so the location
    is one BINUNICODE op that later storages reference; any other use of the string 'meta' is refused."""
    ops = list(pickletools.genops(data_pkl))
    found = [(op, arg, pos) for op, arg, pos in ops if op.name in ("BINUNICODE", "SHORT_BINUNICODE") and arg == "meta"]
    if len(found) != 1:
        raise CheckpointError("internal: expected the string 'meta' once in data.pkl, found it %d times" % len(found))
    op, _, pos = found[0]
    end = next(p for o, a, p in ops if p > pos)
    new = (b"X" + struct_u32(3) + b"cpu") if op.name == "BINUNICODE" else (b"\x8c\x03cpu")
    out = data_pkl[:pos] + new + data_pkl[end:]
    check = _tensor_paths(out)
    if any(check[k][1].location != "cpu" for k in meta_keys):
        raise CheckpointError("internal: data.pkl still places a weight on meta")
    return out


def struct_u32(n: int) -> bytes:
    return n.to_bytes(4, "little")


@dataclass
class RankPlan:
    """One rank's file: its skeleton and, per storage record, the parameter the checkpoint fills."""
    rank: int
    module: nn.Module
    records: List[str]
    skeleton: object  # torch._C.PyTorchFileReader
    version: int
    weights: Dict[str, Tuple[str, nn.Parameter]] = field(default_factory=dict)  # record -> (path, meta param)
    data_pkl: bytes = b""
    format: str = "torchscript"  # or "export" (a .pt2 archive: pt2.py)
    extra: dict = field(default_factory=dict)  # .pt2: fields of extra/fragkit.json known from the module

    @property
    def suffix(self) -> str:
        return ".pt2" if self.format == "export" else ".pt"

    @property
    def own_records(self) -> Tuple[str, ...]:
        return _PT2_OWN_RECORDS if self.format == "export" else _WRITER_RECORDS

    def bytes_to_write(self) -> int:
        total = 0
        for name in self.records:
            if name in self.weights:
                p = self.weights[name][1]
                total += p.numel() * p.element_size()
            elif name == _EXTRA and self.format == "export":  # written with the export id and the info
                total += len(json.dumps(self.extra)) + 4096
            elif name not in self.own_records:
                total += len(bytes(self.skeleton.get_record(name))) if name != "data.pkl" else len(self.data_pkl)
            total += _RECORD_OVERHEAD
        return total + 4096


def plan_rank(build: Callable[[int, int], nn.Module], rank: int, tp: int, skeleton_path: str,
              format: str = "torchscript") -> RankPlan:
    """Build rank ``rank`` on meta and save its skeleton to ``skeleton_path`` (a file, so that real buffers
    such as rotary tables are not held in memory for every rank; the caller removes it). ``format="export"``:
    a .pt2 skeleton traced from fake weights (pt2.py)."""
    if format == "export":
        return _plan_pt2(build, rank, tp, skeleton_path)
    with layers.build_on_meta():
        module = build(rank, tp).eval()
    stabilize_script_types(module)
    try:
        torch.jit.save(torch.jit.script(module), skeleton_path, _extra_files={"fragkit.json": "{}"})
    except RuntimeError as e:  # a full disk
        raise CheckpointError(write_failure(skeleton_path + ".tmp", "the rank skeleton", e,
                                             os.path.dirname(skeleton_path))) from None
    for sub in module.modules():  # the skeleton holds the buffers now
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = buf.to("meta")
    reader = torch._C.PyTorchFileReader(skeleton_path)
    records = list(reader.get_all_records())
    data_pkl = bytes(reader.get_record("data.pkl"))
    refs = _tensor_uses(data_pkl)
    params = dict(module.named_parameters(remove_duplicate=False))
    plan = RankPlan(rank, module, records, reader, int(bytes(reader.get_record("version")).strip()))
    meta_keys, covered = [], set()
    for key, (paths, ref) in refs.items():
        if ref.location != "meta":
            continue
        path = paths[0]  # a tied parameter: one record, filled from the first attribute's checkpoint view
        p = params.get(path)
        if p is None or ref.offset != 0 or ref.numel != p.numel() or ref.size != tuple(p.shape) or \
                any(params.get(other) is not p for other in paths):
            raise CheckpointError("internal: meta storage %s (%s) is not a whole parameter" % (key, paths))
        plan.weights["data/" + key] = (path, p)
        meta_keys.append(key)
        covered.update(paths)
    missing = sorted(set(params) - covered)
    if missing:
        raise CheckpointError("internal: parameters without a storage record: %s" % missing[:3])
    plan.data_pkl = _meta_to_cpu(data_pkl, meta_keys) if meta_keys else data_pkl
    return plan


def _plan_pt2(build, rank: int, tp: int, skeleton_path: str) -> RankPlan:
    module, extra = pt2.save_skeleton(build, rank, tp, skeleton_path)
    reader = torch._C.PyTorchFileReader(skeleton_path)
    records = list(reader.get_all_records())
    if ".data/version" not in records:
        raise pt2.changed("the archive has no .data/version record")
    plan = RankPlan(rank, module, records, reader, int(bytes(reader.get_record(".data/version")).strip()),
                    format="export", extra=extra)
    plan.weights = pt2.weight_records(reader, module)
    return plan


def rank_bytes(build: Callable[[int, int], nn.Module], rank: int, tp: int) -> int:
    """The bytes of rank ``rank``'s file (parameters and buffers, plus zip overhead), from a meta build."""
    with layers.build_on_meta(), torch.device("meta"):
        module = build(rank, tp)
    return module_bytes(module)


def module_bytes(module: nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() + _RECORD_OVERHEAD for t in tensors) + (1 << 20)


def rank_tensor(module: nn.Module, path: str, view: View, dtype: torch.dtype,
                arena: Optional[Arena] = None, joined: Optional[Arena] = None) -> torch.Tensor:
    """Rank ``module``'s parameter ``path`` from ``view`` (the whole tp=1 tensor): kit layers by their
    ``rank_slice``, any other module's parameters whole. A slice that must be copied (another dtype, or not
    contiguous: a row-parallel weight's columns) goes to ``arena`` when given (valid until its next use);
    row blocks the layer joins (q_r|k_r|v_r) go to ``joined`` when given (layers.rows_joined_into)."""
    owner_path, _, name = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if isinstance(owner, KIT_LAYERS):
        with layers.rows_joined_into(joined.tensor) if joined is not None else contextlib.nullcontext():
            t = owner.rank_slice(name, view)
    else:
        t = layers._whole(view)
    if arena is None or (t.dtype == dtype and t.is_contiguous()):
        return t.to(dtype).contiguous()
    out = arena.tensor(t.shape, dtype)
    out.copy_(t)
    return out


def _record_storage(t: torch.Tensor):
    """The bytes of contiguous ``t`` as a storage: a slice of its storage (shared memory, no copy), so a
    slice of a memory-mapped tensor is written straight from the map."""
    storage = t.untyped_storage()
    begin = t.storage_offset() * t.element_size()
    end = begin + t.numel() * t.element_size()
    return storage if (begin, end) == (0, storage.nbytes()) else storage[begin:end]


# ----------------------------------------------------------------------------------------------------------
# reading

AHEAD_BYTES = 512 << 20


class TensorReader:
    """The kit tensors in the writer's order, each read whole once (views.read_into: pread into a reused
    buffer) and the next one read in a thread while this one is sliced and written, so the disk reads while
    it writes. Tensors up to ``AHEAD_BYTES`` (a layer's) alternate between two buffers; a larger one (the
    embedding, the head) is read when asked, into a third: memory stays at the largest tensor plus twice
    the largest layer tensor. ``next()``'s tensor is valid until the next call."""

    def __init__(self, views: List[View], ahead_bytes: int = AHEAD_BYTES):
        import concurrent.futures

        self.views, self.ahead_bytes, self.index = views, ahead_bytes, 0
        self.large, self.small = Arena(), [Arena(), Arena()]
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fragkit-read")
        self.pending = None

    def _read(self, i: int) -> TensorView:
        view = self.views[i]
        arena = self.small[i % 2] if view.nbytes <= self.ahead_bytes else self.large
        out = arena.tensor(view.shape, view.dtype)
        try:
            read_into(view, out)
        except OSError as e:
            raise CheckpointError(str(e)) from None
        return TensorView(out, view.where)

    def next(self) -> TensorView:
        i, self.index = self.index, self.index + 1
        got = self.pending.result() if self.pending is not None else self._read(i)
        self.pending = None
        if i + 1 < len(self.views) and self.views[i + 1].nbytes <= self.ahead_bytes:
            self.pending = self.pool.submit(self._read, i + 1)
        return got

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.pool.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------------------------------------
# writing

def check_free_space(out_dir: str, needed: int, what: str) -> None:
    where, free = free_bytes(out_dir)
    if free < needed:
        raise CheckpointError("%s: %s needs %.2f GB, the device of %s has %.2f GB free"
                              % (out_dir, what, needed / 1e9, where, free / 1e9))


def export_id_of(files, settings: dict) -> str:
    """Digest of the checkpoint files' identity and the import's settings (see the module docstring)."""
    text = json.dumps({"files": [list(f) for f in files], "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_ranks(plans: List[RankPlan], views: Dict[str, View], dtype: torch.dtype, out_dir: str, info: dict,
                export_id: str, progress: Optional[Callable] = None, check_space: bool = True,
                crc32: bool = False, tp: Optional[int] = None, rename: bool = True) -> List[str]:
    """Write ``out_dir/rank{r}.pt`` for each plan (see the module docstring). Returns the paths (``rename``
    False: the complete ``.tmp`` files, which the caller renames; removed here only on an error)."""
    tp = tp or len(plans)
    needed = sum(p.bytes_to_write() for p in plans)
    if check_space:
        check_free_space(out_dir, needed, "writing %d rank file(s)" % tp)
    pt2 = plans[0].format == "export"
    own = plans[0].own_records
    finals = [os.path.join(out_dir, "rank%d%s" % (p.rank, p.suffix)) for p in plans]
    temps = [f + ".tmp" for f in finals]
    writers, sinks = [], []
    finished = set()
    stack = contextlib.ExitStack()
    try:
        for tmp in temps:
            if pt2:  # a file object: the archive's folder is "archive", as torch.export.save to a buffer names it
                sinks.append(FileSink(tmp))
                writers.append(torch._C.PyTorchFileWriter(sinks[-1], crc32))
            else:
                sinks.append(None)
                writers.append(torch._C.PyTorchFileWriter(tmp, crc32))
        order = plans[0].records
        for plan in plans[1:]:
            if [plan.weights.get(n, (None,))[0] for n in plan.records] != [plans[0].weights.get(n, (None,))[0]
                                                                               for n in order]:
                raise CheckpointError("internal: rank modules differ in structure")
        # TorchScript: fragkit.json last (torch.jit.save's place for it); .pt2: where torch.export.save put it.
        steps = [n for n in order if n not in own and (pt2 or n != _EXTRA)]
        weight_steps = [n for n in steps if n in plans[0].weights]
        ahead = {a: b for a, b in zip(weight_steps, weight_steps[1:])}
        if weight_steps:
            views[plans[0].weights[weight_steps[0]][0]].prefetch()
        reader = stack.enter_context(TensorReader([views[plans[0].weights[n][0]] for n in weight_steps]))
        slices, joined = Arena(), Arena()
        for name in (progress(steps) if progress else steps):
            if name in ahead:  # the kernel reads the next tensor ahead while this one is written
                views[plans[0].weights[ahead[name]][0]].prefetch()
            whole = None
            if name in plans[0].weights:  # read once, sliced for every rank
                whole = reader.next()
            for plan, writer, sink, tmp in zip(plans, writers, sinks, temps):
                if name in plan.weights:
                    path, param = plan.weights[name]
                    tensor = rank_tensor(plan.module, path, whole, dtype, slices, joined)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise CheckpointError("internal: %s at rank %d: %s, expected %s"
                                              % (path, plan.rank, tuple(tensor.shape), tuple(param.shape)))
                    nbytes = tensor.numel() * tensor.element_size()
                    _write(writer, tmp, name, path, _record_storage(tensor), nbytes, out_dir, sink)
                    del tensor
                else:
                    if name == _EXTRA:
                        data = _extra_record(plan, info, export_id, tp)
                    else:
                        data = plan.data_pkl if name == "data.pkl" and not pt2 else bytes(plan.skeleton.get_record(name))
                    _write(writer, tmp, name, name, data, len(data), out_dir, sink)
        for plan, writer, sink, tmp in zip(plans, writers, sinks, temps):
            if not pt2:
                text = _extra_record(plan, info, export_id, tp)
                _write(writer, tmp, _EXTRA, _EXTRA, text, len(text), out_dir)
            writer.set_min_version(plan.version)
            try:
                writer.write_end_of_file()
            except RuntimeError as e:
                raise CheckpointError(write_failure(tmp, "the end of the file", e, out_dir)) from None
            finally:
                finished.add(id(writer))
            if sink is not None:
                _check_sink(sink, tmp, "the end of the file", out_dir)
        writers.clear()  # closes the files
        for sink in sinks:
            if sink is not None:
                sink.close()
        if not rename:
            done = list(temps)
            temps.clear()
            return done
        for tmp, final in zip(temps, finals):
            os.replace(tmp, final)
        return finals
    finally:
        stack.close()  # the reading thread stops before the files go
        for writer in writers:
            # A writer destroyed unfinished finishes itself in its destructor, and a failure there (a full
            # disk) aborts the process: finish it here, where a failure can be ignored.
            if id(writer) not in finished:
                try:
                    writer.write_end_of_file()
                except RuntimeError:
                    pass
        writers.clear()
        for sink in sinks:
            if sink is not None:
                sink.close()
        for tmp in temps:
            if os.path.exists(tmp):
                os.remove(tmp)


def _extra_record(plan: RankPlan, info: dict, export_id: str, tp: int) -> bytes:
    meta = dict(info, export_id=export_id, tp_size=tp, tp_rank=plan.rank, model=type(plan.module).__name__,
                **plan.extra)
    return json.dumps(meta, sort_keys=True).encode()


def _check_sink(sink: Optional[FileSink], tmp: str, what: str, out_dir: str) -> None:
    if sink is not None and sink.error is not None:
        raise CheckpointError(write_failure(tmp, what, sink.error, out_dir))


def _write(writer, tmp: str, record: str, what: str, data, nbytes: int, out_dir: str,
           sink: Optional[FileSink] = None) -> None:
    try:
        writer.write_record(record, data, nbytes)
    except RuntimeError as e:  # PyTorchFileWriter: "... file write failed" (a full disk, an I/O error)
        raise CheckpointError(write_failure(tmp, what, e, out_dir)) from None
    _check_sink(sink, tmp, what, out_dir)


def fixed_mmap_threshold() -> None:
    """Make glibc give every allocation of 1 MB or more its own mapping, returned to the system when freed.
    By default the threshold rises with each freed mapping up to 32 MB, after which rank slices a little under
    it (a tp 4 slice of an 8B model's MLP weight is 29 MB) come from the heap and stay resident once freed:
    the process's memory would grow with the model instead of staying at one tensor."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc


def write_rank_group(path: str, tp: int, ranks: List[int], out_dir: str, dtype: str, enable_expert_parallel: bool,
                     ignore_config_fields, info: dict, export_id: str, crc32: bool,
                     format: str = "torchscript") -> List[str]:
    """One ``--jobs`` process: opens the checkpoint itself and writes the ranks ``ranks`` as complete
    ``rank{r}.pt.tmp`` (``.pt2.tmp``) files (the parent renames them all, or removes them all)."""

    fixed_mmap_threshold()
    source = open_checkpoint(path)
    where = path if source.kind == "gguf" else os.path.join(path, "config.json")
    family = family_for(source.config, where, DTYPES[dtype], enable_expert_parallel, ignore_config_fields)
    build = family.builder()
    with layers.build_on_meta(), torch.device("meta"):
        shapes = {k: tuple(p.shape) for k, p in build(0, 1).named_parameters(remove_duplicate=False)}
    views = family.kit_views(shapes, source)
    skeletons = [os.path.join(out_dir, "rank%d.skeleton.tmp" % r) for r in ranks]
    try:
        plans = [plan_rank(build, r, tp, s, format) for r, s in zip(ranks, skeletons)]
        return write_ranks(plans, views, DTYPES[dtype], out_dir, info, export_id, check_space=False, crc32=crc32,
                           tp=tp, rename=False)
    finally:
        for s in skeletons:
            if os.path.exists(s):
                os.remove(s)


def write_in_jobs(path: str, tp: int, jobs: int, out_dir: str, dtype: str, enable_expert_parallel: bool,
                  ignore_config_fields, info: dict, export_id: str, crc32: bool,
                  format: str = "torchscript") -> List[str]:
    """``--jobs N``: the ranks dealt round-robin to N processes (spawned: each opens the checkpoint and
    holds its own tensor at a time); all renamed when every one is complete, all removed otherwise."""
    import concurrent.futures
    import multiprocessing

    groups = [list(range(j, tp, jobs)) for j in range(jobs) if j < tp]
    temps = [os.path.join(out_dir, "rank%d%s.tmp" % (r, ".pt2" if format == "export" else ".pt")) for r in range(tp)]
    try:
        with concurrent.futures.ProcessPoolExecutor(len(groups), mp_context=multiprocessing.get_context("spawn")) as ex:
            futures = [ex.submit(write_rank_group, path, tp, g, out_dir, dtype, enable_expert_parallel,
                                 list(ignore_config_fields), info, export_id, crc32, format) for g in groups]
            for f in futures:
                f.result()
        finals = [t[:-4] for t in temps]
        for tmp, final in zip(temps, finals):
            os.replace(tmp, final)
        return finals
    finally:
        for tmp in temps:
            if os.path.exists(tmp):
                os.remove(tmp)


def job_peak_bytes(views: Dict[str, View], dtype: torch.dtype) -> int:
    """Predicted peak memory of one writing process: the process (~1 GB: Python, PyTorch, the kit, the
    skeletons), TensorReader's buffers (the largest kit tensor, twice the largest read ahead), one rank
    slice copied in ``dtype`` and one joined (each at most a whole tensor)."""
    item = torch.empty(0, dtype=dtype).element_size()
    sizes = [v.nbytes for v in views.values()]
    ahead = [n for n in sizes if n <= AHEAD_BYTES]
    return (1_000_000_000 + max(sizes) + 2 * max(ahead, default=0)
            + 2 * max(v.nbytes // v.dtype.itemsize * item for v in views.values()))
