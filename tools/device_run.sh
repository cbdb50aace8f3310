#!/usr/bin/env bash
# There, on a device machine: bench/device.py on the image's own jax, torch and triton.
#
#   tools/device_run.sh [bench/device.py's flags]
#
# Installs the carried wheels (tools/device_prep.sh made them here) into /tmp/site, runs
# the project from the checkout, and, where the device tool's $OUT is set, puts the log
# and every file the run wrote (one tarball; the device returns at most 8 files) there.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/device-out}
mkdir -p "$out"
stamp=$(mktemp)  # files newer than this are the run's (the copy there need not be a git checkout)
python3 bench/device.py "$@" 2>&1 | tee "$out/device.log"
status=${PIPESTATUS[0]}
# The files the run wrote: the report, the phases' own, and the tuning cache.
find bench/results attn/pallas -type f -newer "$stamp" | tar czf "$out/results.tgz" -T -
cp bench/results/device-*.md "$out/" 2>/dev/null
exit "$status"
