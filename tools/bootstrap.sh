#!/usr/bin/env bash
# Usage: bash tools/bootstrap.sh
# Makes .venv (if missing or stale) and installs april-async with its test extra into it.
# Idempotent: a second run only re-installs when pyproject.toml changed. Needs only python3 >= 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: from the local CPU wheel where one is cached, never a CUDA build.
  # --no-compile: byte-compiling every file of every package took two thirds of the install's time;
  # Python compiles the modules a process imports, once, on first use.
  .venv/bin/python -m pip install -q --no-compile "torch==2.13.0"
  .venv/bin/python -m pip install -q --no-compile -e ".[test]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
