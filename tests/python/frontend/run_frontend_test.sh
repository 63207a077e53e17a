#!/bin/sh
# Runs a test of this folder (frontend_test.py unless named after the Python) with the project's Python
# (Bazel passes @torch//:python as $1) from the runfiles root, where python/fragments (with _C.so),
# cli/frag, examples/ and tests/models are.
set -e
PYTHON=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
TEST=${2:-frontend_test.py}
cd "$(dirname "$0")/../../.."
export PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=python:.
exec "$PYTHON" "tests/python/frontend/$TEST"
