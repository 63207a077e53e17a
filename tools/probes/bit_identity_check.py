"""Two builds of frag, same rank files, same plans: their --out files compared byte for byte.

    python3 tools/probes/bit_identity_check.py OLD_FRAG NEW_FRAG MODELS_DIR [NEW_MODELS_DIR] [CASE...]
                                                                              (run in a scratch folder)

OLD_FRAG: frag built from an earlier commit (e.g. a worktree at it: bazel build //tools:frag, or //cli:frag
after the tree move); NEW_FRAG: bazel-bin/cli/frag; MODELS_DIR: bazel-bin/tests/models of a checkout that
built //... ; NEW_MODELS_DIR (default MODELS_DIR): the rank files NEW_FRAG runs, e.g. another checkout's
tests/models to check that a change to the import (issue 30: the tied head and the rotary table stored once)
leaves frag's outputs as they were (then OLD_FRAG and NEW_FRAG may be one binary). CASE: only these cases.
Each case saves up to 30 fragmented and 10 whole locations and scales one MLP output, for a
forward and for --generate 3. Issue 26's refactor was checked with it (every case IDENTICAL)."""
import filecmp
import json
import os
import subprocess
import sys

OLD, NEW, M = sys.argv[1:4]
M_NEW = sys.argv[4] if len(sys.argv) > 4 else M
ONLY = set(sys.argv[5:])
with open("ids.txt", "w") as f:
    f.write("1 5 9 3 7 2\n")
cases = [("llama_tp2", 2, "pt"), ("llama_tp2_pt2", 2, "pt2"), ("moe_tp2", 2, "pt"), ("moe_ep_tp2", 2, "pt"),
         ("moe_tp2_pt2", 2, "pt2"), ("llama_kv2_tp4", 4, "pt"), ("smollm2_tp3", 3, "pt")]
ok = True
for name, world, ext in cases:
    if ONLY and name not in ONLY:
        continue
    d = f"{M}/{name}"
    files = sorted(f for f in os.listdir(d) if f.endswith("." + ext))
    first = f"{d}/{files[0]}"
    info = json.loads(subprocess.run([NEW, "inspect", "--json", "--all", first], capture_output=True, text=True, check=True).stdout)
    frag = [l["location"] for l in info["fragmented"]]
    whole = [l if isinstance(l, str) else l.get("location") for l in info["whole"]]
    locs = frag[:30] + whole[:10]
    if not locs:
        print(name, "keys", list(info.keys())); ok = False; continue
    steps = []
    for i, loc in enumerate(locs[:40]):
        steps.append({"at": loc, "do": "save", "as": f"s{i}"})
    frag_locs = [l for l in locs if "mlp" in l and l.endswith(".output")]
    if frag_locs:
        steps.append({"at": frag_locs[0], "do": "scale", "by": 0.5})
    with open(f"plan_{name}.json", "w") as f:
        json.dump({"interventions": steps}, f)
    for mode, extra in (("fwd", []), ("gen", ["--generate", "3"])):
        outs = []
        for tag, binary, models in (("old", OLD, M), ("new", NEW, M_NEW)):
            pattern = f"{models}/{name}/rank{{rank}}.{ext}"
            out = f"{name}_{mode}_{tag}.safetensors"
            if os.path.exists(out): os.remove(out)
            r = subprocess.run([binary, "run", pattern, "--world", str(world), "--input", "ids.txt",
                                "--plan", f"plan_{name}.json", "--out", out] + extra, capture_output=True, text=True)
            if r.returncode != 0:
                print(name, mode, tag, "FAILED", r.stderr[-400:]); ok = False
            outs.append(out)
        same = all(os.path.exists(o) for o in outs) and filecmp.cmp(outs[0], outs[1], shallow=False)
        print(f"{name:16s} {mode}: {len(steps)} steps, {'IDENTICAL' if same else 'DIFFERENT'}")
        ok &= same
print("ALL IDENTICAL" if ok else "NOT ALL IDENTICAL")
sys.exit(0 if ok else 1)
