#!/bin/bash
# Issue 30 on one H200: a Llama-3-8B-shaped bf16 rank file (tp 1, ~16 GB) loaded onto the GPU and a forward
# run; its load time against a plain read of the file, measured in the same run.
#
#   tools/device/import_load_benchmark.sh            # from the repository root on the GPU machine
#
# 1. python3 -m fragkit.synthetic --like llama3-8b (bf16, ~16 GB) and python3 -m fragkit.checkpoint --tp 1
#    (the streaming import; needs the safetensors package in the machine's Python) into $WORK.
# 2. The rank file is dropped from the page cache (posix_fadvise), then read once with `cat > /dev/null`
#    (the peer), dropped again, then torch.jit.load(map_location="cuda") and a forward of 1 x 16 tokens;
#    both cold, then both again warm. Prints one JSON line; with $OUT set, also $OUT/import_load.json.
#    Item 5 (no second copy): the process's peak resident memory before and after each load
#    ("host_peak_before_gb", "host_peak_after_gb"): LibTorch's unpickler reads each record into host memory
#    and moves it to the GPU before the next, so the growth should be about the largest record (the
#    embedding, ~1 GB), not the file (~16 GB).
# 3. With FRAG=path/to/frag (a CUDA build): `frag run --device cuda` of the same file under /usr/bin/time;
#    its peak resident memory ("frag_cuda_maxrss_gb") against the file's size.
# Disk: ~33 GB in $WORK (default /tmp/fragkit-load-bench), removed at the end.
set -euo pipefail
PY=${FRAG_PYTHON:-python3}
WORK=${WORK:-/tmp/fragkit-load-bench}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1
"$PY" -c "import safetensors" 2>/dev/null || { echo "import_load_benchmark: the safetensors package is missing" >&2; exit 2; }
rm -rf "$WORK"; mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT
t0=$(date +%s)
"$PY" -m fragkit.synthetic --like llama3-8b --out "$WORK/ckpt" --quiet > /dev/null
t1=$(date +%s)
"$PY" -m fragkit.checkpoint --from "$WORK/ckpt" --tp 1 --out "$WORK/tp1" --quiet > /dev/null
t2=$(date +%s)
rm -rf "$WORK/ckpt"
echo "synthetic $((t1 - t0)) s, import $((t2 - t1)) s" >&2
"$PY" - "$WORK/tp1/rank0.pt" <<'EOF'
import json, os, subprocess, sys, time
import torch
import fragkit  # noqa: F401  (registers the kit's collectives for the forward)

path = sys.argv[1]

def drop():
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)

import resource

def peak_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9

torch.zeros(1, device="cuda")  # the CUDA context, before the peak is read
rows = {}
for state in ("cold", "warm"):
    before = peak_gb()
    if state == "cold":
        os.sync(); drop()
    t = time.time(); subprocess.run("cat %s > /dev/null" % path, shell=True, check=True); read_s = time.time() - t
    if state == "cold":
        drop()
    torch.cuda.synchronize(); t = time.time()
    module = torch.jit.load(path, map_location="cuda")
    torch.cuda.synchronize(); load_s = time.time() - t
    ids = torch.arange(16, device="cuda").reshape(1, 16) * 997 % 128000
    with torch.no_grad():
        t = time.time(); logits = module(ids); torch.cuda.synchronize(); forward_s = time.time() - t
    rows[state] = {"read_s": read_s, "load_s": load_s, "load_over_read": load_s / read_s, "forward_s": forward_s,
                   "logits": list(logits.shape), "finite": bool(torch.isfinite(logits.float()).all()),
                   "gpu_gb": torch.cuda.max_memory_allocated() / 1e9,
                   "host_peak_before_gb": before, "host_peak_after_gb": peak_gb()}
    del module, logits
    torch.cuda.empty_cache()
result = {"file_gb": os.path.getsize(path) / 1e9, "device": torch.cuda.get_device_name(), **rows}
print(json.dumps(result))
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "import_load.json"), "w") as f:
        json.dump(result, f, indent=1)
EOF
if [ -n "${FRAG:-}" ]; then
  echo "1 5 9 3 7 2 11 13" > "$WORK/ids.txt"
  /usr/bin/time -f "%M" -o "$WORK/rss.txt" "$FRAG" run "$WORK/tp1/rank{rank}.pt" --world 1 --device cuda \
    --input "$WORK/ids.txt" --out "$WORK/logits.safetensors" > /dev/null
  echo "{\"frag_cuda_maxrss_gb\": $(awk '{printf "%.2f", $1 * 1024 / 1e9}' "$WORK/rss.txt"), \"file_gb\": $(stat -c %s "$WORK/tp1/rank0.pt" | awk '{printf "%.2f", $1 / 1e9}')}"
fi
