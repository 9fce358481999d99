#!/usr/bin/env bash
# Usage: bash tools/test.sh [pytest args...]
# The README's test command: sets up .venv if needed, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
