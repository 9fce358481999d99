"""A sandboxed Python tool for tool-using rollouts: model-written code runs in a child process and
what it prints comes back as the tool's observation (``run_python``). The code is treated as
hostile; every way out that we know of is closed, and an attempt that trips a limit ends with a
typed error (``SandboxResult.error``) instead of an exception.

How a run is built (Linux, root needed to set it up; the code itself never runs as root):

- **Three processes.** The caller starts a *bootstrap* (this file run as a script, ``python -I -S``,
  clean environment, its own session, dying with its caller through ``PR_SET_PDEATHSIG`` as
  ``runtime.die_with_parent`` arranges, but set by the bootstrap itself). The bootstrap reads the
  code from its stdin, unshares new mount, network and PID namespaces, builds the file system view
  below and forks a *reaper*, which is PID 1 of the new PID namespace. The
  reaper forks the *payload*: it sets the resource limits, drops to the sandbox user, and execs
  ``sys.executable -I -B -u main.py`` in the scratch directory. When the payload exits the reaper
  reports its wait status and CPU time on a private pipe and exits; the kernel then kills every
  process left in the PID namespace, so a background child, even one that called ``setsid()``,
  never outlives the run. On the wall-time limit the caller SIGKILLs the bootstrap's process group
  (bootstrap and reaper), which ends the namespace the same way. No ``preexec_fn`` runs in the
  caller, which may be multi-threaded.
- **User.** Each run gets a uid (and gid) of its own, drawn at random from ``SANDBOX_UIDS``, a range
  no account uses, with no supplementary groups and ``PR_SET_NO_NEW_PRIVS`` set. A uid of its own
  rather than ``nobody``: ``RLIMIT_NPROC`` counts every process of the uid on the host, so with a
  shared ``nobody`` concurrent rollouts would share one process budget (and exec fails once it is
  spent), and they could signal each other. Nothing on the host belongs to the uid, so it can write
  nowhere except where it is given ownership.
- **Limits.** ``RLIMIT_CPU`` (soft ``cpu_s``: SIGXCPU; hard one second later: SIGKILL),
  ``RLIMIT_AS`` (``memory_mb``, per process), ``RLIMIT_NPROC`` (``processes``, threads included,
  exact thanks to the dedicated uid), ``RLIMIT_FSIZE`` (``file_mb``), ``RLIMIT_NOFILE`` (64),
  ``RLIMIT_CORE`` (0). The caller enforces the wall time (``wall_s``, counted from the start,
  set-up included) and the output cap (``output_kb`` for each of stdout and stderr; past it the
  run is stopped).
- **Network.** A network namespace of its own holds only a loopback that is down: every
  ``connect``, to 127.0.0.1 as to any outside address, fails at once with "network unreachable";
  abstract Unix sockets are per network namespace too.
- **Files.** We chose a private mount namespace over Landlock. Recent kernels have Landlock (the one
  this was written on, 6.18, offers ABI 7), but whether a kernel enables it depends on its boot-time
  LSM list, while namespaces are needed here anyway (network, PID), and a mount namespace also
  *hides* things: other runs' scratch directories, and what other users left in /tmp. In the
  namespace (all mounts made private first, so nothing propagates back) every mount is remounted
  read-only (per mount, ``MS_BIND | MS_REMOUNT``; the host's mounts are untouched); /tmp, /var/tmp
  and /dev/shm are covered by empty read-only tmpfs; the scratch directory is a fresh tmpfs at
  ``/tmp/sandbox`` owned by the sandbox user (mode 0700, at most ``file_mb`` MiB and 1024 inodes,
  so it cannot fill the host's disk), which is the payload's cwd and HOME. It lives only in the
  namespace, so it is gone when the run ends. ``/proc`` is a fresh proc of the new PID namespace
  (read-only), so the payload sees only its own processes.
- **Interpreter.** The payload runs the caller's ``sys.executable`` with its site-packages (``-I``:
  isolated, environment ignored; no ``-S``, so the venv's packages import). Where the interpreter's
  prefix lies under a directory other users cannot enter (a pyenv in /root, mode 0700), that
  directory is covered by a read-only tmpfs holding only read-only bind mounts of the interpreter's
  own directories, at their usual paths; the rest of it stays invisible.

What is *not* isolated: the payload can read world-readable files (the repository, /etc) and
connect to world-writable Unix sockets on the host's file system (a read-only mount does not stop
``connect``); memory is limited per process, so ``processes`` x ``memory_mb`` bounds the total.

If any step of the set-up fails (not root, no namespaces, a mount refused), ``run_python`` raises
``SandboxUnavailable`` naming the step; the code is never run without the sandbox.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import secrets
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

MAX_CODE_CHARS = 100_000
"""Longest program ``run_python`` accepts, in characters."""

SANDBOX_UIDS = range(2_000_000_000, 2_000_000_000 + (1 << 24))
"""Uids (and gids) a run is given, one at random per run; no account on the host uses them."""

SCRATCH_DIR = "/tmp/sandbox"
"""The scratch directory's path inside the sandbox: the payload's cwd and HOME."""

ERROR_KINDS = ("timeout", "cpu_limit", "memory_limit", "output_limit", "crashed", "refused")
"""Every value ``SandboxResult.error`` takes, besides None."""

_OPEN_FILES = 64
_FAIL_EXIT = 97  # the bootstrap's exit code when it reported a failed set-up step
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up here (not root, not Linux, a namespace or mount refused); the
    message names the step that failed. The code was not run."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. ``wall_s``: seconds from start to end (set-up included), enforced by
    the caller; ``cpu_s``: CPU seconds per process; ``memory_mb``: address space per process;
    ``processes``: processes (threads count too) of the run's uid at once, the payload included;
    ``file_mb``: largest file, and the scratch directory's size; ``output_kb``: KiB kept of each of
    stdout and stderr. A bad value is a ``ValueError`` that names the field."""

    wall_s: float = 5.0
    cpu_s: int = 4
    memory_mb: int = 256
    processes: int = 16
    file_mb: int = 8
    output_kb: int = 64

    def __post_init__(self) -> None:
        wall = self.wall_s
        if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not math.isfinite(wall) \
                or not 0 < wall <= 3600:
            raise ValueError(f"SandboxLimits.wall_s must be a number of seconds in (0, 3600], got {wall!r}")
        bounds = {"cpu_s": (1, 3600), "memory_mb": (32, 1 << 20), "processes": (1, 4096),
                  "file_mb": (1, 1 << 16), "output_kb": (1, 1 << 16)}
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"SandboxLimits.{name} must be an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """The end of one run. ``ok``: the program exited with code 0 within every limit. ``error``:
    None, or one of ``ERROR_KINDS``; ``detail`` says more in one line. ``exit_code``: the payload's
    exit code, minus the signal number when a signal ended it, None when the run was stopped from
    outside (``timeout``, ``output_limit``) or never started (``refused``). ``stdout``/``stderr``
    are decoded as UTF-8 (bad bytes replaced) and cut at the output cap."""

    ok: bool
    stdout: str
    stderr: str
    error: str | None
    exit_code: int | None
    wall_s: float
    detail: str = ""

    def as_observation(self, *, stderr_chars: int = 2000) -> str:
        """The text the model sees: the program's stdout when it succeeded; otherwise whatever it
        printed, then ``error: <kind>: <detail>``, and for a crash the end of its traceback
        (at most ``stderr_chars`` characters of stderr)."""
        if self.ok:
            return self.stdout
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        parts.append(f"error: {self.error}: {self.detail}" if self.detail else f"error: {self.error}")
        if self.error in ("crashed", "memory_limit") and self.stderr.strip():
            parts.append(self.stderr.rstrip("\n")[-stderr_chars:])
        return "\n".join(parts)


def run_python(code: str, *, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` as a Python program in a fresh sandbox (module docstring) and return how it
    ended. Bad input (not a string, a NUL byte, longer than ``MAX_CODE_CHARS``, not encodable) is
    ``refused`` without starting anything. Raises ``SandboxUnavailable`` when the sandbox cannot
    be built here; never runs the code outside it."""
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    reason = _refusal(code)
    if reason is not None:
        return SandboxResult(ok=False, stdout="", stderr="", error="refused", exit_code=None,
                             wall_s=0.0, detail=reason)
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"platform: the sandbox needs Linux namespaces, this is {sys.platform}")
    if os.geteuid() != 0:
        raise SandboxUnavailable(f"privileges: setting up the sandbox needs root (euid {os.geteuid()})")
    return _Run(code.encode("utf-8"), limits).run()


def _refusal(code: object) -> str | None:
    """Why ``code`` is refused, or None when it may run."""
    if not isinstance(code, str):
        return f"code must be a string, got {type(code).__name__}"
    if len(code) > MAX_CODE_CHARS:
        return f"code is {len(code)} characters long, more than the {MAX_CODE_CHARS} allowed"
    if "\x00" in code:
        return "code contains a NUL byte"
    try:
        code.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"code is not valid Unicode text ({exc.reason} at {exc.start})"
    return None


def _exposures() -> dict[str, list[str]]:
    """The interpreter's directories the sandbox user could not reach, grouped by the highest
    ancestor it cannot enter (which the bootstrap covers with a skeleton tmpfs): ``{cover:
    [target, ...]}``. Empty when the interpreter is reachable as it is."""
    exe = os.path.realpath(sys.executable)
    wanted = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                            sys.base_exec_prefix, os.path.dirname(exe))}
    targets = [t for t in sorted(wanted) if not any(t != o and t.startswith(o.rstrip("/") + "/")
                                                    for o in wanted)]
    covers: dict[str, list[str]] = {}
    for target in targets:
        parts = target.strip("/").split("/")
        for depth in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:depth])
            if not os.stat(ancestor).st_mode & 0o001:
                covers.setdefault(ancestor, []).append(target)
                break
    return covers


class _Run:
    """One run, from the caller's side: start the bootstrap, feed it the code, read its output
    and its report until it ends or a limit stops it, and turn that into a ``SandboxResult``."""

    def __init__(self, code: bytes, limits: SandboxLimits):
        self.code = code
        self.limits = limits
        self.cap = limits.output_kb * 1024
        self.out = bytearray()
        self.err = bytearray()
        self.report = bytearray()
        self.truncated = False

    def run(self) -> SandboxResult:
        limits = self.limits
        uid = SANDBOX_UIDS[secrets.randbelow(len(SANDBOX_UIDS))]
        config = {"uid": uid, "gid": uid, "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
                  "processes": limits.processes, "file_mb": limits.file_mb, "open_files": _OPEN_FILES,
                  "exe": sys.executable, "covers": _exposures(), "caller": os.getpid()}
        report_r, report_w = os.pipe()
        env = _clean_env()
        argv = [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), "--bootstrap",
                json.dumps(config), str(report_w)]
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, cwd="/", close_fds=True,
                                    pass_fds=(report_w,), start_new_session=True)
        except OSError as exc:
            os.close(report_r)
            raise SandboxUnavailable(f"start: could not start the bootstrap: {exc}") from exc
        finally:
            os.close(report_w)
        stopped: str | None = None
        try:
            try:
                proc.stdin.write(self.code)
                proc.stdin.close()
            except BrokenPipeError:  # the bootstrap failed early; its report says why
                try:
                    proc.stdin.close()
                except OSError:
                    pass
            stopped = self._pump(proc, report_r, start + limits.wall_s)
            if stopped is not None:
                _kill_group(proc)
                # Collect what is left, up to the cap, while the namespace dies.
                self._pump(proc, None, time.monotonic() + 2.0)
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
            for stream in (proc.stdout, proc.stderr):
                stream.close()
            self._read_rest(report_r)
            os.close(report_r)
        wall = time.monotonic() - start
        return self._result(stopped, proc.returncode, wall)

    def _pump(self, proc: subprocess.Popen, report_fd: int | None, deadline: float) -> str | None:
        """Read stdout, stderr and (if given) the report pipe until all reach EOF; returns
        ``timeout`` when ``deadline`` passes first, ``output_limit`` when a stream outgrows the
        cap, else None."""
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ, self.out)
        sel.register(proc.stderr.fileno(), selectors.EVENT_READ, self.err)
        if report_fd is not None:
            sel.register(report_fd, selectors.EVENT_READ, self.report)
        try:
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return "timeout"
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fd)
                        continue
                    buf = key.data
                    if buf is self.report:
                        buf += data
                        continue
                    room = self.cap - len(buf)
                    if len(data) > room:
                        buf += data[:max(room, 0)]
                        if not self.truncated:
                            self.truncated = True
                            if report_fd is not None:
                                return "output_limit"
                    else:
                        buf += data
            return None
        finally:
            sel.close()

    def _read_rest(self, fd: int) -> None:
        """Whatever is left in the report pipe, once every writer is gone (non-blocking)."""
        os.set_blocking(fd, False)
        try:
            while chunk := os.read(fd, 65536):
                self.report += chunk
        except BlockingIOError:
            pass

    def _result(self, stopped: str | None, bootstrap_code: int | None, wall: float) -> SandboxResult:
        limits = self.limits
        stdout = self.out.decode("utf-8", "replace")
        stderr = self.err.decode("utf-8", "replace")
        lines = self.report.decode("utf-8", "replace").splitlines()
        failure = next((line[5:] for line in lines if line.startswith("fail ")), None)
        if failure is not None:
            raise SandboxUnavailable(failure)

        def result(error: str | None, exit_code: int | None, detail: str = "") -> SandboxResult:
            return SandboxResult(ok=error is None, stdout=stdout, stderr=stderr, error=error,
                                 exit_code=exit_code, wall_s=wall, detail=detail)

        if stopped == "timeout":
            return result("timeout", None, f"still running after the {limits.wall_s:g} s wall-time limit;"
                                           " stopped")
        if stopped == "output_limit":
            return result("output_limit", None, f"printed more than {limits.output_kb} KiB on one stream;"
                                                " output truncated and the program stopped")
        status_line = next((line for line in lines if line.startswith("exit ")), None)
        if status_line is None:
            raise SandboxUnavailable(f"report: the bootstrap ended (code {bootstrap_code}) without reporting"
                                     f" how the program ended; its stderr: {stderr[-500:]!r}")
        _, raw_status, raw_cpu = status_line.split()
        status, cpu = int(raw_status), float(raw_cpu)
        if os.WIFSIGNALED(status):
            signum = os.WTERMSIG(status)
            exit_code = -signum
            how = f"killed by {_signal_name(signum)}"
        else:
            exit_code = os.WEXITSTATUS(status)
            how = f"exited with code {exit_code}"
        if self.truncated:  # the cap was reached while the program was already ending
            return result("output_limit", exit_code, f"printed more than {limits.output_kb} KiB on one"
                                                     f" stream; output truncated ({how})")
        if exit_code == 0:
            return result(None, 0)
        if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu >= limits.cpu_s - 0.05):
            return result("cpu_limit", exit_code, f"used more than {limits.cpu_s} s of CPU time ({how})")
        tail = stderr[-4000:]
        if any(marker in tail for marker in _MEMORY_MARKERS):
            return result("memory_limit", exit_code,
                          f"ran out of its {limits.memory_mb} MiB of memory ({how})")
        last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
        return result("crashed", exit_code, f"{how}: {last}" if last else how)


def _clean_env() -> dict[str, str]:
    """The only environment the sandbox's processes get."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH_DIR, "LANG": "C.UTF-8"}


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the bootstrap's process group (bootstrap and reaper; the reaper's death ends the
    PID namespace and everything in it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --- The bootstrap: this file run as a script (as root, ``python -I -S``, stdlib only). ---------

_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_NOATIME = 1024
_MS_NODIRATIME = 2048
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_RELATIME = 1 << 21
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_MOUNT_FLAGS = {"ro": _MS_RDONLY, "nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
                "noatime": _MS_NOATIME, "nodiratime": _MS_NODIRATIME, "relatime": _MS_RELATIME}
_SAFE = _MS_NOSUID | _MS_NODEV


class _StepFailed(Exception):
    """A set-up step failed; the message starts with the step's name."""


class _Libc:
    """The few libc calls Python's ``os`` lacks on 3.11 (``unshare``, ``mount``, ``prctl``)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                                   ctypes.c_char_p]
        self.lib.unshare.argtypes = [ctypes.c_int]
        self.lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                                   ctypes.c_ulong]

    @staticmethod
    def _check(result: int, step: str, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise _StepFailed(f"{step}: {what}: {os.strerror(errno)} (errno {errno})")

    def unshare(self, flags: int, step: str) -> None:
        self._check(self.lib.unshare(flags), step, f"unshare({flags:#x})")

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None,
              step: str) -> None:
        enc = (lambda s: None if s is None else s.encode())
        self._check(self.lib.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), step,
                    f"mount {target!r} (flags {flags:#x}, {fstype or 'no fs'})")

    def prctl(self, option: int, arg: int, step: str) -> None:
        self._check(self.lib.prctl(option, int(arg), 0, 0, 0), step, f"prctl({option}, {arg})")


def _mounts() -> list[tuple[str, int]]:
    """Every mount point of this mount namespace with its per-mount flags, the topmost mount at a
    path winning, in mount order."""
    found: dict[str, int] = {}
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            path = _unescape(fields[4])
            flags = 0
            for option in fields[5].split(","):
                flags |= _MOUNT_FLAGS.get(option, 0)
            found.pop(path, None)
            found[path] = flags
    return sorted(found.items(), key=lambda item: item[0].count("/") if item[0] != "/" else 0)


def _unescape(path: str) -> str:
    r"""Undo mountinfo's octal escapes (``\040`` for a space)."""
    if "\\" not in path:
        return path
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and path[i + 1:i + 4].isdigit():
            out.append(chr(int(path[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def _build_view(libc: _Libc, config: dict, code: bytes) -> None:
    """In the new mount namespace: everything read-only, empty /tmp, /var/tmp and /dev/shm, the
    scratch tmpfs with ``main.py`` in it, and the interpreter's hidden directories exposed."""
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE, None, "private mounts")
    covers: dict[str, list[str]] = config["covers"]
    handles = {t: os.open(t, os.O_PATH | os.O_DIRECTORY) for ts in covers.values() for t in ts}
    for path, flags in _mounts():
        try:
            libc.mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags, None,
                       "read-only remount")
        except _StepFailed:
            if not os.path.lexists(path):  # a mount point that is gone is unreachable anyway
                continue
            raise
    emptied = [p for p in ("/var/tmp", "/dev/shm") if os.path.isdir(p) and not os.path.islink(p)]
    for path in emptied:
        libc.mount("tmpfs", path, "tmpfs", _SAFE | _MS_NOEXEC, "size=16k,nr_inodes=64,mode=0755",
                   f"cover {path}")
    libc.mount("tmpfs", "/tmp", "tmpfs", _SAFE | _MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755", "cover /tmp")
    for cover in covers:  # an interpreter under an emptied directory (a checkout in /tmp): its mount point
        if any(cover.startswith(root + "/") for root in (*emptied, "/tmp")):
            os.makedirs(cover, 0o755, exist_ok=True)
    for path in emptied:
        libc.mount(None, path, None, _MS_REMOUNT | _SAFE | _MS_NOEXEC | _MS_RDONLY, None, f"read-only {path}")
    os.mkdir(SCRATCH_DIR, 0o700)
    uid, gid = config["uid"], config["gid"]
    libc.mount("tmpfs", SCRATCH_DIR, "tmpfs", _SAFE,
               f"size={config['file_mb'] * 1024}k,nr_inodes=1024,mode=0700,uid={uid},gid={gid}",
               "scratch tmpfs")
    main = os.path.join(SCRATCH_DIR, "main.py")
    fd = os.open(main, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    with os.fdopen(fd, "wb") as f:
        f.write(code)
    libc.mount(None, "/tmp", None, _MS_REMOUNT | _SAFE | _MS_NOEXEC | _MS_RDONLY, None, "read-only /tmp")
    for cover, targets in covers.items():
        libc.mount("tmpfs", cover, "tmpfs", _SAFE, "size=16k,nr_inodes=256,mode=0755", f"cover {cover}")
        for target in targets:
            inside = os.path.join(cover, os.path.relpath(target, cover))
            os.makedirs(inside, 0o755, exist_ok=True)
            libc.mount(f"/proc/self/fd/{handles[target]}", inside, None, _MS_BIND | _MS_REC, None,
                       f"expose {target}")
            libc.mount(None, inside, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _SAFE, None,
                       f"read-only {target}")
        libc.mount(None, cover, None, _MS_REMOUNT | _SAFE | _MS_RDONLY, None, f"read-only {cover}")
    for handle in handles.values():
        os.close(handle)


def _start_payload(libc: _Libc, config: dict, report: int) -> None:
    """In the payload (a child of the reaper, still root): limits, the sandbox user, exec."""
    step = "limits"
    try:
        cpu = config["cpu_s"]
        memory = config["memory_mb"] * 1024 * 1024
        file_size = config["file_mb"] * 1024 * 1024
        for which, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                                  (resource.RLIMIT_NPROC, config["processes"], config["processes"]),
                                  (resource.RLIMIT_FSIZE, file_size, file_size),
                                  (resource.RLIMIT_NOFILE, config["open_files"], config["open_files"]),
                                  (resource.RLIMIT_CORE, 0, 0), (resource.RLIMIT_MEMLOCK, 0, 0)):
            resource.setrlimit(which, (soft, hard))
        step = "drop privileges"
        os.setgroups([])
        os.setresgid(config["gid"], config["gid"], config["gid"])
        os.setresuid(config["uid"], config["uid"], config["uid"])
        if os.getuid() == 0 or os.geteuid() == 0 or os.getgroups():
            raise _StepFailed("drop privileges: still root after setresuid")
        try:
            os.setresuid(0, 0, 0)
        except PermissionError:
            pass
        else:
            raise _StepFailed("drop privileges: could become root again")
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, step)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, step)
        step = "scratch directory"
        os.chdir(SCRATCH_DIR)
        step = "exec"
        os.closerange(3, report)
        os.closerange(report + 1, 1 << 16)
        os.set_inheritable(report, False)
        exe = config["exe"]
        os.execve(exe, [exe, "-I", "-B", "-u", "main.py"], _clean_env())
    except BaseException as exc:  # noqa: BLE001 - everything is reported, then this process ends
        _say(report, _failure(step, exc))
        os._exit(_FAIL_EXIT)


def _reap(libc: _Libc, config: dict, report: int) -> None:
    """PID 1 of the sandbox's PID namespace: mount its /proc, start the payload, reap orphans, and
    report the payload's end; exiting then kills whatever the payload left behind."""
    try:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, "reaper")
        libc.mount("proc", "/proc", "proc", _SAFE | _MS_NOEXEC | _MS_RDONLY, None, "mount /proc")
        payload = os.fork()
        if payload == 0:
            _start_payload(libc, config, report)
        _quiet_std_streams()
        while True:
            pid, status, usage = os.wait4(-1, 0)
            if pid == payload:
                _say(report, f"exit {status} {usage.ru_utime + usage.ru_stime:.3f}")
                os._exit(0)
    except BaseException as exc:  # noqa: BLE001
        _say(report, _failure("reaper", exc))
        os._exit(_FAIL_EXIT)


def _bootstrap(argv: list[str]) -> int:
    """The bootstrap's main: read the code, build the namespaces and the file system view, fork
    the reaper and wait for it. Every failure goes to the report pipe as ``fail <step>: ...``."""
    report = -1
    step = "bootstrap"
    try:
        config = json.loads(argv[1])
        report = int(argv[2])
        code = sys.stdin.buffer.read()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        libc = _Libc()
        step = "die with caller"
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, step)
        if os.getppid() != config["caller"]:
            raise _StepFailed(f"{step}: the caller is already gone")
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        step = "namespaces"
        libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID, "namespaces (mount, network, PID)")
        step = "file system view"
        _build_view(libc, config, code)
        step = "fork reaper"
        reaper = os.fork()
        if reaper == 0:
            _reap(libc, config, report)
        os.close(report)
        report = -1
        _quiet_std_streams()
        _, status = os.waitpid(reaper, 0)
        return os.waitstatus_to_exitcode(status) & 0xFF
    except BaseException as exc:  # noqa: BLE001
        if report >= 0:
            _say(report, _failure(step, exc))
        return _FAIL_EXIT


def _quiet_std_streams() -> None:
    """Point stdout and stderr at /dev/null, so the caller's pipes close when the payload's side
    is gone, whoever else is still waiting."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


def _failure(step: str, exc: BaseException) -> str:
    """The report line for a failed set-up step."""
    if isinstance(exc, _StepFailed):
        return f"fail {exc}"
    return f"fail {step}: {type(exc).__name__}: {exc}"


def _say(fd: int, line: str) -> None:
    """Write one report line to the caller (nothing if the caller is gone)."""
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(_bootstrap(sys.argv[1:]))
