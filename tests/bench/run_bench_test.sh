#!/bin/sh
# Runs a Python test of this folder ($2) with the project's Python (Bazel passes @torch//:python as $1) from
# the runfiles root, where bench/ and tests/models are.
set -e
PYTHON=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
cd "$(dirname "$0")/../.."
export PYTHONDONTWRITEBYTECODE=1
exec "$PYTHON" "tests/bench/$2"
