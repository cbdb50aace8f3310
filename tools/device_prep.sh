#!/usr/bin/env bash
# Here, before a device call: what bench/device.py needs there that the device image lacks.
#
#   tools/device_prep.sh [FLA_SOURCE]
#
# .whl/: tyro and its two pure-Python needs, as wheels for the image's Python 3.12 (the
# device has no network; tools/device_run.sh installs them there). .peers/fla: fla's
# source, the benchmark peer of the linear, delta and SSD families (tools/fla_peer.sh;
# FLA_SOURCE is a fetched fla mirror or a checkout). Both folders are git-ignored and
# travel with the call's `carry: [".whl", ".peers"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 -d .whl \
  $(grep -E '^(tyro|docstring[-_]parser|typeguard)==' requirements/constraints.txt)
ls .whl
if [ $# -ge 1 ]; then
  tools/fla_peer.sh "$1"
fi
