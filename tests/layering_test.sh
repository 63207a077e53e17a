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
# Inside the Python packages, module by module (an import is resolved to what it names: `from ..core import graph`
# in python/fragments/local is fragments.core; a function-local import counts as any other):
#   python/fragments/core      _C core                           (what everything shares)
#   python/fragments/tracing   _C core tracing                   (the one recorder)
#   python/fragments/local     _C core tracing local             (fragments.load: this process's ranks)
#   python/fragments/session   _C core tracing local session     (LanguageModel: its ranks run local's traces)
#   python/fragments/vllm      _C core tracing vllm              (inside vLLM's processes)
#   (python/fragments/*.py: the package's top, which imports them all; every subpackage must have a rule)
#   fragkit/checkpoint         views < sources < families; files; pt2 (sources files) < stream < plan; the
#                              package's __init__ and __main__ on top (every module must have a rule)
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
# The Python packages' own layers (the comment at the top), module by module.
declare -A PY_LAYERS=(
  [python/fragments/core]='_C|core'
  [python/fragments/tracing]='_C|core|tracing'
  [python/fragments/local]='_C|core|tracing|local'
  [python/fragments/session]='_C|core|tracing|local|session'
  [python/fragments/vllm]='_C|core|tracing|vllm'
  [fragkit/checkpoint/views]='-'
  [fragkit/checkpoint/sources]='views'
  [fragkit/checkpoint/families]='views|sources'
  [fragkit/checkpoint/files]='-'
  [fragkit/checkpoint/pt2]='sources|files'
  [fragkit/checkpoint/stream]='views|sources|families|files|pt2'
  [fragkit/checkpoint/plan]='sources|families|files|stream'
)
# python_violations ROOT UNIT: the imports of UNIT (a subpackage of fragments, or one module of fragkit/checkpoint)
# that name a part of its package outside PY_LAYERS[UNIT]; prints "file:line: statement" for each.
python_violations() {
  local tree=$1 unit=$2 root files file package line stmt dots rest name base target part k
  case "$unit" in
    python/fragments/*) root=fragments; files=$(cd "$tree" && find "$unit" -name '*.py' 2> /dev/null | sort) ;;
    *) root=${unit%/*}; root=${root//\//.}; files=$unit.py ;;
  esac
  for file in $files; do
    [ -f "$tree/$file" ] || continue
    package=$(dirname "${file#python/}"); package=${package//\//.}
    while IFS= read -r line; do
      stmt=$(sed -E 's/^[0-9]+:[[:space:]]*//' <<< "$line")
      if [[ $stmt =~ ^from[[:space:]]+(\.+)([A-Za-z0-9_.]*)[[:space:]]+import[[:space:]]+\(?[[:space:]]*([A-Za-z0-9_]+) ]]; then
        dots=${BASH_REMATCH[1]} rest=${BASH_REMATCH[2]} name=${BASH_REMATCH[3]} base=$package
        for ((k = 1; k < ${#dots}; k++)); do base=${base%.*}; done
        target=$base.${rest:-$name}
      elif [[ $stmt =~ ^(from|import)[[:space:]]+(fragments|fragkit)([A-Za-z0-9_.]*) ]]; then
        target=${BASH_REMATCH[2]}${BASH_REMATCH[3]}
      else
        continue
      fi
      [[ $target == "$root" || $target == "$root".* ]] || continue  # outside the package: the folder rules'
      part=${target#"$root"}; part=${part#.}; part=${part%%.*}
      [[ $part =~ ^(${PY_LAYERS[$unit]})$ ]] || echo "$file:${line%%:*}: $stmt"
    done < <(awk '{ quotes = gsub(/"""/, "&") }  # import lines outside docstrings, numbered
                  !inside && /^[[:space:]]*(from|import)[[:space:]]+(\.|fragments([.[:space:]]|$)|fragkit([.[:space:]]|$))/ {
                    print NR ":" $0 }
                  quotes % 2 == 1 { inside = !inside }' "$tree/$file")
  done
}
for unit in $(printf '%s\n' "${!PY_LAYERS[@]}" | sort); do
  checks=$((checks + 1))
  bad=$(python_violations "$root" "$unit")
  if [ -n "$bad" ]; then
    echo "FAIL: $unit may import only (${PY_LAYERS[$unit]/#-/nothing}) of its package:"
    echo "$bad"; status=1; failures=$((failures + 1))
  else
    echo "ok: $unit imports only (${PY_LAYERS[$unit]/#-/nothing}) of its package"
  fi
done
# A new subpackage of fragments, or a new module of fragkit/checkpoint, must be given its rule above.
checks=$((checks + 1))
unruled=$(cd "$root" && { for d in python/fragments/*/; do
    d=${d%/}; [ -n "$(find "$d" -name '*.py' -print -quit)" ] && echo "$d"; done
  for f in fragkit/checkpoint/*.py; do f=${f%.py}; case "$f" in */__init__|*/__main__) ;; *) echo "$f" ;; esac; done
} | while read -r unit; do [ -n "${PY_LAYERS[$unit]+x}" ] || echo "$unit"; done)
if [ -n "$unruled" ]; then
  echo "FAIL: Python packages or modules with no rule here: $unruled"; status=1; failures=$((failures + 1))
else
  echo "ok: every subpackage of fragments and module of fragkit/checkpoint has a rule"
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
# plant_python UNIT FILE LINE: FILE (under UNIT's folder) holding LINE; the Python layers' check must report it
plant_python() {
  checks=$((checks + 1))
  mkdir -p "$probe/$(dirname "$2")"
  printf '%s\n' "$3" > "$probe/$2"
  if [ -n "$(python_violations "$probe" "$1")" ]; then
    echo "ok: a planted $2 -> '${3#"${3%%[! ]*}"}' is seen"
  else
    echo "FAIL: the check does not see a planted $2 -> '$3'"; status=1; failures=$((failures + 1))
  fi
  rm -f "$probe/$2"
}
plant_python python/fragments/core python/fragments/core/planted.py 'from ..tracing import proxy'
plant_python python/fragments/core python/fragments/core/planted.py '    from .. import local  # function-local'
plant_python python/fragments/tracing python/fragments/tracing/planted.py 'from ..local.run import Prepared'
plant_python python/fragments/local python/fragments/local/planted.py 'from ..session import channel'
plant_python python/fragments/vllm python/fragments/vllm/planted.py 'from ..local.run import Prepared'
plant_python python/fragments/session python/fragments/session/planted.py 'import fragments.vllm'
plant_python python/fragments/session python/fragments/session/planted.py 'from fragments import LanguageModel'
plant_python fragkit/checkpoint/pt2 fragkit/checkpoint/pt2.py 'from .stream import FileSink'
plant_python fragkit/checkpoint/sources fragkit/checkpoint/sources.py '    from . import DTYPES'
# GoogleTest's summary lines, which tools/summarize_tests.py counts.
echo "[  PASSED  ] $((checks - failures)) tests."
[ $failures -eq 0 ] || echo "[  FAILED  ] $failures tests, listed above"
exit $status
