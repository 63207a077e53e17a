#!/bin/sh
# Runs frontend_test.py with the project's Python (Bazel passes @torch//:python as $1) from the runfiles
# root, where python/fragments (with _C.so), tools/frag and tests/models are.
set -e
PYTHON=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
cd "$(dirname "$0")/../../.."
export PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=python:tools
exec "$PYTHON" tests/python/frontend/frontend_test.py
