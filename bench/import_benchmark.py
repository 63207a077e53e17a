"""Import benchmark: a checkpoint larger than memory imported rank by rank, against a plain copy of its bytes.

    PYTHONPATH=. python3 bench/import_benchmark.py [--like llama3-8b] [--layers N] [--checkpoint DIR]
        [--tps 1,2,4,8] [--rounds R] [--jobs N] [--format torchscript|export] [--work DIR]
        [--frag bazel-bin/cli/frag] [--frag-layers 4] [--frag-tps 1,4] [--json OUT.json]

1. ``python3 -m fragkit.synthetic --like llama3-8b`` writes a Hugging Face folder (bf16, ~16 GB), or
   ``--checkpoint DIR`` reuses one made before (it is not deleted then).
2. For each tp, ``--rounds`` paired rounds: the checkpoint's pages are dropped from the page cache
   (posix_fadvise DONTNEED on its files, nothing else's), then the peer: ``cat`` of every shard into one file,
   then ``sync`` (coreutils: a plain read and write of the same bytes); the copy is deleted, the cache dropped
   again, and ``python3 -m fragkit.checkpoint --from DIR --tp N [--jobs N] [--format F]`` runs, then ``sync``.
   Both are timed the same way (a fresh process each, until the data is on disk); each round's ratio is
   import / cat of that round, so a change in the machine's load between rounds cancels as far as it can. The
   import's peak resident memory is its ru_maxrss, its CPU time ru_utime + ru_stime (wait4), as for cat.
   The load average (the machine may be shared) is printed with each round. With ``--frag`` (TorchScript):
   ``frag inspect rank0.pt`` (LibTorch's load of the file) and its peak resident memory against the file's
   size (issue 30 item 5). The rank files are deleted after each round, the checkpoint at the end (unless
   ``--checkpoint``).
3. With ``--frag``: the same shape with ``--frag-layers`` decoder layers, imported at each of ``--frag-tps``,
   and ``frag run`` of each on the same token ids: the logits must agree with the first tp's within bf16
   rounding (the forward runs in bf16; the tp > 1 sums are reduced in another order).

Targets (issue 30): peak memory <= 2 GB + the largest tensor, import wall time <= 1.5x the copy.
"""
import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # holds fragkit/


IDS = [1, 17, 300, 999, 42, 5, 64, 700, 128000, 9, 11, 4096]  # frag run's token ids (llama3's vocabulary)


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


def reference_logits(ckpt: str, ids) -> "torch.Tensor":
    """float32 logits of a Llama-family checkpoint by transformers' own layers (LlamaDecoderLayer, RMSNorm,
    rotary), streamed: one decoder layer's weights in memory at a time, read from the safetensors shards and
    widened to float32. The ground truth both frag runs are measured against: tp 1 and tp N each round in
    bf16 in their own order, so their distance to each other means little without their distance to this."""
    import torch
    import transformers
    from safetensors import safe_open
    from transformers.models.llama import modeling_llama as ml

    cfg = transformers.AutoConfig.from_pretrained(ckpt)
    cfg._attn_implementation = "sdpa"
    where = {}
    for shard in shard_files(ckpt):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                where[name] = shard

    def load(name):
        with safe_open(where[name], "pt") as f:
            return f.get_tensor(name).float()

    def load_into(module, prefix):
        module.load_state_dict({k: load(prefix + k) for k in module.state_dict()}, strict=True)
        return module

    with torch.no_grad():
        ids = torch.tensor([ids])
        x = load("model.embed_tokens.weight")[ids]
        positions = torch.arange(ids.shape[1])[None]
        cos_sin = ml.LlamaRotaryEmbedding(cfg)(x, positions)
        for i in range(cfg.num_hidden_layers):
            layer = load_into(ml.LlamaDecoderLayer(cfg, i).float(), "model.layers.%d." % i)
            out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
            del layer
        x = load_into(ml.LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps), "model.norm.")(x)
        head = "lm_head.weight" if "lm_head.weight" in where else "model.embed_tokens.weight"
        return x @ load(head).T


def frag_check(args, work, existing=None):
    """Logits of frag run at each --frag-tps against the first, on a --frag-layers deep checkpoint of the same
    widths (`existing`, the benchmark's own checkpoint, when it is that deep: 16 GB is not written twice)."""
    import torch
    from safetensors.torch import load_file

    ckpt = existing or os.path.join(work, "frag_ckpt")
    if not existing:
        subprocess.run([sys.executable, "-m", "fragkit.synthetic", "--like", args.like, "--layers",
                        str(args.frag_layers), "--out", ckpt, "--quiet"], check=True, env=env(),
                       stdout=subprocess.DEVNULL)
    ids = os.path.join(work, "ids.txt")
    with open(ids, "w") as f:
        f.write(" ".join(map(str, IDS)) + "\n")
    logits = {}
    tps = [int(t) for t in args.frag_tps.split(",")]
    reference = None
    try:
        for tp in tps:
            out = os.path.join(work, "frag_tp%d" % tp)
            subprocess.run([sys.executable, "-m", "fragkit.checkpoint", "--from", ckpt, "--tp", str(tp), "--out", out,
                            "--quiet"], check=True, env=env(), stdout=subprocess.DEVNULL)
            result = os.path.join(work, "logits_tp%d.safetensors" % tp)
            started = time.time()
            done = subprocess.run([args.frag, "run", "--world", str(tp), os.path.join(out, "rank{rank}.pt"), "--input",
                                   ids, "--out", result, "--timeout", "1200"], capture_output=True, text=True)
            shutil.rmtree(out)
            if done.returncode != 0:
                raise SystemExit("frag run failed: %s" % done.stderr[-2000:])
            logits[tp] = load_file(result)["logits"]
            os.remove(result)
            print("frag run tp %d: %.1f s, logits %s %s" % (tp, time.time() - started, tuple(logits[tp].shape),
                                                            logits[tp].dtype), flush=True)
        if args.reference:
            started = time.time()
            reference = reference_logits(ckpt, IDS).reshape(logits[tps[0]].shape)
            print("float32 reference (transformers' layers, streamed): %.1f s" % (time.time() - started), flush=True)
    finally:
        if not existing:
            shutil.rmtree(ckpt, ignore_errors=True)
        if os.path.exists(ids):
            os.remove(ids)
    rows = []
    a = logits[tps[0]].float()
    # bf16 keeps 8 significant bits: its spacing at the largest logit m is 2^(floor(log2 m) - 7).
    top = a.abs().max()
    ulp = float(2.0 ** (torch.floor(torch.log2(top)) - 7))
    for tp in tps[1:]:
        diff = (logits[tp].float() - a).abs()
        rows.append({"tp": tp, "against_tp": tps[0], "max_abs_diff": float(diff.max()), "max_abs_logit": float(top),
                     "max_diff_in_bf16_spacings_at_max": float(diff.max()) / ulp,
                     "equal_fraction": float((diff == 0).float().mean()),
                     "argmax_equal": bool(torch.equal(a.argmax(-1), logits[tp].float().argmax(-1)))})
    result = {"layers": args.frag_layers, "rows": rows}
    if reference is not None:
        # each tp's own bf16 error: its distance to the float32 forward, in bf16 spacings at the largest logit
        result["against_float32"] = {}
        for tp in tps:
            diff = (logits[tp].float() - reference).abs()
            result["against_float32"][tp] = {
                "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
                "max_diff_in_bf16_spacings_at_max": float(diff.max()) / ulp,
                "argmax_equal_fraction": float((logits[tp].float().argmax(-1) == reference.argmax(-1)).float().mean())}
    return result


def timed_copy(ckpt: str, copy: str):
    """cat of the shards into one file, until synced: (seconds, CPU seconds)."""
    drop_cache(ckpt)
    started = time.time()
    with open(copy, "wb") as f:
        proc = subprocess.Popen(["cat"] + shard_files(ckpt), stdout=f)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("cat failed")
    os.sync()
    seconds = time.time() - started
    os.remove(copy)
    os.sync()
    return seconds, usage.ru_utime + usage.ru_stime


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", default="llama3-8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--checkpoint", default=None, help="reuse this synthetic checkpoint folder (kept)")
    p.add_argument("--tps", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=1, help="paired rounds (cat, then the import) per tp")
    p.add_argument("--jobs", type=int, default=1, help="the import's --jobs")
    p.add_argument("--format", default="torchscript", choices=("torchscript", "export"), help="the import's --format")
    p.add_argument("--work", default=None, help="a folder on the disk to measure (default: a temporary one)")
    p.add_argument("--frag", default=None, help="the frag binary: also compare frag run at --frag-tps")
    p.add_argument("--frag-layers", type=int, default=4)
    p.add_argument("--frag-tps", default="1,4", help="tps of the frag run comparison, the first the reference")
    p.add_argument("--reference", action="store_true",
                   help="also a float32 forward by transformers' Llama layers (streamed a layer at a time), and "
                        "each tp's distance to it (Llama-family checkpoints)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from fragkit.synthetic import like_config, tensor_shapes

    work = args.work or tempfile.mkdtemp(prefix="fragkit-import-bench-")
    if not args.work:  # also where the checks before the try below stop the run
        atexit.register(shutil.rmtree, work, True)
    os.makedirs(work, exist_ok=True)
    if args.checkpoint:
        ckpt = os.path.abspath(args.checkpoint)
        with open(os.path.join(ckpt, "config.json")) as f:
            cfg = json.load(f)
        total = sum(os.path.getsize(f) for f in shard_files(ckpt))
    else:
        cfg = like_config(args.like, args.layers)
        total = sum(2 * int(__import__("math").prod(s)) for _, s in tensor_shapes(cfg))
        ckpt = os.path.join(work, "ckpt")
    free = shutil.disk_usage(work).free
    needed = (1.2 if args.checkpoint else 2.2) * total
    if free < needed:
        raise SystemExit("%s: needs %.1f GB free (checkpoint + one copy), has %.1f GB" % (work, needed / 1e9, free / 1e9))
    results = {"like": None if args.checkpoint else args.like, "checkpoint": args.checkpoint,
               "layers": cfg["num_hidden_layers"], "checkpoint_bytes": total, "rounds": args.rounds,
               "jobs": args.jobs, "format": args.format, "cpus": os.cpu_count(), "rows": []}
    suffix = ".pt2" if args.format == "export" else ".pt"
    try:
        if not args.checkpoint:
            cmd = [sys.executable, "-m", "fragkit.synthetic", "--like", args.like, "--out", ckpt, "--quiet"]
            if args.layers:
                cmd += ["--layers", str(args.layers)]
            seconds, rss, _ = timed(cmd, env=env())
            results["synthetic_seconds"], results["synthetic_peak_rss"] = seconds, rss
        big = largest_tensor(ckpt)
        results["largest_tensor_bytes"] = big
        print("checkpoint: %s, %d layers, %.2f GB in %d shards, largest tensor %.2f GB; %d CPUs; import --jobs %d "
              "--format %s, %d paired round(s) per tp" % (args.checkpoint or args.like, cfg["num_hidden_layers"],
                                                          total / 1e9, len(shard_files(ckpt)), big / 1e9,
                                                          os.cpu_count(), args.jobs, args.format, args.rounds),
              flush=True)
        print("| tp | round | load avg (1 min) | cat s | import s | import/cat | cat CPU s | import CPU s | "
              "peak RSS GB | target GB | rank files GB | frag inspect rank0: peak RSS / file GB |", flush=True)
        print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
        for tp in [int(t) for t in args.tps.split(",") if t]:
            row = {"tp": tp, "rounds": [], "target_rss": 2e9 + big}
            for rnd in range(args.rounds):
                load_before = os.getloadavg()[0]
                copy_s, copy_cpu = timed_copy(ckpt, os.path.join(work, "copy.bin"))
                out = os.path.join(work, "tp%d" % tp)
                drop_cache(ckpt)
                cmd = [sys.executable, "-m", "fragkit.checkpoint", "--from", ckpt, "--tp", str(tp), "--out", out,
                       "--quiet", "--jobs", str(args.jobs), "--format", args.format]
                started = time.time()
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env())
                _, status, usage = os.wait4(proc.pid, 0)
                if os.waitstatus_to_exitcode(status) != 0:
                    raise SystemExit("failed: %s" % " ".join(cmd))
                os.sync()
                import_s = time.time() - started
                # --jobs: the children's peak is in RUSAGE_CHILDREN of the import process, not here; ru_maxrss
                # of wait4 is the largest of the process and its waited-for children.
                rss, import_cpu = usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime
                written = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(suffix))
                load = None
                if args.frag and args.format == "torchscript":  # issue 30 item 5: loading takes about the file's size
                    rank0 = os.path.join(out, "rank0.pt")
                    _, load_rss, _ = timed([args.frag, "inspect", rank0])
                    load = {"rank0_bytes": os.path.getsize(rank0), "frag_inspect_peak_rss": load_rss}
                shutil.rmtree(out)
                os.sync()
                load_after = os.getloadavg()[0]
                one = {"round": rnd, "copy_seconds": copy_s, "copy_cpu_seconds": copy_cpu, "import_seconds": import_s,
                       "import_cpu_seconds": import_cpu, "ratio": import_s / copy_s, "peak_rss": rss,
                       "rank_bytes": written, "load": load, "loadavg_1min": [load_before, load_after]}
                row["rounds"].append(one)
                print("| %d | %d | %.1f-%.1f | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f | %.2f | %.2f | %s |" % (
                    tp, rnd, load_before, load_after, copy_s, import_s, import_s / copy_s, copy_cpu, import_cpu,
                    rss / 1e9, (2e9 + big) / 1e9, written / 1e9,
                    "%.2f / %.2f" % (load["frag_inspect_peak_rss"] / 1e9, load["rank0_bytes"] / 1e9) if load else "-"),
                    flush=True)
            ratios = [r["ratio"] for r in row["rounds"]]
            row.update(ratio_median=median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                       peak_rss=max(r["peak_rss"] for r in row["rounds"]))
            results["rows"].append(row)
        print("\n| tp | import/cat median (min-max) over %d rounds | peak RSS GB (max) | target GB |" % args.rounds)
        print("|---|---|---|---|")
        for row in results["rows"]:
            print("| %d | %.2f (%.2f-%.2f) | %.2f | %.2f |" % (row["tp"], row["ratio_median"], row["ratio_min"],
                                                            row["ratio_max"], row["peak_rss"] / 1e9,
                                                            row["target_rss"] / 1e9), flush=True)
        if args.frag:
            same = args.frag_layers == cfg["num_hidden_layers"]
            results["frag"] = frag_check(args, work, ckpt if same else None)
            print("frag run against tp %s: %s" % (args.frag_tps.split(",")[0], json.dumps(results["frag"])), flush=True)
    finally:
        if not args.checkpoint and os.path.isdir(ckpt):
            shutil.rmtree(ckpt, ignore_errors=True)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
