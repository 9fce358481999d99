"""A real SLURM on the hosts of ``testing.netns.Hosts``: one ``munged``, one ``slurmctld`` and one
``slurmd`` per host, everything (config, keys, sockets, spools, logs) under one directory.

``Slurm(hosts, base)`` writes ``base/slurm.conf`` (nodes ``node0``..``node<n-1>`` at the hosts'
addresses, one partition ``debug``; ``gpus_per_node`` GPUs each, stand-ins: ``base/dev/gpuN``, devices
like /dev/null, enough for a job's GPU requests and variables, not to run on), starts the daemons, and
``wait_idle()`` waits until every node has registered. ``cmd(...)`` runs a client command
(``sbatch``, ``squeue``, ``scancel``) on host 0 with ``SLURM_CONF`` set; ``close()`` stops every
daemon (SIGTERM, then SIGKILL) and says what it had to kill. The daemons are the Debian
``slurm-wlm`` 22.05 build's, as root (``SlurmUser=root``):

- ``munged`` runs in the test's own namespace with its own key and socket (``--socket``, named to
  every client and daemon by ``AuthInfo=socket=...``; a path socket reaches across network
  namespaces). The socket's directories need not be world-searchable: ``--force``.
- Each ``slurmd`` runs as ``nodeK`` (``-N nodeK``) in host K's network namespace, and in mount and
  UTS namespaces of its own (``unshare --mount --uts``), where the host name is ``nodeK`` and
  ``base/hosts`` is bind-mounted on ``/etc/hosts``: the job steps it starts inherit both, so a node
  is named as on a real cluster and reaches the others by name. The machine's ``/etc`` is untouched.
  The network namespace is entered with ``nsenter --net``, not ``ip netns exec``: that one remounts
  ``/sys`` for the namespace, without ``/sys/fs/cgroup``, and slurmd 22.05 then refuses to start
  ("No filesystem mounted on /sys/fs/cgroup", "Unable to initialize cgroup plugin", "slurmd
  initialization failed") although nothing here uses cgroups (``ProctrackType=proctrack/linuxproc``,
  ``TaskPlugin=task/none``). Several slurmd on one machine need nothing more: each has its own
  network namespace (so the same ``SlurmdPort``) and its own spool, pid and log files (``%n``).
- ``slurmctld`` runs on host 0 beside its slurmd (``SlurmctldHost=node0(<host 0's address>)``), the
  same way. ``select/cons_tres`` (cores) places GPUs as GRES (``scontrol show job -d`` names each
  node's); a job gets one core per node unless it asks for more, which confines nothing here
  (``task/none``). Short timeouts; ``KillWait`` as given; a job leaves squeue 2 s after it ends.

Needs root, ``ip netns`` and the commands ``unavailable()`` names.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

from april_async.testing.netns import Hosts

COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo",
            "nsenter", "unshare", "mount")
CTLD_PORT = 6817
SLURMD_PORT = 6818


def unavailable() -> str | None:
    """Why a SLURM cannot be started here, or None (namespaces are ``netns.unavailable``'s)."""
    if os.geteuid() != 0:
        return "SLURM's daemons as root (SlurmUser=root) and network namespaces need root"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"not on PATH: {', '.join(missing)} (Debian: slurm-wlm, munge)"
    return None


def conf(base: Path, addresses: list[str], *, kill_wait_s: int, gpus_per_node: int = 0) -> str:
    gres = f" Gres=gpu:{gpus_per_node}" if gpus_per_node else ""
    nodes = "\n".join(f"NodeName=node{k} NodeAddr={a} CPUs={os.cpu_count()}{gres} State=UNKNOWN"
                      for k, a in enumerate(addresses))
    return f"""ClusterName=april
GresTypes=gpu
SlurmctldHost=node0({addresses[0]})
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
AuthType=auth/munge
AuthInfo=socket={base}/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base}/ctld
SlurmctldPidFile={base}/ctld/slurmctld.pid
SlurmctldLogFile={base}/ctld/slurmctld.log
SlurmdSpoolDir={base}/%n/spool
SlurmdPidFile={base}/%n/slurmd.pid
SlurmdLogFile={base}/%n/slurmd.log
PlugStackConfig={base}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
InactiveLimit=0
KillWait={kill_wait_s}
MinJobAge=2
{nodes}
PartitionName=debug Nodes=node[0-{len(addresses) - 1}] Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """munged, slurmctld and one slurmd per host of ``hosts``, under ``base``; see the module docstring."""

    def __init__(self, hosts: Hosts, base: Path, *, kill_wait_s: int = 120, gpus_per_node: int = 0):
        self.hosts, self.base = hosts, base
        self.names = [f"node{k}" for k in range(len(hosts.names))]
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed: list[str] = []
        self.env = {**os.environ, "SLURM_CONF": str(base / "slurm.conf")}
        for d in ("munge", "ctld", *self.names):
            (base / d).mkdir(parents=True, exist_ok=True)
        for n in self.names:
            (base / n / "spool").mkdir(exist_ok=True)
        (base / "munge").chmod(0o755)
        (base / "munge-key").mkdir(mode=0o700, exist_ok=True)
        key = base / "munge-key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (base / "slurm.conf").write_text(conf(base, hosts.addresses, kill_wait_s=kill_wait_s,
                                              gpus_per_node=gpus_per_node))
        # Stand-in GPUs: character devices like /dev/null (slurmd 22.05 counts no gpu GRES without File=).
        (base / "gres.conf").write_text(f"Name=gpu File={base}/dev/gpu[0-{gpus_per_node - 1}]\n"
                                        if gpus_per_node else "")
        for g in range(gpus_per_node):
            (base / "dev").mkdir(exist_ok=True)
            if not (base / "dev" / f"gpu{g}").exists():
                os.mknod(base / "dev" / f"gpu{g}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        (base / "plugstack.conf").write_text("")
        (base / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{a} {n}\n" for a, n in zip(hosts.addresses, self.names)))
        try:
            self._start(key)
        except BaseException:
            self.close()
            raise

    def _start(self, key: Path) -> None:
        m = self.base / "munge"
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={m}/munge.socket", f"--key-file={key}",
                               f"--log-file={m}/munged.log", f"--pid-file={m}/munged.pid",
                               f"--seed-file={m}/munged.seed"])
        deadline = time.monotonic() + 10
        while not (m / "munge.socket").exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.log('munged')}")
            time.sleep(0.05)
        conf_path = self.env["SLURM_CONF"]
        self._spawn("slurmctld", self._on(0, f"exec slurmctld -D -i -f {conf_path}"))
        for k, n in enumerate(self.names):
            self._spawn(n, self._on(k, f"exec slurmd -D -N {n} -f {conf_path}"))

    def _on(self, k: int, command: str) -> list[str]:
        """``command`` on host ``k``: its network namespace, host name ``nodeK``, ``base/hosts`` as
        /etc/hosts."""
        inner = f"hostname {self.names[k]} && mount --bind {self.base}/hosts /etc/hosts && {command}"
        return ["nsenter", f"--net=/run/netns/{self.hosts.names[k]}", "unshare", "--mount", "--uts",
                "sh", "-c", inner]

    def _spawn(self, name: str, argv: list[str]) -> None:
        with (self.base / f"{name}.out").open("w") as out:
            self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)

    def log(self, name: str) -> str:
        """A daemon's output (and its log file's end), for a failure's message."""
        files = [self.base / f"{name}.out", self.base / "munge" / "munged.log",
                 self.base / "ctld" / "slurmctld.log", self.base / name / "slurmd.log"]
        wanted = {"munged": files[:2], "slurmctld": [files[0], files[2]]}.get(name, [files[0], files[3]])
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in wanted if p.exists())

    def cmd(self, *argv: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        """A SLURM client command on host 0 (where slurmctld listens), to the end."""
        kw.setdefault("env", self.env)
        return subprocess.run(["nsenter", f"--net=/run/netns/{self.hosts.names[0]}", *argv],
                              capture_output=True, text=True, timeout=timeout, **kw)

    def nodes(self) -> dict[str, str]:
        """Each node's state as sinfo tells it (``idle``, ``alloc``, ``down*``...)."""
        r = self.cmd("sinfo", "-h", "-N", "-o", "%N %t")
        return dict(line.split() for line in r.stdout.splitlines() if line.strip())

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node has registered (idle)."""
        deadline = time.monotonic() + timeout
        while True:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}):\n{self.log(name)}")
            states = self.nodes()
            if len(states) == len(self.names) and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                logs = "\n".join(self.log(n) for n in ("slurmctld", *self.names))
                raise RuntimeError(f"nodes not idle within {timeout:g} s: {states}\n{logs}")
            time.sleep(0.25)

    def daemon_pids(self) -> set[int]:
        """The daemons' pids and their children's (slurmctld's slurmscriptd)."""
        pids = {p.pid for p in self.procs.values() if p.poll() is None}
        children = set()
        for pid in pids:
            try:
                children |= {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
            except OSError:
                pass
        return pids | children

    def close(self, timeout: float = 15) -> None:
        """Stop every daemon: slurmd first, then slurmctld, munged last; SIGKILL what outlives ``timeout``
        (named in ``killed``)."""
        order = [n for n in (*self.names, "slurmctld", "munged") if n in self.procs]
        for name in order:
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.killed.append(name)
                p.kill()
                p.wait()

    def __enter__(self) -> Slurm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
