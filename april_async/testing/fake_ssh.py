"""A stand-in for ``ssh -tt HOST COMMAND`` onto a host played by a Linux network namespace.

``launch/cluster.sh`` runs ``$APRIL_SSH -tt -o BatchMode=yes HOST COMMAND``; with
``APRIL_SSH="python -m april_async.testing.fake_ssh"`` and ``APRIL_FAKE_SSH_HOSTS`` mapping each
host to a namespace (``10.77.0.2=ns1,10.77.0.3=ns2``), the command runs in that namespace the way
sshd runs it, as far as the remote side can tell:

- in a new session whose controlling terminal is a pseudo-terminal (``-tt``), through a shell;
- what this process reads on stdin is typed on that terminal (a ``\\x03`` is Ctrl-C: the terminal
  sends SIGINT to the remote foreground process group), and what the terminal prints comes out here;
- when this client goes away (killed by a signal; SIGKILL too, since the master side closes with
  the process), the terminal's master side closes, as sshd closes it when the connection drops:
  the kernel hangs up the remote session (SIGHUP), and the remote's later writes to the terminal
  fail with EIO. The client then exits at once, without waiting for the remote side, as ssh does.
- The end of stdin sends nothing (a background job's stdin is /dev/null). When the remote command
  ends, this exits with its status (ssh's 255 for an unknown host).
"""

from __future__ import annotations

import os
import pty
import select
import shlex
import signal
import sys


def namespaces() -> dict[str, str]:
    pairs = [p for p in os.environ.get("APRIL_FAKE_SSH_HOSTS", "").split(",") if p]
    return dict(p.split("=", 1) for p in pairs)


def parse(argv: list[str]) -> tuple[str, str]:
    """(host, command) from ssh's arguments (its options are accepted and ignored)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in ("-o", "-p", "-i", "-l") else 1
    if len(argv) - i < 2:
        raise SystemExit(f"fake_ssh: usage: fake_ssh [-tt] [-o OPT] HOST COMMAND, got {argv}")
    return argv[i], " ".join(argv[i + 1:])


def main(argv: list[str]) -> int:
    host, command = parse(argv)
    ns = namespaces().get(host)
    if ns is None:
        print(f"fake_ssh: Could not resolve hostname {host}", file=sys.stderr)
        return 255
    pid, master = pty.fork()
    if pid == 0:  # the remote side: pty.fork made a new session with the terminal as controlling tty
        os.execvp("ip", ["ip", "netns", "exec", ns, "bash", "-c", command])
    hung_up = False

    def hang_up(*_):
        nonlocal hung_up
        if not hung_up:
            hung_up = True
            os.close(master)  # sshd closes the master side: the kernel sends the session SIGHUP

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *a: (hang_up(), os._exit(255)))
    stdin_open = True
    while True:
        fds = [master] + ([sys.stdin.fileno()] if stdin_open else [])
        try:
            ready, _, _ = select.select(fds, [], [], 0.5)
        except InterruptedError:
            continue
        if master in ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the remote side closed the terminal (it ended)
                data = b""
            if not data:
                break
            try:
                os.write(sys.stdout.fileno(), data)
            except OSError:  # our own reader went away: like a dropped connection
                hang_up()
                return 255
        if stdin_open and sys.stdin.fileno() in ready:
            data = os.read(sys.stdin.fileno(), 1024)
            if data:
                os.write(master, data)
            else:
                stdin_open = False
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) % 256


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
