#!/usr/bin/env bash
# Makes the PyTorch 2.x fixture of tests/fixtures/torch2 (run where torch 2.x is the python3):
# a one-layer tiny Llama exported at tp=1 and tp=2 by torch 2.x's TorchScript, and the logits torch 2.x
# itself computes with the tp=1 file for the ids in tests/fixtures/torch2/ids.txt.
# Usage: tools/device/make_torch2_fixture.sh OUT_FOLDER
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: make_torch2_fixture.sh OUT_FOLDER}
PY=${FRAG_PYTHON:-python3}
mkdir -p "$out"
PYTHONPATH=. $PY tools/export_model.py --model llama --tp 1 --layers 1 --seed 7 --out "$out/llama_tp1"
PYTHONPATH=. $PY tools/export_model.py --model llama --tp 2 --layers 1 --seed 7 --out "$out/llama_tp2"
PYTHONPATH=. $PY - "$out" <<'PY'
import sys, torch
import fragkit  # registers frag::all_reduce / all_gather for loading
from fragkit.safetensors_io import save_file
out = sys.argv[1]
ids = torch.tensor([[int(t) for t in line.split()] for line in open("tests/fixtures/torch2/ids.txt") if line.strip()])
model = torch.jit.load(out + "/llama_tp1/rank0.pt")
with torch.no_grad():
    logits = model(ids)
save_file({"logits": logits.contiguous()}, out + "/expected_logits.safetensors")
print("torch", torch.__version__, "logits", tuple(logits.shape))
PY
