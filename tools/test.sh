#!/usr/bin/env bash
# Usage: bash tools/test.sh [pytest args...]
# The README's test command: sets up .venv if needed, then runs the whole suite in APRIL_TEST_WORKERS
# processes (default 3; pytest-xdist: each starts on its third of the tests, in order, and a worker
# that runs out takes some of another's).
# Three workers on two cores: most integration tests wait on the processes they start (a learner
# step, a server's restart), and a third worker keeps the cores busy meanwhile (the whole suite:
# 91-96 % of both cores busy with three, ~80 % with two; README.md, *Tests*).
# Bytecode is cached (__pycache__, ignored by git) even where PYTHONDONTWRITEBYTECODE is set: the
# suite starts ~600 Python processes, and each would otherwise compile the project's modules
# again, and each worker rewrite every test module's asserts again.
# The 25 slowest tests are listed at the end (--durations): where the suite's time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -n "${APRIL_TEST_WORKERS:-3}" --dist worksteal --durations=25 "$@"
