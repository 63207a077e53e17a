#!/bin/sh
# Runs the export kit's Python tests with the project's Python (Bazel passes @torch//:python as $1).
set -e
PYTHON=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
cd "$(dirname "$0")/../.."
PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=tools:tests/python exec "$PYTHON" -m unittest discover -s tests/python -t tests/python
