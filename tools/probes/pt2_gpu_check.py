"""One GPU, world 1: a .pt2 export run by fragments.load on CUDA (device machine check, issue 14).

Exports the reference llama at tp 1 twice (TorchScript and torch.export, same weights), loads both with
fragments.load(device="cuda"), and prints: a read-only plan's logits vs no plan's (bit-identical?), every
save of the .pt2 vs the TorchScript export's (max relative difference), and a logit lens's.

    python3 tools/probes/pt2_gpu_check.py --work /tmp/pt2gpu   (PYTHONPATH: the fragments package, the repository root for fragkit)
"""
import argparse
import os
import subprocess
import sys
import warnings

import torch

warnings.filterwarnings("ignore", message="The given buffer is not writable")
import fragments  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "python",
                                "frontend"))
import frontend_worker as worker  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--work", required=True)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    exporter = os.path.join(here, "..", "export_model.py")
    paths = {}
    for fmt, suffix in (("torchscript", "pt"), ("export", "pt2")):
        out = os.path.join(args.work, f"llama_tp1_{fmt}_{args.dtype}")
        subprocess.run([sys.executable, exporter, "--model", "llama", "--tp", "1", "--format", fmt, "--dtype",
                        args.dtype, "--out", out], check=True)
        paths[fmt] = os.path.join(out, f"rank0.{suffix}")
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(5))
    got = worker.every_location(fragments.load(paths["export"], device="cuda"), ids.cuda())
    want = worker.every_location(fragments.load(paths["torchscript"], device="cuda"), ids.cuda())
    print("read-only logits bit-identical:", torch.equal(got["read_only"], got["plain"]))
    worst = max(((got[k].float() - want[k].float()).abs().max() / want[k].float().abs().max()).item() for k in want)
    print(f"saves: {len(got)} vs {len(want)} names, same names: {sorted(got) == sorted(want)}; worst relative "
          f"difference vs TorchScript: {worst:.3g}")
    print("devices:", sorted({str(v.device) for v in got.values()}))


if __name__ == "__main__":
    main()
