#!/usr/bin/env bash
# The layers the tree shows, enforced: each folder includes only the folders below it.
#   ir/       nothing of ours but ir/
#   passes/   ir/            (graph rewriting; no collectives)
#   runtime/  ir/            (executes prepared programs; never rewrites graphs)
#   program/  ir/ passes/ runtime/        (the C++ API)
#   python/   ir/ passes/ runtime/ program/   (the Python front end, beside program/: never the CLI in tools/)
#   tools/    any layer, and tools/       (the CLI, benchmarks, examples: on top; never tests/)
# Bazel enforces runtime/ -> passes/ too (passes/BUILD's visibility); this also
# covers the CMake build and headers that Bazel would only see when compiled.
set -uo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
status=0
checks=0
failures=0
# violations ROOT FOLDER ALLOWED: prints FOLDER's includes of our folders outside ALLOWED (a regex of names).
violations() {
  local tree=$1 folder=$2 allowed=$3
  (cd "$tree" && grep -RnE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"(ir|passes|runtime|program|python|tools|tests)/' \
                     "$folder" --include='*.h' --include='*.cpp' --include='*.cc' |
                grep -vE "#[[:space:]]*include[[:space:]]+\"($allowed)/")
}
declare -A ALLOWED=(
  [ir]='ir'
  [passes]='ir|passes'
  [runtime]='ir|runtime'
  [program]='ir|passes|runtime|program'
  [python]='ir|passes|runtime|program'
  [tools]='ir|passes|runtime|program|tools'
)
for folder in ir passes runtime program python tools; do
  checks=$((checks + 1))
  allowed=${ALLOWED[$folder]}
  if [ ! -d "$root/$folder" ]; then
    echo "FAIL: no folder $folder under $root"; status=1; failures=$((failures + 1)); continue
  fi
  bad=$(violations "$root" "$folder" "$allowed")
  if [ -n "$bad" ]; then
    echo "FAIL: $folder/ may include only $allowed/:"; echo "$bad"; status=1; failures=$((failures + 1))
  else
    echo "ok: $folder/ includes only $allowed/ ($(cd "$root" && grep -RlE '#include' "$folder" --include='*.h' --include='*.cpp' | wc -l) files)"
  fi
done
# The check must catch a violation: planted wrong includes, one per rule that matters most, go through the
# same function as the tree above.
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
plant() {  # plant FOLDER INCLUDE: a file in FOLDER with the include; the check must report it
  checks=$((checks + 1))
  mkdir -p "$probe/$1"
  echo "#include \"$2\"" > "$probe/$1/planted.cpp"
  if [ -n "$(violations "$probe" "$1" "${ALLOWED[$1]}")" ]; then
    echo "ok: a planted $1/ -> $2 include is seen"
  else
    echo "FAIL: the include check does not see a planted $1/ -> $2 include"; status=1; failures=$((failures + 1))
  fi
  rm -f "$probe/$1/planted.cpp"
}
plant runtime passes/insert_fragment_ops.h
plant passes runtime/communicator.h
plant python tools/fragment_commands.h
plant tools tests/support/test_support.h
# GoogleTest's summary lines, which tools/summarize_tests.py counts.
echo "[  PASSED  ] $((checks - failures)) tests."
[ $failures -eq 0 ] || echo "[  FAILED  ] $failures tests, listed above"
exit $status
