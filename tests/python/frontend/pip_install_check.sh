#!/usr/bin/env bash
# The user's path, checked apart from CI (it compiles the whole C++ library again: ~1 h at -j1 here):
# `pip install --no-build-isolation .` into a scratch folder with the project's Python, then the installed
# package (not python/ of the checkout) imports, runs a world-2 trace on an export and its `frag` script
# inspects it. Prints the install's wall time.
#   bash tests/python/frontend/pip_install_check.sh [EXPORT_DIR]   (default bazel-bin/tests/models/llama_tp2)
# Environment: FRAG_PYTHON (default the project's venv), FRAG_CHECK_WORLD (2; the export's tp),
# FRAG_CHECK_BACKEND (gloo; nccl on a GPU machine), FRAG_PIP_ARGS (more pip arguments, e.g. on a machine
# without network: --no-index --config-settings=cmake.define.FRAG_DEPS_DIR=$PWD/.deps).
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$root"
PY=${FRAG_PYTHON:-$(bash tools/python_env.sh)}
world=${FRAG_CHECK_WORLD:-2}
backend=${FRAG_CHECK_BACKEND:-gloo}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1}
models=${1:-$root/bazel-bin/tests/models/llama_tp2}
[ -f "$models/rank0.pt" ] || { echo "FAIL: no export at $models (bazel build //tests/models:llama_tp2)"; exit 1; }
target=$(mktemp -d)
trap 'rm -rf "$target"' EXIT
start=$(date +%s)
# shellcheck disable=SC2086
"$PY" -m pip install --no-build-isolation --no-deps --target "$target" ${FRAG_PIP_ARGS:-} . 2>&1 | tail -3
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
    world, backend = int(sys.argv[2]), sys.argv[3]
    print(f"world {world} ({backend}):", fragments.launch(work, world=world, backend=backend, args=(sys.argv[1],)))
PYEOF
PYTHONPATH="$target" "$PY" check.py "$models" "$world" "$backend"
PYTHONPATH="$target" "$target/bin/frag" inspect "$models/rank0.pt" | head -3
echo "pip install check: ok"
