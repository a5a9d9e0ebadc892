#!/usr/bin/env bash
# Lint and type-check, then run the test suite. Extra arguments go to pytest (`bash scripts/test.sh -k diff -x`).
# GPU tests skip themselves on a machine without CUDA.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}

echo "test: ruff check ."
"$PY" -m ruff check . || { echo "test: ruff found problems (see above)" >&2; exit 1; }

echo "test: mypy (strict; configuration in pyproject.toml)"
"$PY" -m mypy || { echo "test: mypy found problems (see above)" >&2; exit 1; }

echo "test: pytest -q $*"
"$PY" -m pytest -q "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
    # pytest's "no tests collected": a green run that tested nothing must not pass.
    echo "test: pytest collected no tests; failing on purpose (check the paths and -k/-m filters)" >&2
    exit 1
fi
exit "$rc"
