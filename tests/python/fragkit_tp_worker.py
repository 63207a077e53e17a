"""Worker for the multi-process tp tests (not a test module): one process per rank, gloo on 127.0.0.1."""
import datetime
import os
import sys


def run_rank(rank, world_size, port, cases, out_dir, kit_root):
    if kit_root not in sys.path:
        sys.path.insert(0, kit_root)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import fragkit  # noqa: F401  (registers frag::all_reduce / frag::all_gather before loading)

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        with torch.no_grad():
            for case in cases:
                name = case["name"]
                if name == "ops":
                    out = _ops_case(rank, world_size)
                else:
                    if case.get("format") == "export":
                        module = torch.export.load(os.path.join(case["dir"], "rank%d.pt2" % rank)).module()
                    else:
                        module = torch.jit.load(os.path.join(case["dir"], "rank%d.pt" % rank))
                    inputs = torch.load(case["inputs"])
                    out = module(*inputs)
                torch.save(out, os.path.join(out_dir, "%s.rank%d.pt" % (name, rank)))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _ops_case(rank, world_size):
    import torch
    x = torch.full((2, 3), float(rank + 1))
    return {
        "all_reduce": torch.ops.frag.all_reduce(x, "tp"),
        "all_reduce_ep_bf16": torch.ops.frag.all_reduce(x.to(torch.bfloat16), "ep"),
        "all_gather_0": torch.ops.frag.all_gather(x, 0, "tp"),
        "all_gather_m1": torch.ops.frag.all_gather(x[:, :1] * 10 + torch.arange(2.0).view(2, 1), -1, "tp"),
        "input_unchanged": x,
    }
