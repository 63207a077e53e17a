#!/usr/bin/env python3
"""CPU: cached generation (program/decoder.h) against recomputing the prefix, and against transformers.

Exports a kit Llama (hidden 256, intermediate 768, 8 heads of 32, 4 kv heads, 4 layers, vocab 2048,
2,048 positions; float32) with tools/export_model.py into a temporary folder, then in one run:

  1. decode step after a 16-token prefix vs after a 1,024-token prefix (one row), steps of the two
     interleaved: the median ms of each and their ratio (goal <= 1.3), for fragments' KV cache and for
     transformers' LlamaForCausalLM of the same shape with its DynamicCache;
  2. 64 new tokens after a 512-token prompt: fragments with its KV cache, the same model recomputing the whole
     sequence each token (what ShardedModel::generate did before the cache), and Hugging Face transformers'
     LlamaForCausalLM of the same shape (random weights) with generate(use_cache=True), side by side.

    PY=$(bash tools/python_env.sh); bazel build //python/fragments
    PYTHONPATH=bazel-bin/python:python:. $PY bench/decode_benchmark.py [--threads 1] [--reps 5]

Single-rank (tp 1), torch.set_num_threads(--threads) on every side. Numbers move when other jobs run on the
machine: compare the ratios of one run. Memory: ~100 MB.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SHAPE = dict(hidden=256, intermediate=768, heads=8, kv_heads=4, layers=4, vocab=2048, max_positions=2048)


def export(folder):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "tools", "export_model.py")
    cmd = [sys.executable, script, "--model", "llama", "--tp", "1", "--out", folder]
    for k, v in SHAPE.items():
        cmd += ["--" + k.replace("_", "-"), str(v)]
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=root))
    return os.path.join(folder, "rank0.pt")


def median_ms(fn, reps):
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def decode_steps_ms(model, prefixes, steps):
    """Median ms of a decode step after each prefix (prefill not timed); the prefixes' steps interleaved, so
    that other jobs on the machine slow them alike."""
    from fragments import _C

    c = model._c
    c.prepare([], [])
    decoders, tokens, times = {}, {}, {p: [] for p in prefixes}
    for prefix in prefixes:
        decoders[prefix] = _C.Decoder(c, 1, prefix + steps + 1)
        tokens[prefix] = decoders[prefix].prefill([[(7 * i) % SHAPE["vocab"] for i in range(prefix)]]).argmax(-1)
    for _ in range(steps):
        for prefix in prefixes:
            started = time.perf_counter()
            tokens[prefix] = decoders[prefix].decode(tokens[prefix]).argmax(-1)
            times[prefix].append((time.perf_counter() - started) * 1000)
    c.finish(False)
    return {p: statistics.median(t[steps // 4:]) for p, t in times.items()}


def transformers_steps_ms(hf, prefixes, steps):
    """The same for transformers' LlamaForCausalLM with its DynamicCache (forward with past_key_values)."""
    caches, tokens, times = {}, {}, {p: [] for p in prefixes}
    with torch.no_grad():
        for prefix in prefixes:
            out = hf(torch.tensor([[(7 * i) % SHAPE["vocab"] for i in range(prefix)]]), use_cache=True)
            caches[prefix], tokens[prefix] = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            for prefix in prefixes:
                started = time.perf_counter()
                out = hf(tokens[prefix], past_key_values=caches[prefix], use_cache=True)
                tokens[prefix] = out.logits[:, -1:].argmax(-1)
                times[prefix].append((time.perf_counter() - started) * 1000)
    return {p: statistics.median(t[steps // 4:]) for p, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=80, help="decode steps timed after each prefix")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="decode_benchmark.") as folder:  # the export goes on every path
        return run(a, folder)


def run(a, folder):
    path = export(folder)
    import fragments

    model = fragments.load(path)
    print("kit Llama %s, tp 1, float32, %d thread(s), median of %d" % (SHAPE, a.threads, a.reps))

    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"],
                                      intermediate_size=SHAPE["intermediate"], num_attention_heads=SHAPE["heads"],
                                      num_key_value_heads=SHAPE["kv_heads"], num_hidden_layers=SHAPE["layers"],
                                      max_position_embeddings=SHAPE["max_positions"])).eval()
    ours = decode_steps_ms(model, (16, 1024), a.steps)
    theirs = transformers_steps_ms(hf, (16, 1024), a.steps)
    print("decode step (one row), median of %d interleaved steps:   after 16   after 1024   ratio" % a.steps)
    for name, ms in (("fragments, KV cache", ours), ("transformers, DynamicCache", theirs)):
        print("  %-50s %6.2f ms  %8.2f ms   %.2f" % (name, ms[16], ms[1024], ms[1024] / ms[16]))
    print("  (goal for fragments: ratio <= 1.3)")

    prompt = [[(11 * i) % SHAPE["vocab"] for i in range(512)]]

    def cached():
        with model.generate(prompt, max_new_tokens=64) as gen:
            pass
        return gen.new_tokens[0]

    def recompute():
        tokens = torch.tensor(prompt)
        new = []
        for _ in range(64):
            with model.trace(tokens):
                logits = model.output.save()
            nxt = logits.value[:, -1].argmax(-1, keepdim=True)
            new.append(int(nxt))
            tokens = torch.cat([tokens, nxt], 1)
        return new

    assert cached() == recompute(), "cached and recomputed greedy tokens differ"
    ids = torch.tensor(prompt)

    def transformers_generate():
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                        do_sample=False, use_cache=True, pad_token_id=0)

    rows = [("fragments, KV cache", median_ms(cached, a.reps)),
            ("fragments, recompute the prefix each token", median_ms(recompute, max(1, a.reps // 2))),
            ("transformers generate(use_cache=True)", median_ms(transformers_generate, a.reps))]
    print("64 new tokens after a 512-token prompt (prefill included):")
    base = rows[0][1]
    for name, ms in rows:
        print("  %-45s %9.1f ms   %.2fx fragments' cached" % (name, ms, ms / base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
