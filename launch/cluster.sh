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
# every host is this machine. So beside other hosts, name the head by an address or name they
# reach (not localhost or 127.0.0.1: refused). Each host line gets APRIL_NODE=n<index> so actor
# names and its files (summary-n<index>.json, children-n<index>.json, logs/up-n<index>.log) are
# its own, and APRIL_ADDR=<host> (where its actors' /metrics are found, under run.metrics_port);
# generators on other hosts wait for the head's initial checkpoint, so run.dir must be on
# a shared filesystem (or learner.checkpoint / generator.torch.checkpoint must exist on every host).
# One console: the head prints the steps, the other hosts their own actors' starts, restarts and stops.
#
# Launchers: ssh (default; `$APRIL_SSH -tt -o BatchMode=yes HOST COMMAND`, so closing the session
# stops the remote side) or srun (inside a SLURM allocation: `srun --nodes=1 --ntasks=1 --overlap
# --nodelist=HOST`, one step per host with all of the job's CPUs and GPUs there; launch/slurm.sbatch
# writes the host file and keys from the allocation). Hosts named localhost, 127.0.0.1 or this
# machine's name run here directly.
# Environment: APRIL_DIR, the checkout on every host (default: this one); APRIL, the april
# command there (default: $APRIL_DIR/.venv/bin/april); APRIL_SSH, the ssh command (default ssh;
# split into words); APRIL_KEYS, a keys directory: required when the hosts are not all this
# machine (the hubs then bind 0.0.0.0 and speak CurveZMQ, admitting only holders of a client key).
# Either one directory for every host (`april keys DIR`), or one per host (`april keys DIR --hosts
# h1,h2,...`: DIR/<host>/), where each host gets APRIL_KEYS=DIR/<host>; the path must hold the
# keys on that host. Per-host keys also bind each host to the roles it may run (the head's
# roles.toml): the head all of them, the others generator and scorer unless `april keys ... --roles
# HOST=learner,...` says otherwise (a learner line on another host needs it).
# APRIL_STOP_WAIT_S (default 180): how long a stop waits for the hosts. APRIL_RESTART (default
# on-failure): each host's april up restarts a crashed actor, within run.max_restarts, unless the
# run file sets run.restart (or --set run.restart=never after --, or APRIL_RESTART=never here).
# Ctrl-C (or TERM, HUP), or the head's run ending, stops every host: each gets a Ctrl-C on its
# terminal (local hosts SIGTERM; srun hosts SIGUSR2, which srun passes on to every process of the
# step, where a shell around april up turns it into SIGTERM to april up alone: a SIGTERM to srun
# would SIGKILL the step) and stops its actors in order; this waits for all of
# them, hangs up whatever still runs after APRIL_STOP_WAIT_S or at a second Ctrl-C, and exits
# with the head's status (130 after a Ctrl-C).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2; }
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
read -r -a ssh_cmd <<< "${APRIL_SSH:-ssh}"
stop_wait="${APRIL_STOP_WAIT_S:-180}"
config="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"

hosts=(); actors=()
while read -r host acts _; do
  [[ -z "$host" || "$host" == \#* ]] && continue
  hosts+=("$host"); actors+=("${acts:-generator:1}")
done < "$hostfile"
[[ ${#hosts[@]} -gt 0 ]] || { echo "cluster.sh: $hostfile names no host" >&2; exit 2; }

is_local() { [[ "$1" == localhost || "$1" == 127.0.0.1 || "$1" == "$(hostname)" || "$1" == "$(hostname -s)" ]]; }
is_loopback() { [[ "$1" == localhost || "$1" == 127.* || "$1" == ::1 ]]; }
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
if [[ $all_local == 0 ]] && is_loopback "$head"; then
  echo "cluster.sh: the head ($head, the host line with the broker) is named by a loopback address beside" \
       "remote hosts, which would look for the broker on themselves (APRIL_HEAD=$head): name it in $hostfile" \
       "by an address or name the other hosts reach" >&2
  exit 2
fi
if [[ $all_local == 1 ]]; then head_addr=127.0.0.1; bind=127.0.0.1; else head_addr="$head"; bind=0.0.0.0; fi
# APRIL_KEYS for host $1: its own directory when APRIL_KEYS holds one per host (april keys DIR --hosts ...).
keys_env() {
  [[ -n "${APRIL_KEYS:-}" ]] || return 0
  if [[ -d "$APRIL_KEYS/$1" ]]; then printf ' APRIL_KEYS=%q' "$APRIL_KEYS/$1"; else printf ' APRIL_KEYS=%q' "$APRIL_KEYS"; fi
}
if [[ -z "${APRIL_KEYS:-}" && $all_local == 0 ]]; then
  echo "cluster.sh: the hubs will bind 0.0.0.0: make keys with 'april keys DIR --hosts HEAD,NAME,...'," \
       "copy each host its DIR/<host> (same path) and set APRIL_KEYS=DIR" >&2
  exit 2
fi

commands=()
for i in "${!hosts[@]}"; do
  q_extra=""; for a in "${extra[@]+"${extra[@]}"}"; do q_extra+=" $(printf '%q' "$a")"; done
  cmd="cd $(printf '%q' "$dir") && APRIL_HEAD=$head_addr APRIL_BIND=$bind APRIL_NODE=n$i$(keys_env "${hosts[$i]}")"
  # How a Prometheus reaches this host's /metrics (run.metrics_port): its name in the host file.
  if [[ $all_local == 0 ]]; then cmd+=" APRIL_ADDR=$(printf '%q' "${hosts[$i]}")"; fi
  cmd+=" APRIL_RESTART=$(printf '%q' "${APRIL_RESTART:-on-failure}")"
  cmd+=" exec $(printf '%q' "$april") up --config $(printf '%q' "$config") --actors ${actors[$i]}$q_extra"
  commands+=("$cmd")
done

for i in "${!hosts[@]}"; do
  if is_local "${hosts[$i]}"; then how="local"; elif [[ $launcher == ssh ]]; then how="${ssh_cmd[*]} -tt ${hosts[$i]}";
  else how="srun --nodes=1 --ntasks=1 --overlap --nodelist=${hosts[$i]}"; fi
  echo "[${hosts[$i]}] ($how) ${commands[$i]}"
done
[[ $dry_run == 1 ]] && exit 0

# Each ssh reads its stdin from a FIFO held open here: a Ctrl-C written there reaches the remote
# terminal, which interrupts that host's april up (an ordered stop), and ssh ends when it has.
ctl="$(mktemp -d)"
trap 'rm -rf "$ctl"' EXIT
pids=(); ctl_fd=(); stop_sig=(); head_pid=""
# The command of an srun step: april up (and the actors it starts) ignore SIGUSR2, the shell around it
# turns one into SIGTERM for april up alone (an ordered stop), and ends with april up's status.
srun_wrap() {
  printf '%s' "trap 'kill -TERM \$p 2>/dev/null' USR2 TERM HUP; (trap '' USR2; $1) & p=\$!;"
  printf '%s' " while kill -0 \$p 2>/dev/null; do wait \$p; done; wait \$p"
}
launch() {  # start host line $1 in the background
  local i=$1 host="${hosts[$1]}" fd
  if is_local "$host"; then
    bash -c "${commands[$i]}" &
  elif [[ $launcher == ssh ]]; then
    mkfifo "$ctl/$i"
    exec {fd}<>"$ctl/$i"  # read-write: opening it never blocks, and no EOF reaches ssh
    "${ssh_cmd[@]}" -tt -o BatchMode=yes "$host" "${commands[$i]}" <"$ctl/$i" &
    ctl_fd[$i]=$fd
  else
    srun --nodes=1 --ntasks=1 --overlap --nodelist="$host" bash -c "$(srun_wrap "${commands[$i]}")" &
    stop_sig[$i]=USR2
  fi
  pids[$i]=$!
}
running() { local p; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
hang_up() {  # stop waiting: end every launcher process (an ssh closed is a remote SIGHUP)
  local p; for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
}
stop_all() {  # ask every host still running to stop, then wait for every one of them
  local i deadline=$((SECONDS + stop_wait))
  trap 'hang_up' INT TERM HUP
  for i in "${!pids[@]}"; do
    kill -0 "${pids[$i]}" 2>/dev/null || continue
    if [[ -n "${ctl_fd[$i]:-}" ]]; then
      printf '\003' >&"${ctl_fd[$i]}" || kill -TERM "${pids[$i]}" 2>/dev/null || true
    else
      kill -"${stop_sig[$i]:-TERM}" "${pids[$i]}" 2>/dev/null || true
    fi
  done
  while running; do
    if (( SECONDS >= deadline )); then
      echo "cluster.sh: hosts still running ${stop_wait} s after the stop: hanging up" >&2
      hang_up
      break
    fi
    sleep 0.5
  done
  wait "${pids[@]}" 2>/dev/null || true
}
interrupted=0
trap 'interrupted=1' INT TERM HUP
order=("$head_i"); for i in "${!hosts[@]}"; do [[ $i == "$head_i" ]] || order+=("$i"); done
for i in "${order[@]}"; do
  launch "$i"
  if [[ $i == "$head_i" ]]; then head_pid=${pids[$i]}; fi
done
status=0
while [[ $interrupted == 0 ]]; do  # a trapped signal ends the wait early; the head may still run
  wait "$head_pid" && status=0 || status=$?
  kill -0 "$head_pid" 2>/dev/null || break
done
stop_all
if [[ $interrupted == 1 ]]; then exit 130; fi
exit $status
