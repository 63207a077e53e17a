#!/bin/sh
# Runs tests/function_length_test.py with the project's Python (Bazel passes @torch//:python as $1; it has
# lizard from tools/requirements.txt).
set -e
PYTHON=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
cd "$(dirname "$0")/.."
PYTHONDONTWRITEBYTECODE=1 exec "$PYTHON" tests/function_length_test.py
