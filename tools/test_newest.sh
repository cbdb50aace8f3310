#!/usr/bin/env bash
# Runs the test suite against the newest versions the package index serves
# today, in a fresh virtual environment, ignoring requirements/constraints.txt,
# so that a broken new release of a dependency is found here first. Not part of
# CI's pass/fail: CI installs the pinned versions.
#
#   tools/test_newest.sh                       # install the newest, test, show what moved
#   tools/test_newest.sh --update-constraints  # ...minus requirements/holds.txt; pin if it passed
#
# The second form is how requirements/constraints.txt is regenerated: it
# resolves the newest versions except the releases held back in
# requirements/holds.txt, and only rewrites the file after the whole suite
# passed with exactly those versions.
# Extra arguments after the flag go to every tier's pytest (e.g. `-- -x`); all three
# tiers run (tools/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

update=0
if [[ "${1:-}" == "--update-constraints" ]]; then
  update=1
  shift
fi
[[ "${1:-}" == "--" ]] && shift

venv=$(mktemp -d)/venv
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
holds=()
[[ $update -eq 1 && -f requirements/holds.txt ]] && holds=(-c requirements/holds.txt)
python -m pip install --quiet --upgrade "${holds[@]}" -e ".[test,dev]"
freeze=$(mktemp)
{
  echo "# The exact versions the test suite passed with (Python $(python -c 'import platform; print(platform.python_version(), platform.machine())'))."
  echo "# Regenerate: tools/test_newest.sh --update-constraints (rewrites this file only if the suite passes)."
  echo "# Newest releases except those held back in requirements/holds.txt (which says why)."
  python -m pip freeze --exclude-editable | grep -v '^-e ' | sort -f
} >"$freeze"

echo "== versions that differ from requirements/constraints.txt:"
diff <(grep -v '^#' requirements/constraints.txt | sort -f) <(grep -v '^#' "$freeze") || true

echo "== tools/test.sh (pytest flags: $*)"
status=0
PYTEST_ARGS="$*" tools/test.sh || status=$?
if [[ $status -eq 0 && $update -eq 1 ]]; then
  cp "$freeze" requirements/constraints.txt
  echo "== requirements/constraints.txt updated"
elif [[ $update -eq 1 ]]; then
  echo "== the suite failed (exit $status): requirements/constraints.txt left as it was" >&2
fi
rm -rf "$(dirname "$venv")" "$freeze"
exit $status
