#!/usr/bin/env bash
# Every test tier, one after the other (the README's test command runs this):
#   fast         python -m pytest                     in-process checks (the default)
#   devices      tests/devices on 8 fake CPU devices  (the count is set before JAX starts)
#   integration  python -m pytest -m integration      the CLI, subprocesses, faults, signals,
#                                                      several processes, docs, bench, --quick,
#                                                      serving every kind, kernels lowered for
#                                                      accelerators (Pallas, Mosaic GPU)
# `tools/test.sh fast devices` runs only those; extra pytest flags go in PYTEST_ARGS. Each tier
# prints its wall time; the exit status is non-zero if any tier failed (all of them still run).
set -uo pipefail
cd "$(dirname "$0")/.."
tiers=("$@")
[ ${#tiers[@]} -eq 0 ] && tiers=(fast devices integration)
workers="${TEST_WORKERS:-2}"
# One persistent compilation cache for every tier (tests/conftest.py), removed at the end.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR=$(mktemp -d -t attnlab_xla_cache_XXXX)
  export JAX_COMPILATION_CACHE_DIR
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
status=0
for tier in "${tiers[@]}"; do
  case "$tier" in
    # worksteal: an idle worker takes the other's tests (one file per worker left one idle).
    fast) cmd=(python -m pytest -n "$workers" --dist worksteal -q) ;;
    devices) cmd=(env XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}"
                  python -m pytest -m devices tests/devices -n "$workers" --dist load -q) ;;
    integration) cmd=(python -m pytest -m integration -n "$workers" --dist loadfile -q) ;;
    *) echo "tools/test.sh: unknown tier '$tier' (fast, devices, integration)" >&2; exit 2 ;;
  esac
  echo "== $tier: ${cmd[*]} ${PYTEST_ARGS:-}"
  start=$SECONDS
  # shellcheck disable=SC2086  # PYTEST_ARGS holds several flags
  "${cmd[@]}" ${PYTEST_ARGS:-} || status=1
  echo "== $tier: $((SECONDS - start)) s"
done
exit $status
