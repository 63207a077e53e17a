#!/bin/sh
# Runs Python tests with the project's Python (Bazel passes @torch//:python as $1): the unittest files
# named after it, or else every test_*.py under tests/python.
set -e
PYTHON=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
cd "$(dirname "$0")/../.."
# python/: the fragments package (with its _C) where a target has //python/fragments in its data.
export PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=.:tests/python:python HF_HUB_OFFLINE=1
if [ $# -eq 0 ]; then
  exec "$PYTHON" -m unittest discover -s tests/python -t tests/python
fi
for test in "$@"; do
  "$PYTHON" "tests/python/$test"
done
