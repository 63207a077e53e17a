#!/usr/bin/env bash
# The project's Python (see tools/install_deps.sh): prints the venv folder with --venv, else its python.
#   py=$(bash tools/python_env.sh)        # e.g. /root/.cache/fragments/venv/bin/python
venv=${FRAG_VENV:-$HOME/.cache/fragments/venv}
if [ "${1:-}" = --venv ]; then echo "$venv"; else echo "$venv/bin/python"; fi
