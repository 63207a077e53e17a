"""A user's script, run by frontend_test under torchrun: fragments.launch runs this process's rank only."""
import os
import sys

import torch

import fragments


def work(rank, path, out_dir):
    model = fragments.load(path)
    with model.trace(torch.tensor([[3, 1, 4, 1, 5, 9]])):
        logits = model.output.save()
    torch.save(logits.value, os.path.join(out_dir, f"logits{rank}.pt"))
    return rank


if __name__ == "__main__":
    results = fragments.launch(work, world=2, args=(sys.argv[1], sys.argv[2]))
    with open(os.path.join(sys.argv[2], f"launched{os.environ['RANK']}.txt"), "w") as f:
        f.write(repr(results))
