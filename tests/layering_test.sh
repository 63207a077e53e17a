#!/usr/bin/env bash
# The layers the tree shows, enforced: each folder includes (C++) and imports (Python) only what lies below it.
#   ir/        nothing of ours but ir/
#   passes/    ir/            (graph rewriting; no collectives)
#   runtime/   ir/            (executes prepared programs; never rewrites graphs)
#   program/   ir/ passes/ runtime/        (the C++ API)
#   python/    ir/ passes/ runtime/ program/; imports fragments, never fragkit (the Python front end, beside
#              program/: never the CLI in cli/)
#   cli/       ir/ passes/ runtime/ program/ cli/          (the frag command line)
#   fragkit/   no C++; imports fragkit, never fragments      (the export kit: plain PyTorch, no extension)
#   examples/  program/ and ir/ (the C++ API a user sees); imports fragments and fragkit
#   bench/     any layer, cli/ and bench/; imports both      (benchmarks: on top; never tests/)
#   tools/     any layer and cli/; imports both               (the project's scripts; never tests/)
#   tests/     anything
# Every top-level folder holding C++ or Python must be in this list (third_party/ is not ours).
# Bazel enforces runtime/ -> passes/ too (passes/BUILD's visibility); this also
# covers the CMake build and headers that Bazel would only see when compiled.
set -uo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
status=0
checks=0
failures=0
ours='ir|passes|runtime|program|python|cli|fragkit|bench|examples|tools|tests'
# violations ROOT FOLDER: prints FOLDER's includes of our folders outside ALLOWED[FOLDER] (a regex of names)
# and its imports of our Python packages outside IMPORTS[FOLDER].
violations() {
  local tree=$1 folder=$2
  (cd "$tree" && grep -RnE "^[[:space:]]*#[[:space:]]*include[[:space:]]+\"($ours)/" \
                     "$folder" --include='*.h' --include='*.cpp' --include='*.cc' |
                grep -vE "#[[:space:]]*include[[:space:]]+\"(${ALLOWED[$folder]})/")
  (cd "$tree" && grep -RnE '^[[:space:]]*(import|from)[[:space:]]+(fragments|fragkit)([.[:space:]]|$)' \
                     "$folder" --include='*.py' |
                grep -vE ":[[:space:]]*(import|from)[[:space:]]+(${IMPORTS[$folder]})([.[:space:]]|$)")
}
declare -A ALLOWED=(
  [ir]='ir'
  [passes]='ir|passes'
  [runtime]='ir|runtime'
  [program]='ir|passes|runtime|program'
  [python]='ir|passes|runtime|program'
  [cli]='ir|passes|runtime|program|cli'
  [fragkit]='-'
  [examples]='ir|program'
  [bench]='ir|passes|runtime|program|cli|bench'
  [tools]='ir|passes|runtime|program|cli'
  [tests]="$ours"
)
declare -A IMPORTS=(
  [ir]='-' [passes]='-' [runtime]='-' [program]='-' [cli]='-'
  [python]='fragments'
  [fragkit]='fragkit'
  [examples]='fragments|fragkit'
  [bench]='fragments|fragkit'
  [tools]='fragments|fragkit'
  [tests]='fragments|fragkit'
)
for folder in ir passes runtime program python cli fragkit examples bench tools tests; do
  checks=$((checks + 1))
  if [ ! -d "$root/$folder" ]; then
    echo "FAIL: no folder $folder under $root"; status=1; failures=$((failures + 1)); continue
  fi
  bad=$(violations "$root" "$folder")
  if [ -n "$bad" ]; then
    echo "FAIL: $folder/ may include only (${ALLOWED[$folder]})/ and import only ${IMPORTS[$folder]/#-/nothing}:"
    echo "$bad"; status=1; failures=$((failures + 1))
  else
    echo "ok: $folder/ includes only (${ALLOWED[$folder]/#-/nothing})/, imports ${IMPORTS[$folder]/#-/nothing}" \
         "($(cd "$root" && find "$folder" -name '*.h' -o -name '*.cpp' -o -name '*.py' | wc -l) files)"
  fi
done
# A new top-level folder with sources must be given its rule above.
checks=$((checks + 1))
unruled=$(cd "$root" && for d in */; do
  d=${d%/}
  case "$d" in third_party|bazel-*|build|external) continue ;; esac
  [ -n "${ALLOWED[$d]+x}" ] && continue
  [ -n "$(find -L "$d" \( -name '*.h' -o -name '*.cpp' -o -name '*.py' \) -print -quit 2> /dev/null)" ] && echo "$d"
done)
if [ -n "$unruled" ]; then
  echo "FAIL: top-level folders with sources but no rule here: $unruled"; status=1; failures=$((failures + 1))
else
  echo "ok: every top-level folder with sources has a rule"
fi
# The check must catch a violation: planted wrong includes and imports, one per rule that matters most, go
# through the same function as the tree above.
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
plant() {  # plant FOLDER FILE LINE: FILE in FOLDER holding LINE; the check must report it
  checks=$((checks + 1))
  mkdir -p "$probe/$1"
  echo "$3" > "$probe/$1/$2"
  if [ -n "$(violations "$probe" "$1")" ]; then
    echo "ok: a planted $1/ -> '$3' is seen"
  else
    echo "FAIL: the check does not see a planted $1/ -> '$3'"; status=1; failures=$((failures + 1))
  fi
  rm -f "$probe/$1/$2"
}
plant runtime planted.cpp '#include "passes/insert_fragment_ops.h"'
plant passes planted.cpp '#include "runtime/communicator.h"'
plant python planted.cpp '#include "cli/fragment_commands.h"'
plant cli planted.cpp '#include "tests/support/test_support.h"'
plant bench planted.h '#include "tests/support/test_support.h"'
plant python planted.py 'from fragkit import models'
plant fragkit planted.py 'import fragments'
# GoogleTest's summary lines, which tools/summarize_tests.py counts.
echo "[  PASSED  ] $((checks - failures)) tests."
[ $failures -eq 0 ] || echo "[  FAILED  ] $failures tests, listed above"
exit $status
