#!/bin/sh
# Runs Python tests with the project's Python (Bazel passes @torch//:python as $1): the unittest files
# named after it, or else every test_*.py under tests/python.
set -e
# A network namespace of its own (loopback only) where the kernel allows one (root, as CI runs), as the sandboxed
# tests get from .bazelrc: these tests are Bazel-local (vLLM's processes share memory) and start engines that
# take a free port by binding port 0 and bind it again seconds later, in a worker (vLLM's distributed init); a
# test beside them could take it in between (CI, stop 46: a worker's start failed while others ran Gloo).
if [ -z "$FRAG_OWN_NETNS" ] && command -v unshare >/dev/null && command -v ip >/dev/null \
    && unshare -n true 2>/dev/null; then
  export FRAG_OWN_NETNS=1 VLLM_HOST_IP=127.0.0.1  # (vLLM's get_ip() would ask for a route out; there is none)
  exec unshare -n sh -c 'ip link set lo up && exec "$0" "$@"' "$0" "$@"
fi
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
