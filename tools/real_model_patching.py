#!/usr/bin/env python3
"""Activation patching through fragments' Python API on launched ranks: the half of
tools/real_model_check.py's patching check that runs fragments.

A process of its own, because `fragments` (its _C registers the frag:: ops in C++) cannot be imported
beside `fragkit` (which registers them in Python): real_model_check imports fragkit, this never does.

    python3 tools/real_model_patching.py EXPORT --world 3 --clean 1 2 3 --corrupt 1 9 3 \
        --layer 6 --position 1 --out patched.safetensors
"""
import argparse
import sys

import torch


def patch_rank(rank, path, clean, corrupt, layer, position):
    """One rank: layer `layer`'s output at `position` from the clean run patched into the corrupted run.
    Returns the patched logits on rank 0 (every rank computes the same whole), else None."""
    import fragments

    model = fragments.load(path)
    with model.trace(clean):
        h = model.model.layers[layer].output.save()
    with model.trace(corrupt):
        model.model.layers[layer].output[:, position] = h.value[:, position]
        patched = model.output.save()
    return patched.value if rank == 0 else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export", help="the export folder (rank0.pt ...)")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--clean", type=int, nargs="+", required=True, help="the clean prompt's token ids")
    p.add_argument("--corrupt", type=int, nargs="+", required=True, help="the corrupted prompt's token ids")
    p.add_argument("--layer", type=int, required=True)
    p.add_argument("--position", type=int, required=True)
    p.add_argument("--out", required=True, help="the patched logits (safetensors, key 'logits')")
    a = p.parse_args(argv)
    import fragments
    from safetensors.torch import save_file

    clean, corrupt = torch.tensor([a.clean]), torch.tensor([a.corrupt])
    logits = fragments.launch(patch_rank, world=a.world, backend="gloo", timeout=300,
                              args=(f"{a.export}/rank{{rank}}.pt", clean, corrupt, a.layer, a.position))[0]
    save_file({"logits": logits.contiguous()}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
