#!/usr/bin/env bash
# Lint and type-check, then run the test suite on parallel workers. Extra arguments go to pytest
# (`bash scripts/test.sh -k diff -x`; `-n 0` runs it in one process).
# GPU tests skip themselves on a machine without CUDA.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}

echo "test: ruff check ."
"$PY" -m ruff check . || { echo "test: ruff found problems (see above)" >&2; exit 1; }

echo "test: mypy (strict; configuration in pyproject.toml)"
"$PY" -m mypy || { echo "test: mypy found problems (see above)" >&2; exit 1; }

# Parallel workers (pytest-xdist): one per core ("auto"; PYTEST_XDIST_AUTO_NUM_WORKERS=N to choose,
# or pass -n 0 to run in this process). --dist loadfile keeps each file's tests on one worker, so a
# module-scoped fixture (a traced GPT-2, a 4-rank torchrun, a browser) is built once, not per worker.
# --durations=25: the slowest tests, fixtures included, at the end.
"$PY" -c "import xdist" 2>/dev/null || {
    echo "test: pytest-xdist is missing: run bash scripts/setup.sh (or pip install -e '.[test]')" >&2; exit 1; }
PYTEST_ARGS=(-q -n auto --dist loadfile --durations=25)
echo "test: pytest ${PYTEST_ARGS[*]} $*"
"$PY" -m pytest "${PYTEST_ARGS[@]}" "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
    # pytest's "no tests collected": a green run that tested nothing must not pass.
    echo "test: pytest collected no tests; failing on purpose (check the paths and -k/-m filters)" >&2
    exit 1
fi
exit "$rc"
