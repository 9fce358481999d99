#!/usr/bin/env bash
# Usage: bash tools/test.sh [pytest args...]
# The README's test command: sets up .venv if needed, then runs the whole suite in APRIL_TEST_WORKERS
# processes (default 2; pytest-xdist, a worker that runs out of tests takes some of the other's). Most
# integration tests wait on other processes, so two workers overlap them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
exec .venv/bin/python -m pytest -n "${APRIL_TEST_WORKERS:-2}" --dist worksteal "$@"
