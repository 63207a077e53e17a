"""Import benchmark: a checkpoint larger than memory imported rank by rank, against a plain copy of its bytes.

    PYTHONPATH=. python3 bench/import_benchmark.py [--like llama3-8b] [--layers N] [--tps 1,2,4,8]
        [--work DIR] [--frag bazel-bin/cli/frag] [--frag-layers 4] [--json OUT.json]

1. ``python3 -m fragkit.synthetic --like llama3-8b`` writes a Hugging Face folder (bf16, ~16 GB).
2. For each tp: the checkpoint's pages are dropped from the page cache (posix_fadvise DONTNEED on its files,
   nothing else's), then the peer: ``cat`` of every shard into one file, then ``sync`` (coreutils: a plain read
   and write of the same bytes); the copy is deleted, the cache dropped again, and
   ``python3 -m fragkit.checkpoint --from DIR --tp N`` runs, then ``sync``. Both are timed the same way (a
   fresh process each, until the data is on disk). The import's peak resident memory is its ru_maxrss
   (wait4). With ``--frag``: ``frag inspect rank0.pt`` (LibTorch's load of the file) and its peak resident
   memory against the file's size (issue 30 item 5). The rank files are deleted before the next tp, the
   checkpoint at the end.
3. With ``--frag``: the same shape with ``--frag-layers`` decoder layers, imported at tp 1 and 4, and
   ``frag run`` of both on the same token ids: the logits must agree within bf16 rounding (the forward runs
   in bf16; the tp 4 sums are reduced in another order).

Targets (issue 30): peak memory <= 2 GB + the largest tensor, import wall time <= 1.5x the copy.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # holds fragkit/


def drop_cache(folder: str) -> None:
    """Drop this folder's files from the page cache (and only them)."""
    os.sync()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(cmd, **kw):
    """(seconds until the command is done and `sync` returned, peak RSS in bytes, stdout)."""
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, **kw)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit("failed (%d): %s" % (proc.returncode, " ".join(cmd)))
    os.sync()
    return time.time() - started, usage.ru_maxrss * 1024, out


def shard_files(folder):
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def largest_tensor(folder) -> int:
    from safetensors import safe_open

    biggest = 0
    for f in shard_files(folder):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                biggest = max(biggest, n * {"BF16": 2, "F16": 2, "F32": 4}[sl.get_dtype()])
    return biggest


def env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")


def frag_check(args, work):
    """tp 4 vs tp 1 logits of frag run on a --frag-layers deep checkpoint of the same widths."""
    import torch
    from safetensors.torch import load_file

    ckpt = os.path.join(work, "frag_ckpt")
    subprocess.run([sys.executable, "-m", "fragkit.synthetic", "--like", args.like, "--layers",
                    str(args.frag_layers), "--out", ckpt, "--quiet"], check=True, env=env(), stdout=subprocess.DEVNULL)
    ids = os.path.join(work, "ids.txt")
    with open(ids, "w") as f:
        f.write("1 17 300 999 42 5 64 700 128000 9 11 4096\n")
    logits = {}
    for tp in (1, 4):
        out = os.path.join(work, "frag_tp%d" % tp)
        subprocess.run([sys.executable, "-m", "fragkit.checkpoint", "--from", ckpt, "--tp", str(tp), "--out", out,
                        "--quiet"], check=True, env=env(), stdout=subprocess.DEVNULL)
        result = os.path.join(work, "logits_tp%d.safetensors" % tp)
        started = time.time()
        done = subprocess.run([args.frag, "run", "--world", str(tp), os.path.join(out, "rank{rank}.pt"), "--input", ids,
                               "--out", result, "--timeout", "1200"], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit("frag run failed: %s" % done.stderr[-2000:])
        logits[tp] = load_file(result)["logits"]
        print("frag run tp %d: %.1f s, logits %s %s" % (tp, time.time() - started, tuple(logits[tp].shape),
                                                        logits[tp].dtype), flush=True)
        shutil.rmtree(out)
    a, b = logits[1].float(), logits[4].float()
    diff = (a - b).abs()
    # bf16 keeps 8 significant bits: its spacing at the largest logit m is 2^(floor(log2 m) - 7).
    top = a.abs().max()
    ulp = float(2.0 ** (torch.floor(torch.log2(top)) - 7))
    shutil.rmtree(ckpt)
    return {"layers": args.frag_layers, "max_abs_diff": float(diff.max()), "max_abs_logit": float(top),
            "max_diff_in_bf16_spacings_at_max": float(diff.max()) / ulp, "equal_fraction": float((diff == 0).float().mean()),
            "argmax_equal": bool(torch.equal(a.argmax(-1), b.argmax(-1)))}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", default="llama3-8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--tps", default="1,2,4,8")
    p.add_argument("--work", default=None, help="a folder on the disk to measure (default: a temporary one)")
    p.add_argument("--frag", default=None, help="the frag binary: also compare frag run at tp 4 and tp 1")
    p.add_argument("--frag-layers", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from fragkit.synthetic import like_config, tensor_shapes

    cfg = like_config(args.like, args.layers)
    total = sum(2 * int(__import__("math").prod(s)) for _, s in tensor_shapes(cfg))
    work = args.work or tempfile.mkdtemp(prefix="fragkit-import-bench-")
    os.makedirs(work, exist_ok=True)
    free = shutil.disk_usage(work).free
    if free < 2.2 * total:
        raise SystemExit("%s: needs %.1f GB free (checkpoint + one copy), has %.1f GB" % (work, 2.2 * total / 1e9,
                                                                                          free / 1e9))
    ckpt = os.path.join(work, "ckpt")
    results = {"like": args.like, "layers": cfg["num_hidden_layers"], "checkpoint_bytes": total, "rows": []}
    try:
        cmd = [sys.executable, "-m", "fragkit.synthetic", "--like", args.like, "--out", ckpt, "--quiet"]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        seconds, rss, _ = timed(cmd, env=env())
        results["synthetic_seconds"], results["synthetic_peak_rss"] = seconds, rss
        big = largest_tensor(ckpt)
        results["largest_tensor_bytes"] = big
        print("checkpoint: %s, %d layers, %.2f GB in %d shards, largest tensor %.2f GB; written in %.0f s "
              "(peak RSS %.2f GB)" % (args.like, cfg["num_hidden_layers"], total / 1e9, len(shard_files(ckpt)),
                                      big / 1e9, seconds, rss / 1e9), flush=True)
        print("| tp | copy s | import s | import/copy | peak RSS GB | target GB | rank files GB | "
              "frag inspect rank0: peak RSS / file GB |", flush=True)
        print("|---|---|---|---|---|---|---|---|", flush=True)
        for tp in [int(t) for t in args.tps.split(",")]:
            copy = os.path.join(work, "copy.bin")
            drop_cache(ckpt)
            started = time.time()
            with open(copy, "wb") as f:
                subprocess.run(["cat"] + shard_files(ckpt), stdout=f, check=True)
            os.sync()
            copy_s = time.time() - started
            os.remove(copy)
            os.sync()
            out = os.path.join(work, "tp%d" % tp)
            drop_cache(ckpt)
            import_s, rss, _ = timed([sys.executable, "-m", "fragkit.checkpoint", "--from", ckpt, "--tp", str(tp),
                                      "--out", out, "--quiet"], env=env())
            written = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".pt"))
            load = None
            if args.frag:  # issue 30 item 5: loading a rank file takes about its size (no second copy)
                rank0 = os.path.join(out, "rank0.pt")
                _, load_rss, _ = timed([args.frag, "inspect", rank0])
                load = {"rank0_bytes": os.path.getsize(rank0), "frag_inspect_peak_rss": load_rss}
            shutil.rmtree(out)
            os.sync()
            row = {"tp": tp, "copy_seconds": copy_s, "import_seconds": import_s, "ratio": import_s / copy_s,
                   "peak_rss": rss, "target_rss": 2e9 + big, "rank_bytes": written, "load": load}
            results["rows"].append(row)
            print("| %d | %.1f | %.1f | %.2f | %.2f | %.2f | %.2f | %s |" % (
                tp, copy_s, import_s, import_s / copy_s, rss / 1e9, (2e9 + big) / 1e9, written / 1e9,
                "%.2f / %.2f" % (load["frag_inspect_peak_rss"] / 1e9, load["rank0_bytes"] / 1e9) if load else "-"),
                flush=True)
        shutil.rmtree(ckpt)
        if args.frag:
            results["frag"] = frag_check(args, work)
            print("frag run tp 4 vs tp 1: %s" % json.dumps(results["frag"]), flush=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
        elif os.path.isdir(ckpt):
            shutil.rmtree(ckpt, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
