"""Python front end overhead per forward: a trace (recording + typed plan + the C++ run) against the same
typed steps handed to the C++ runtime directly (fragments._C: clear, apply, cross-rank agreement, forward).

    PYTHONPATH=bazel-bin/python:python:tools $(bash tools/python_env.sh) tools/bench/python_trace_overhead.py \\
        'bazel-bin/tests/models/llama_tp2/rank{rank}.pt' [--world 2] [--tokens 128] [--repeats 30]

Prints, on rank 0, the median time per forward of each and the difference.
"""
import argparse
import statistics
import time

import torch

import fragments


def body(model, v):
    m = model.model
    m.layers[0].mlp.down_proj.input.save()
    m.layers[1].self_attn.qkv_proj.output.save()
    m.layers[0].output[:, -1] += v
    return model.output.save()


def work(rank, path, tokens, repeats):
    model = fragments.load(path)
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    v = torch.randn(64, generator=torch.Generator().manual_seed(1))  # the same on every rank (else refused)
    with model.trace(ids) as recorded:
        body(model, v)
    steps = recorded._steps
    python, direct = [], []
    for _ in range(3):  # warm up both paths (the profiling executor specializes the graph)
        with model.trace(ids):
            body(model, v)
        model._c.run(steps, [], recorded._ids)
    for _ in range(repeats):
        t = time.perf_counter()
        with model.trace(ids):
            body(model, v)
        python.append(time.perf_counter() - t)
        t = time.perf_counter()
        model._c.run(steps, [], recorded._ids)
        direct.append(time.perf_counter() - t)
    return statistics.median(python), statistics.median(direct)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    python, direct = fragments.launch(work, world=a.world, args=(a.path, a.tokens, a.repeats))[0]
    print(f"world {a.world}, {a.tokens} tokens, median of {a.repeats}: trace {python * 1e3:.2f} ms, "
          f"C++ steps {direct * 1e3:.2f} ms, Python's part {(python - direct) * 1e3:.2f} ms "
          f"({(python / direct - 1) * 100:+.1f} %)")
