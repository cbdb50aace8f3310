#!/usr/bin/env bash
# Copies fla's `fla` package (flash-linear-attention, the benchmark peer of
# bench/_device_families.py) into .peers/fla/ so that a device run can carry it,
# and records the commit in .peers/fla/COMMIT. fla is run, never imported by the
# library and never committed: .peers/ is git-ignored.
#
#   tools/fla_peer.sh SOURCE [DEST]
#
# SOURCE: a git directory (a bare mirror, e.g. the one `fetch
# github:fla-org/flash-linear-attention` gives; REV=<commit> picks a commit, HEAD by
# default) or a source checkout (a folder holding fla/). DEST: default .peers/fla
# in the repository root. Prints the commit and the copy's size (a device call
# carries at most 64 MiB in all).
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 SOURCE [DEST]  (SOURCE: fla's git dir or a checkout holding fla/)" >&2
    exit 2
fi
source=$1
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${2:-$root/.peers/fla}
rev=${REV:-HEAD}

mkdir -p "$dest"
rm -rf "$dest/fla" "$dest/COMMIT" "$dest/LICENSE"
if [ -d "$source/fla" ]; then  # a checkout
    cp -R "$source/fla" "$dest/fla"
    if [ -f "$source/LICENSE" ]; then cp "$source/LICENSE" "$dest/LICENSE"; fi
    commit=$(git -C "$source" rev-parse HEAD 2>/dev/null || echo unknown)
    if [ -n "$(git -C "$source" status --porcelain -- fla 2>/dev/null)" ]; then
        commit="$commit+modified"
    fi
elif commit=$(git --git-dir="$source" rev-parse --verify -q "$rev^{commit}"); then
    git --git-dir="$source" archive "$commit" fla LICENSE | tar -x -C "$dest"
else
    echo "$0: $source is neither a checkout holding fla/ nor a git dir with $rev" >&2
    exit 1
fi
find "$dest/fla" -name __pycache__ -type d -prune -exec rm -rf {} +
echo "$commit" >"$dest/COMMIT"
version=$(sed -n "s/^__version__ = ['\"]\(.*\)['\"]/\1/p" "$dest/fla/__init__.py")
echo "fla ${version:-?} at $commit -> $dest ($(du -sh "$dest" | cut -f1))"
