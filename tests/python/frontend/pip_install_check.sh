#!/usr/bin/env bash
# The user's path, checked apart from CI (it compiles the whole C++ library again: ~1 h at -j1 here):
# `pip install --no-build-isolation .` into a scratch folder with the project's Python, then the installed
# package (not python/ of the checkout) imports, runs a world-2 trace on an export and its `frag` script
# inspects it. Prints the install's wall time.
#   bash tests/python/frontend/pip_install_check.sh [EXPORT_DIR_WITH_TP2]   (default bazel-bin/tests/models/llama_tp2)
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$root"
PY=$(bash tools/python_env.sh)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1}
models=${1:-$root/bazel-bin/tests/models/llama_tp2}
[ -f "$models/rank0.pt" ] || { echo "FAIL: no export at $models (bazel build //tests/models:llama_tp2)"; exit 1; }
target=$(mktemp -d)
trap 'rm -rf "$target"' EXIT
start=$(date +%s)
"$PY" -m pip install --no-build-isolation --no-deps --target "$target" . 2>&1 | tail -3
echo "pip install: $(( $(date +%s) - start )) s"
cd "$target"  # away from the checkout: python/fragments must not shadow the installed package
# A file, not stdin: launch's spawned ranks import the script's main module.
cat > check.py <<'PYEOF'
import os, sys, fragments
assert os.path.dirname(fragments.__file__) == os.path.join(os.environ["PYTHONPATH"], "fragments"), fragments.__file__
print("fragments from", fragments.__file__)
def work(rank, models):
    m = fragments.load(models + "/rank{rank}.pt")
    with m.trace([[1, 2, 3, 4]]):
        h = m.model.layers[0].mlp.down_proj.input.save()
        out = m.output.save()
    return tuple(h.shape), tuple(out.shape)
if __name__ == "__main__":
    print("world 2:", fragments.launch(work, world=2, args=(sys.argv[1],)))
PYEOF
PYTHONPATH="$target" "$PY" check.py "$models"
PYTHONPATH="$target" "$target/bin/frag" inspect "$models/rank0.pt" | head -3
echo "pip install check: ok"
