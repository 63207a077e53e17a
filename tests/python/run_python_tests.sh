#!/bin/sh
# Runs the export kit's Python tests with Debian's Python (the one that has torch).
set -e
PYTHON=${FRAG_PYTHON:-/usr/bin/python3}
cd "$(dirname "$0")/../.."
PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=tools:tests/python exec "$PYTHON" -m unittest discover -s tests/python -t tests/python
