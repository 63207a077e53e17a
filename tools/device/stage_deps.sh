#!/usr/bin/env bash
# Copies the small dependencies that a GPU machine lacks into .deps/ (ignored by
# git), to carry there with the working tree and use with -DFRAG_DEPS_DIR=.deps:
#
#   .deps/include/fmt        fmt headers (used header-only, FMT_HEADER_ONLY)
#   .deps/include/nlohmann   nlohmann/json
#   .deps/include/CLI        CLI11
#   .deps/googletest         GoogleTest sources (built with add_subdirectory)
#
# Run it here (Debian: libfmt-dev, nlohmann-json3-dev, libcli11-dev, googletest).
# Usage: tools/device/stage_deps.sh [dest]   (default: .deps in the repository root)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${1:-$root/.deps}"

sources=(/usr/include/fmt /usr/include/nlohmann /usr/include/CLI /usr/src/googletest)
for s in "${sources[@]}"; do
  if [ ! -d "$s" ]; then
    echo "stage_deps: $s is missing (apt-get install libfmt-dev nlohmann-json3-dev libcli11-dev googletest)" >&2
    exit 1
  fi
done

rm -rf "$dest"
mkdir -p "$dest/include"
for h in fmt nlohmann CLI; do
  cp -rL "/usr/include/$h" "$dest/include/$h"
done
cp -rL /usr/src/googletest "$dest/googletest"

# Versions, for the record.
{
  echo "staged $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(hostname)"
  dpkg-query -W -f='${Package} ${Version}\n' libfmt-dev nlohmann-json3-dev libcli11-dev googletest 2>/dev/null || true
} > "$dest/VERSIONS"

# Keep .deps/ out of git (a local exclude: .gitignore belongs to the project).
if [ "$dest" = "$root/.deps" ] && git -C "$root" rev-parse --git-dir > /dev/null 2>&1; then
  exclude="$(git -C "$root" rev-parse --git-path info/exclude)"
  case "$exclude" in /*) ;; *) exclude="$root/$exclude" ;; esac
  mkdir -p "$(dirname "$exclude")"
  grep -qxF '.deps/' "$exclude" 2> /dev/null || echo '.deps/' >> "$exclude"
fi

echo "stage_deps: $(du -sh "$dest" | cut -f1) in $dest:"
cat "$dest/VERSIONS"
