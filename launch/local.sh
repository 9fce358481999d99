#!/usr/bin/env bash
# Start every actor of a run on this machine: broker, broadcaster, scorer, learner and two
# generators, with a live console view. Ctrl-C stops them all cleanly.
#
# usage: launch/local.sh [CONFIG.toml] [april up options, e.g. --set run.max_steps=50]
#   CONFIG defaults to launch/addchain.toml (the built-in long-tail task on a CPU).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="${1:-$here/launch/addchain.toml}"
[[ $# -gt 0 ]] && shift
exec "${APRIL:-$here/.venv/bin/april}" up --config "$config" "$@"
