"""A loaded session (fragments.LanguageModel) against a fresh `fragments.launch` per trace, and the session's
per-trace overhead against a plain forward, side by side in one run:
  - session: the model loaded once on N rank processes; T traces of the same body, wall time each;
  - launch: the same trace as L separate `fragments.launch(fn, world=N)` runs (each spawns the ranks and
    loads the rank files, as a script per experiment does), wall time each;
  - plain forward: on the session's own ranks, between its traces, the C++ forward with nothing registered
    (`Model._c.run([], [], ids)`, timed on rank 0, no messages), against the session's trace with nothing
    but `model.output.save()` (recording, messages, the logits sent back) and with the body.

    PYTHONPATH=bazel-bin/python:python:. $(bash tools/python_env.sh) bench/session_benchmark.py \\
        bazel-bin/tests/models/llama_tp2 [--tp 2] [--tokens 32] [--traces 100] [--launches 100]

Prints medians and the ratios.
"""
import argparse
import statistics
import time

import torch

import fragments


def body(model, v):
    """What each trace does: a save, an expression saved (top 5 of the last position's lens), an edit."""
    m = model.model
    h = m.layers[0].output
    m.layers[0].output[:, -1] += v
    lens = model.lm_head(m.norm(h))[:, -1].softmax(-1).topk(5).save()
    return lens, model.output.save()


def launched_trace(rank, path, ids, v):
    """One `fragments.launch` run: load, trace (plain API: the lens saved whole, its top 5 taken after)."""
    model = fragments.load(path)
    m = model.model
    with model.trace(ids):
        m.layers[0].output[:, -1] += v
        lens = model.lm_head(m.norm(m.layers[0].output)).save()
        logits = model.output.save()
    return (lens.value[:, -1].softmax(-1).topk(5), logits.value) if rank == 0 else None


def plain_forward(ids):
    """A function the session sends to its ranks: one forward, nothing registered; seconds on the rank."""
    def run(model):
        t = time.perf_counter()
        model._c.run([], [], ids)
        return time.perf_counter() - t
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export", help="an export folder (rank0.pt ...)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--traces", type=int, default=100)
    p.add_argument("--launches", type=int, default=100)
    a = p.parse_args()
    path = f"{a.export}/rank{{rank}}.pt"
    ids = torch.randint(0, 1000, (1, a.tokens), generator=torch.Generator().manual_seed(0))

    t = time.perf_counter()
    model = fragments.LanguageModel(a.export, tp=a.tp)
    load = time.perf_counter() - t
    hidden = model.model.norm.weight.shape[-1]
    v = torch.randn(hidden, generator=torch.Generator().manual_seed(1))
    session, bare, forward = [], [], []
    for _ in range(3):
        with model.trace(ids):
            body(model, v)
    for _ in range(a.traces):
        forward.append(model.run_on_ranks(plain_forward(ids)))
        t = time.perf_counter()
        with model.trace(ids):
            lens, logits = body(model, v)
        session.append(time.perf_counter() - t)
        t = time.perf_counter()
        with model.trace(ids):
            model.output.save()
        bare.append(time.perf_counter() - t)
    model.close()

    launched = []
    for _ in range(a.launches):
        t = time.perf_counter()
        theirs = fragments.launch(launched_trace, world=a.tp, args=(path, ids, v))[0]
        launched.append(time.perf_counter() - t)
    assert torch.equal(theirs[0].indices, lens.indices) and torch.allclose(theirs[1], logits.value), \
        "the session's trace and the launched one differ"
    forward = statistics.median(forward)

    med = statistics.median
    print(f"{a.export} tp={a.tp}, 1x{a.tokens} tokens")
    print(f"session: load {load:.2f} s once; {a.traces} traces {sum(session):.2f} s in all, median {med(session) * 1e3:.1f} ms")
    print(f"launch:  {a.launches} runs {sum(launched):.2f} s in all, median {med(launched) * 1e3:.1f} ms")
    print(f"  per trace: launch / session = {med(launched) / med(session):.1f}x; "
          f"{a.traces} traces: session incl. its load {load + sum(session):.2f} s vs launches "
          + (f"{sum(launched):.2f} s" if a.launches == a.traces else
             f"~{med(launched) * a.traces:.0f} s (median of {a.launches} runs x {a.traces})"))
    print(f"plain forward (C++, nothing registered, on the session's ranks): median {forward * 1e3:.2f} ms")
    print(f"  session trace saving the logits: median {med(bare) * 1e3:.2f} ms = {med(bare) / forward:.2f}x; "
          f"overhead {(med(bare) - forward) * 1e3:.2f} ms")
    print(f"  session trace with the body (save, edit, top-5 lens): median {med(session) * 1e3:.2f} ms = "
          f"{med(session) / forward:.2f}x")


if __name__ == "__main__":
    main()
