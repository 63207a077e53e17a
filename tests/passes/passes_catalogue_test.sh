#!/bin/sh
# Runs passes_catalogue_test.py with the project's Python (Bazel passes @torch//:python as $1; the test
# itself needs the standard library only).
set -e
exec "$1" "$2" --generator "$3" --pt "$4" --pt2 "$5"
