#!/usr/bin/env bash
# clang-tidy over ir/ passes/ runtime/ program/ cli/ with the checks of .clang-tidy.
# Needs a compile_commands.json: CMake exports one at configure time (no build), with the flags of
# tools/test_all.sh. Usage: bash tools/clang_tidy.sh [FILES...]   (default: every .cpp of those folders)
# Prints each finding and a count; exits 1 if there are findings, 0 if clean.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${FRAG_PYTHON:-$HOME/.cache/fragments/venv/bin/python}
build=build/tidy
if [ ! -f "$build/compile_commands.json" ]; then
  mkdir -p "$build"
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
    -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
    -DPython3_EXECUTABLE="$PY" > "$build/configure.log" 2>&1 \
    || { echo "cmake configure failed (log: $build/configure.log)"; tail -20 "$build/configure.log"; exit 2; }
fi
if [ $# -gt 0 ]; then files=("$@"); else
  mapfile -t files < <(ls ir/*.cpp passes/*.cpp runtime/*.cpp program/*.cpp cli/*.cpp 2> /dev/null)
fi
tidy=${CLANG_TIDY:-clang-tidy}
log=$build/clang_tidy.log
: > "$log"
for f in "${files[@]}"; do
  # Headers are named by absolute path: the filter is anchored at this checkout (LibTorch has an ir/ too).
  "$tidy" -p "$build" --quiet --header-filter="^$PWD/(ir|passes|runtime|program|cli)/" "$f" >> "$log" 2> /dev/null
done
findings=$(grep -cE '^[^ ].*:[0-9]+:[0-9]+: (warning|error):' "$log")
grep -E '^[^ ].*:[0-9]+:[0-9]+: (warning|error):' "$log" | sed "s|^$PWD/||"
echo "clang-tidy: ${#files[@]} files, $findings findings (full output: $log)"
grep -oE '\[[a-z-]+(\.[A-Za-z]+)?(,[a-z-]+)*\]$' "$log" | sort | uniq -c | sort -rn
[ "$findings" -eq 0 ]
