#!/usr/bin/env bash
# The layers the tree shows, enforced: each folder includes only the folders below it.
#   ir/       nothing of ours but ir/
#   passes/   ir/            (graph rewriting; no collectives)
#   runtime/  ir/            (executes prepared programs; never rewrites graphs)
#   program/  ir/ passes/ runtime/
# Bazel enforces runtime/ -> passes/ too (passes/BUILD's visibility); this also
# covers the CMake build and headers that Bazel would only see when compiled.
set -uo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root" || exit 1
status=0
checks=0
failures=0
check() {
  checks=$((checks + 1))
  local folder=$1 allowed=$2
  [ -d "$folder" ] || { echo "FAIL: no folder $folder under $root"; status=1; return; }
  local bad
  bad=$(grep -RnE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"(ir|passes|runtime|program|tools)/' "$folder" \
        --include='*.h' --include='*.cpp' | grep -vE "#[[:space:]]*include[[:space:]]+\"($allowed)/")
  if [ -n "$bad" ]; then
    echo "FAIL: $folder/ may include only $allowed/:"; echo "$bad"; status=1; failures=$((failures + 1))
  else
    echo "ok: $folder/ includes only $allowed/ ($(grep -RlE '#include' "$folder" --include='*.h' --include='*.cpp' | wc -l) files)"
  fi
}
check ir 'ir'
check passes 'ir|passes'
check runtime 'ir|runtime'
check program 'ir|passes|runtime|program'
# The checker must catch a violation: a runtime file including a pass is refused.
probe=$(mktemp -d)
mkdir -p "$probe/runtime"
echo '#include "passes/insert_fragment_ops.h"' > "$probe/runtime/bad.cpp"
if (cd "$probe" && grep -RnE '#include "(passes|program)/' runtime >/dev/null); then
  echo "ok: a planted runtime -> passes include is seen"
else
  echo "FAIL: the include check does not see a planted violation"; status=1; failures=$((failures + 1))
fi
checks=$((checks + 1))
rm -rf "$probe"
# GoogleTest's summary lines, which tools/summarize_tests.py counts.
echo "[  PASSED  ] $((checks - failures)) tests."
[ $failures -eq 0 ] || echo "[  FAILED  ] $failures tests, listed above"
exit $status
