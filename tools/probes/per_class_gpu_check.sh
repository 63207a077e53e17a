#!/usr/bin/env bash
# frag rewrite's per-class file on a GPU: frag run --device cuda of the rewritten file and of the plain
# export (rewritten at load, inlined), with a plan saving every location, an edit and a logit-lens call;
# every saved tensor must be bit-identical. Usage (device tool, after build_and_test.sh):
#   FRAG_BUILD_DIR=$HOME/fbuild bash tools/probes/per_class_gpu_check.sh llama_tp1 moe_tp1
set -euo pipefail
B="${FRAG_BUILD_DIR:-build/device}"; F="$B/cli/frag"; M="$B/tests/models"; PY="${FRAG_PYTHON:-python3}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
echo "1 5 9 13 2 7" > "$W/ids.txt"
for d in "$@"; do
  "$F" rewrite "$M/$d/rank0.pt" -o "$W/$d.pt" > /dev/null
  "$F" inspect --json "$M/$d/rank0.pt" > "$W/$d.json"
  "$PY" - "$W/$d.json" "$W/$d.plan.json" <<'PYEOF'
import json, sys
t = json.load(open(sys.argv[1]))
frag = [f['location'] for f in t['fragmented']]
iv = [{"at": l, "do": "save", "as": f"s{i}"} for i, l in enumerate(frag + t['whole'])]
out = [w for w in t['whole'] if w.endswith('layers.0.output')]
iv += [{"at": out[0], "do": "scale", "by": 0.5, "index": "...,3:40"},
       {"at": out[0], "do": "call", "modules": ["model.norm", "lm_head"], "as": "lens"}]
json.dump({"interventions": iv}, open(sys.argv[2], "w"))
PYEOF
  "$F" run "$M/$d/rank0.pt" --device cuda --input "$W/ids.txt" --plan "$W/$d.plan.json" --out "$W/$d.a.safetensors" > /dev/null
  "$F" run "$W/$d.pt" --device cuda --input "$W/ids.txt" --plan "$W/$d.plan.json" --out "$W/$d.b.safetensors" > /dev/null
  "$PY" - "$W/$d.a.safetensors" "$W/$d.b.safetensors" "$d" <<'PYEOF'
import sys, torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
assert a.keys() == b.keys(), set(a) ^ set(b)
bad = [k for k in a if not torch.equal(a[k], b[k])]
print(f"{sys.argv[3]} on cuda: {len(a)} tensors (every location, an edit, a lens call): "
      + ("per-class file == plain export, bit-identical" if not bad else "DIFFER: " + ", ".join(bad[:5])))
sys.exit(1 if bad else 0)
PYEOF
done
