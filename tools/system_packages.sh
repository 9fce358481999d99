#!/usr/bin/env bash
# Usage: bash tools/system_packages.sh
# Debian's packages that the system tests run for real, left out of the README's test run: SLURM
# (slurmctld, slurmd, munge: tests/integration/test_slurm.py) and Prometheus
# (tests/integration/test_prometheus.py). Needs root and apt-get; elsewhere it says so and does
# nothing (those tests then skip, naming the missing command). Idempotent.
set -euo pipefail
packages=(slurm-wlm munge prometheus)
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "system_packages.sh: needs root and apt-get; not installing ${packages[*]}" >&2
  exit 0
fi
missing=(); for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[[ ${#missing[@]} -eq 0 ]] && exit 0
export DEBIAN_FRONTEND=noninteractive
# The package lists of a fresh image may be missing or old: read them again when the first try fails.
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
# Nothing of theirs runs as a service here: the tests start their own daemons.
