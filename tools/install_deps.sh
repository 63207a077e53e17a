#!/usr/bin/env bash
# Installs everything fragments needs on a fresh Debian 12 machine (as root, or with sudo).
set -euo pipefail
packages=(
  bazel-bootstrap cmake ninja-build g++ git
  libtorch-dev python3-torch python3-numpy
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
