#!/bin/sh
# Runs a Python test of this folder ($2) with the project's Python (Bazel passes @torch//:python as $1)
# from the runfiles root, where python/fragments (with _C.so) and the files it reads are.
set -e
PYTHON=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
cd "$(dirname "$0")/../.."
export PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=python
exec "$PYTHON" "tests/runtime/$2" .
