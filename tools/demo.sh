#!/usr/bin/env bash
# The main job on the shipped default: installs what is needed, builds frag, exports the tiny reference
# Llama at tp=1 and tp=2, rewrites the tp=2 files, runs a plan that saves whole activations and steers
# the model, and shows that the sharded run agrees with the unsharded one.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/bin:$PATH
bash tools/install_deps.sh
bazel build //tools:frag 2>&1 | grep -v -E 'linux-sandbox|^ *(exec env|PATH=|PWD=|TMPDIR=)' | tail -3
frag=bazel-bin/tools/frag
work=build/demo
rm -rf "$work" && mkdir -p "$work/rewritten"

echo "== export the tiny Llama at tp=1 and tp=2 (Python kit, same weights)"
PYTHONPATH=tools python3 tools/export_model.py --model llama --tp 1 --out "$work/tp1"
PYTHONPATH=tools python3 tools/export_model.py --model llama --tp 2 --out "$work/tp2"

echo "== which locations are fragmented at tp=2"
$frag inspect "$work"/tp2/rank0.pt "$work"/tp2/rank1.pt | head -16

echo "== rewrite the tp=2 files"
$frag rewrite "$work"/tp2/rank0.pt "$work"/tp2/rank1.pt -o "$work/rewritten"

echo "== a plan: save whole activations (fragmented ones too) and steer layer 1"
printf '1 2 3 4 5 6 7 8\n42 17 999 3 64 65 500 7\n' > "$work/ids.txt"
PYTHONPATH=tools python3 - "$work/steer.safetensors" <<'PY'
import sys, torch
from fragkit.safetensors_io import save_file
torch.manual_seed(0)
save_file({"v": torch.randn(64) * 2.0}, sys.argv[1])
PY
cat > "$work/plan.json" <<'JSON'
{"interventions": [
  {"at": "model.layers.0.self_attn.qkv_proj.output", "do": "save", "as": "qkv0"},
  {"at": "model.layers.0.mlp.down_proj.input", "do": "save", "as": "mlp_act0"},
  {"at": "model.layers.1.output", "do": "save", "as": "resid1"},
  {"at": "model.layers.0.output", "do": "add", "value": "steer.safetensors:v"},
  {"at": "model.layers.0.output", "do": "call", "modules": ["model.norm", "lm_head"], "as": "lens0"}
]}
JSON
$frag run "$work"/tp1/rank0.pt --input "$work/ids.txt" --plan "$work/plan.json" --out "$work/tp1.safetensors"
$frag run --world 2 "$work"/rewritten/rank0.pt "$work"/rewritten/rank1.pt --input "$work/ids.txt" \
  --plan "$work/plan.json" --out "$work/tp2.safetensors"
$frag run --world 2 "$work"/rewritten/rank0.pt "$work"/rewritten/rank1.pt --input "$work/ids.txt" \
  --out "$work/tp2_plain.safetensors"

echo "== tp=2 vs tp=1 (the unsharded model is the ground truth)"
PYTHONPATH=tools python3 - "$work" <<'PY'
import sys
from fragkit.safetensors_io import load_file
work = sys.argv[1]
a, b = load_file(work + "/tp1.safetensors"), load_file(work + "/tp2.safetensors")
plain = load_file(work + "/tp2_plain.safetensors")
worst = 0.0
for name in sorted(a):
    diff = (a[name] - b[name]).abs().max().item()
    worst = max(worst, diff)
    print("  %-8s shape %-16s max |tp2 - tp1| = %.2e" % (name, list(b[name].shape), diff))
steer = (b["logits"] - plain["logits"]).abs().max().item()
print("  steering moved the tp=2 logits by up to %.3f" % steer)
ok = worst < 1e-4 and steer > 1e-2
print("tp=2 agrees with tp=1: %s" % ("yes" if ok else "NO"))
sys.exit(0 if ok else 1)
PY
