#!/usr/bin/env bash
# Start one april-async run across several hosts: one `april up --actors ...` per host line.
#
# usage: launch/cluster.sh HOSTFILE CONFIG [--launcher ssh|srun] [--dry-run] [-- april up options]
#
# HOSTFILE: one host per line and the actors it runs (default generator:1); '#' starts a comment.
#     node1  broker,broadcaster,learner:4,scorer
#     node2  generator:2
#     node3  generator:2
# learner:N runs the learner as N ranks of one torch.distributed group, all on that host (one GPU
# each on CUDA; [learner] ranks = N in CONFIG does the same). One host line at most runs the learner.
# The host that runs the broker is the head: every other host reaches the broker and the
# broadcaster there (APRIL_HEAD), and they bind to all interfaces (APRIL_BIND=0.0.0.0) unless
# every host is this machine. Each host line gets APRIL_NODE=n<index> so actor names are unique;
# generators on other hosts wait for the head's initial checkpoint, so run.dir must be on a
# shared filesystem (or learner.checkpoint / generator.torch.checkpoint must exist on every host).
#
# Launchers: ssh (default; `ssh -tt HOST`, so closing the session stops the remote side) or srun
# (inside a SLURM allocation: `srun --nodes=1 --ntasks=1 --nodelist=HOST`). Hosts named
# localhost, 127.0.0.1 or this machine's name run here directly, without either.
# Environment: APRIL_DIR, the checkout on every host (default: this one); APRIL, the april
# command there (default: $APRIL_DIR/.venv/bin/april); APRIL_KEYS, a keys directory made by
# `april keys DIR` and copied to every host: required when the hosts are not all this machine
# (the hubs then bind 0.0.0.0 and speak CurveZMQ, admitting only holders of the client key).
# Ctrl-C, or the head's run ending, stops every host.
set -euo pipefail

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[[ $# -ge 2 ]] || usage
hostfile="$1"; config="$2"; shift 2
launcher=ssh; dry_run=0; extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --launcher) launcher="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "cluster.sh: unknown option $1" >&2; usage ;;
  esac
done
[[ -f "$hostfile" ]] || { echo "cluster.sh: host file $hostfile does not exist" >&2; exit 2; }
[[ -f "$config" ]] || { echo "cluster.sh: config $config does not exist" >&2; exit 2; }
case "$launcher" in ssh|srun) ;; *) echo "cluster.sh: --launcher must be ssh or srun, got $launcher" >&2; exit 2 ;; esac

dir="${APRIL_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
april="${APRIL:-$dir/.venv/bin/april}"
config="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"

hosts=(); actors=()
while read -r host acts _; do
  [[ -z "$host" || "$host" == \#* ]] && continue
  hosts+=("$host"); actors+=("${acts:-generator:1}")
done < "$hostfile"
[[ ${#hosts[@]} -gt 0 ]] || { echo "cluster.sh: $hostfile names no host" >&2; exit 2; }

is_local() { [[ "$1" == localhost || "$1" == 127.0.0.1 || "$1" == "$(hostname)" || "$1" == "$(hostname -s)" ]]; }
head=""; head_i=""; all_local=1; learner_hosts=()
for i in "${!hosts[@]}"; do
  if [[ ",${actors[$i]}," == *,broker,* ]]; then head="${hosts[$i]}"; head_i=$i; fi
  if [[ ",${actors[$i]}," == *,learner[,:]* ]]; then learner_hosts+=("${hosts[$i]}"); fi
  is_local "${hosts[$i]}" || all_local=0
done
[[ -n "$head" ]] || { echo "cluster.sh: no host line runs the broker" >&2; exit 2; }
if [[ ${#learner_hosts[@]} -gt 1 ]]; then
  echo "cluster.sh: ${#learner_hosts[@]} host lines run the learner (${learner_hosts[*]}): one runs all its" \
       "ranks (learner:N)" >&2
  exit 2
fi
if [[ $all_local == 1 ]]; then head_addr=127.0.0.1; bind=127.0.0.1; else head_addr="$head"; bind=0.0.0.0; fi
keys_env=""
if [[ -n "${APRIL_KEYS:-}" ]]; then
  keys_env=" APRIL_KEYS=$(printf '%q' "$APRIL_KEYS")"
elif [[ $all_local == 0 ]]; then
  echo "cluster.sh: the hubs will bind 0.0.0.0: make keys with 'april keys DIR', copy DIR to every host" \
       "and set APRIL_KEYS=DIR" >&2
  exit 2
fi

commands=()
for i in "${!hosts[@]}"; do
  q_extra=""; for a in "${extra[@]+"${extra[@]}"}"; do q_extra+=" $(printf '%q' "$a")"; done
  cmd="cd $(printf '%q' "$dir") && APRIL_HEAD=$head_addr APRIL_BIND=$bind APRIL_NODE=n$i$keys_env"
  cmd+=" exec $(printf '%q' "$april") up --config $(printf '%q' "$config") --actors ${actors[$i]}$q_extra"
  commands+=("$cmd")
done

for i in "${!hosts[@]}"; do
  if is_local "${hosts[$i]}"; then how="local"; elif [[ $launcher == ssh ]]; then how="ssh -tt ${hosts[$i]}";
  else how="srun --nodes=1 --ntasks=1 --nodelist=${hosts[$i]}"; fi
  echo "[${hosts[$i]}] ($how) ${commands[$i]}"
done
[[ $dry_run == 1 ]] && exit 0

pids=(); head_pid=""
stop_all() {
  trap - INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
}
trap 'stop_all; exit 130' INT TERM
order=("$head_i"); for i in "${!hosts[@]}"; do [[ $i == "$head_i" ]] || order+=("$i"); done
for i in "${order[@]}"; do
  host="${hosts[$i]}"
  if is_local "$host"; then
    bash -c "${commands[$i]}" &
  elif [[ $launcher == ssh ]]; then
    ssh -tt -o BatchMode=yes "$host" "${commands[$i]}" &
  else
    srun --nodes=1 --ntasks=1 --nodelist="$host" bash -c "${commands[$i]}" &
  fi
  pids+=($!)
  if [[ $i == "$head_i" ]]; then head_pid=$!; fi
done
status=0
wait "$head_pid" || status=$?
stop_all
exit $status
