#!/usr/bin/env bash
# The Mosaic GPU kernels' tests (tests/attn/pallas/test_mosaic.py: the interpreted twins'
# numerics and the Hopper kernels' export for cuda; test_mosaic_hopper.py: the Hopper
# kernels themselves interpreted, which only jax 0.11 can) under the GPU machine's jax, 0.11.2,
# which needs Python 3.12 (PYTHON; default python3.12, or pyenv's), in a fresh venv,
# with jax's deprecation warnings as errors. CI runs the same tests under the pinned jax
# (0.10.1); this is the check that the kernels also lower, unwarned, where they will run.
#
#   tools/test_mosaic_jax011.sh            # about two minutes after the install
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python=${PYTHON:-python3.12}
if ! "$python" -c "" 2>/dev/null && command -v pyenv > /dev/null; then  # pyenv's, not on PATH
  python="$(pyenv root)/versions/$(pyenv versions --bare | grep '^3\.12' | tail -1)/bin/python"
fi
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "jax==0.11.2" chex pytest numpy
# The interpreter runs each warpgroup on a thread whose barrier waits hold one of XLA's CPU host
# threads; XLA sizes that pool by the devices as well as the cores, and on a 2-core host the
# warp-specialised kernels could starve it (a hang in about 1 run in 6 without this).
XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}" \
PYTHONPATH=. "$venv/bin/python" -W error::DeprecationWarning -m pytest -q -p no:cacheprovider -m integration \
  tests/attn/pallas/test_mosaic.py tests/attn/pallas/test_mosaic_hopper.py "$@"
