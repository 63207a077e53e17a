"""What attaching costs: the same trace through `LanguageModel.attach` (a client of `python -m fragments.ranks`,
one more hop) and through a LanguageModel that started its own ranks, N traces each, wall time each; and
how long an attach takes (connect, authenticate, receive the module tree) against starting the ranks.

    PYTHONPATH=bazel-bin/python:python:. $(bash tools/python_env.sh) bench/attach_benchmark.py \\
        bazel-bin/tests/models/llama_tp2 [--tp 2] [--tokens 32] [--traces 50]

Prints medians and the ratio.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import fragments


def traces(model, ids, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        with model.trace(ids):
            h = model.model.layers[0].output
            lens = model.lm_head(model.model.norm(h))[:, -1].softmax(-1).topk(5).save()
        times.append(time.perf_counter() - t)
        assert lens.values.shape == (ids.shape[0], 5)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--traces", type=int, default=50)
    a = p.parse_args()
    ids = torch.randint(1, 500, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    with fragments.LanguageModel(a.export, tp=a.tp) as own:
        start = time.perf_counter() - t
        direct = traces(own, ids, a.traces)
    folder = tempfile.mkdtemp(prefix="attach_benchmark.")
    connection = os.path.join(folder, "ranks.json")
    host = subprocess.Popen([sys.executable, "-m", "fragments.ranks", a.export, "--tp", str(a.tp),
                             "--connection-file", connection], stdout=subprocess.PIPE, text=True)
    try:
        host.stdout.readline()
        t = time.perf_counter()
        client = fragments.LanguageModel.attach(connection)
        attach = time.perf_counter() - t
        attached = traces(client, ids, a.traces)
        client.shutdown_ranks()
        host.wait(60)
    finally:
        if host.poll() is None:
            host.kill()
        host.stdout.close()
        shutil.rmtree(folder, ignore_errors=True)  # the connection file too, where the ranks did not end
    d, c = statistics.median(direct), statistics.median(attached)
    print(f"start the ranks {start:.2f} s; attach {attach * 1e3:.1f} ms")
    print(f"trace (lens top 5, 1x{a.tokens} tokens, tp {a.tp}): own ranks {d * 1e3:.1f} ms, attached {c * 1e3:.1f} ms "
          f"(median of {a.traces}; {c / d:.3f}x)")


if __name__ == "__main__":
    main()
