"""The sandboxed Python tool (``april_async.agents.sandbox``): every escape the model's code tries
(files, network, fork bomb, memory, time, output, privilege) is stopped and the result carries the
right typed error. Building the sandbox needs root (namespaces, mounts, dropping to another user);
those tests are skipped with a reason elsewhere, and run wherever the suite runs as root."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from april_async.agents.sandbox import (
    ERROR_KINDS,
    MAX_CODE_CHARS,
    SANDBOX_UIDS,
    SCRATCH_DIR,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    run_python,
)

REPO = Path(__file__).resolve().parents[2]
needs_root = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="building the sandbox needs root on Linux (namespaces, mounts, another uid)")
FAST = SandboxLimits(wall_s=10, cpu_s=5, memory_mb=256, processes=8, file_mb=1, output_kb=16)
"""Limits for the tests that do not test a limit: generous in time, since the suite may run several
workers (and so several sandboxes) on two cores."""


def _processes_of(uid: int) -> list[int]:
    """Pids of live processes whose real uid is ``uid``, read from /proc. (Other sandbox runs may be
    going on in other test workers, each with its own uid.)"""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) == uid:
                found.append(int(entry))
    return found


def _assert_nothing_left(stdout: str, within_s: float = 2.0) -> None:
    """No process of the run whose program printed ``UID <uid>`` as its first line is running."""
    first = stdout.splitlines()[0].split()
    assert first[0] == "UID", stdout[:200]
    uid = int(first[1])
    assert uid in SANDBOX_UIDS
    deadline = time.monotonic() + within_s
    while (left := _processes_of(uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes of sandbox uid {uid} still running: {left}"


# --- Without root: input checks, limits, result formatting, refusal to run unsandboxed. ---------

def test_default_limits_are_the_documented_ones():
    assert SandboxLimits() == SandboxLimits(wall_s=5, cpu_s=4, memory_mb=256, processes=16, file_mb=8,
                                            output_kb=64)


@pytest.mark.parametrize("field, value", [
    ("wall_s", 0), ("wall_s", -1.0), ("wall_s", float("nan")), ("wall_s", float("inf")), ("wall_s", "5"),
    ("wall_s", True), ("cpu_s", 0), ("cpu_s", 1.5), ("memory_mb", 8), ("memory_mb", None),
    ("processes", 0), ("processes", True), ("file_mb", -1), ("output_kb", 0),
])
def test_bad_limits_are_value_errors_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SandboxLimits\.{field}\b"):
        SandboxLimits(**{field: value})


@pytest.mark.parametrize("code, why", [
    (123, "string"), (b"print(1)", "string"), (None, "string"), ("print(1)\x00", "NUL"),
    ("x" * (MAX_CODE_CHARS + 1), "long"), ("print('\ud800')", "Unicode"),
])
def test_bad_input_is_refused_without_running(code, why):
    result = run_python(code)
    assert (result.ok, result.error, result.exit_code) == (False, "refused", None)
    assert why in result.detail
    assert result.as_observation().startswith("error: refused: ")


def test_without_root_it_refuses_to_run_at_all(monkeypatch, tmp_path):
    marker = tmp_path / "ran"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="root"):
        run_python(f"open({str(marker)!r}, 'w').write('unsandboxed')")
    assert not marker.exists()


def test_observation_is_stdout_or_a_typed_error():
    ok = SandboxResult(ok=True, stdout="45\n", stderr="", error=None, exit_code=0, wall_s=0.1)
    assert ok.as_observation() == "45\n"
    crash = SandboxResult(ok=False, stdout="partial\n", stderr="Traceback ...\nValueError: boom\n",
                          error="crashed", exit_code=1, wall_s=0.1,
                          detail="exited with code 1: ValueError: boom")
    assert crash.as_observation() == ("partial\nerror: crashed: exited with code 1: ValueError: boom\n"
                                      "Traceback ...\nValueError: boom")
    late = SandboxResult(ok=False, stdout="", stderr="", error="timeout", exit_code=None, wall_s=5.0,
                         detail="too slow")
    assert late.as_observation() == "error: timeout: too slow"
    assert set(ERROR_KINDS) == {"timeout", "cpu_limit", "memory_limit", "output_limit", "crashed", "refused"}


# --- With root: the sandbox itself. ---------------------------------------------------------------

@needs_root
def test_a_normal_computation_returns_its_stdout():
    result = run_python("print(sum(range(10)))", limits=FAST)
    assert (result.ok, result.error, result.exit_code, result.stdout) == (True, None, 0, "45\n")
    assert result.as_observation() == "45\n"
    assert 0 < result.wall_s < FAST.wall_s


@needs_root
def test_a_crash_is_typed_and_carries_the_traceback():
    result = run_python("print('before')\nraise ValueError('boom')", limits=FAST)
    assert (result.ok, result.error, result.exit_code) == (False, "crashed", 1)
    assert result.stdout == "before\n"
    assert "ValueError: boom" in result.detail
    observation = result.as_observation()
    assert observation.startswith("before\nerror: crashed: exited with code 1: ValueError: boom")
    assert 'File "/tmp/sandbox/main.py", line 2' in observation


@needs_root
def test_it_runs_unprivileged_isolated_and_with_a_clean_environment(monkeypatch):
    monkeypatch.setenv("APRIL_SANDBOX_SECRET", "do-not-leak")
    code = """
import json, os, sys
try:
    os.setuid(0)
    regained = True
except PermissionError:
    regained = False
fds = []
for fd in range(3, 64):
    try:
        os.fstat(fd)
        fds.append(fd)
    except OSError:
        pass
print(json.dumps({"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
                  "regained": regained, "env": sorted(os.environ), "cwd": os.getcwd(),
                  "home": os.environ.get("HOME"), "isolated": sys.flags.isolated, "fds": fds,
                  "pid": os.getpid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}))
"""
    result = run_python(code, limits=FAST)
    assert result.ok, result
    seen = json.loads(result.stdout)
    assert seen["uid"] != 0 and seen["euid"] != 0 and seen["gid"] != 0
    assert seen["uid"] in SANDBOX_UIDS and seen["groups"] == []
    assert not seen["regained"]
    assert set(seen["env"]) <= {"PATH", "HOME", "LANG"}
    assert seen["cwd"] == seen["home"] == SCRATCH_DIR
    assert seen["isolated"] == 1
    assert seen["fds"] == []
    assert seen["pids"] == [1, seen["pid"]]  # its own PID namespace: the reaper and itself


@needs_root
def test_writes_outside_the_scratch_directory_fail():
    token = f"april-sandbox-escape-{uuid.uuid4().hex}"
    targets = [f"{d}/{token}" for d in ("/tmp", "/dev/shm", "/var/tmp", "/root", str(REPO), "/etc", "/work")]
    code = f"""
import os
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        print("WROTE", path)
    except OSError as exc:
        print("DENIED", path, exc.errno)
    try:
        os.mkdir(path + ".d")
        print("WROTE", path + ".d")
    except OSError as exc:
        print("DENIED", path + ".d", exc.errno)
with open("note.txt", "w") as f:
    f.write("fine")
print("SCRATCH", open(os.path.join(os.environ["HOME"], "note.txt")).read())
"""
    try:
        result = run_python(code, limits=FAST)
        assert result.ok, result
        lines = result.stdout.splitlines()
        assert lines[-1] == "SCRATCH fine"
        assert not [line for line in lines if line.startswith("WROTE")]
        assert len([line for line in lines if line.startswith("DENIED")]) == 2 * len(targets)
        for path in targets:
            assert not os.path.lexists(path) and not os.path.lexists(path + ".d"), path
    finally:
        for path in targets:
            for leftover in (path, path + ".d"):
                if os.path.isdir(leftover):
                    os.rmdir(leftover)
                elif os.path.lexists(leftover):
                    os.unlink(leftover)


@needs_root
def test_the_scratch_directory_is_fresh_for_every_run():
    first = run_python("open('note.txt', 'w').write('left over')\nimport os\nprint(sorted(os.listdir()))",
                       limits=FAST)
    assert first.ok and first.stdout == "['main.py', 'note.txt']\n", first
    second = run_python("import os\nprint(sorted(os.listdir()))", limits=FAST)
    assert second.ok and second.stdout == "['main.py']\n", second


@needs_root
def test_a_file_larger_than_the_limit_cannot_be_written():
    code = """
try:
    with open("big.bin", "wb") as f:
        f.write(b"x" * (3 * 1024 * 1024))
    print("WROTE")
except OSError as exc:
    print("DENIED", exc.errno)
"""
    result = run_python(code, limits=FAST)  # file_mb=1
    assert result.ok and result.stdout.startswith("DENIED"), result


@needs_root
def test_no_connection_reaches_a_loopback_listener_of_the_host():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
    print("CONNECTED")
except OSError as exc:
    print("BLOCKED", type(exc).__name__, exc.errno)
print("INTERFACES", [name for _, name in socket.if_nameindex()])
"""
        result = run_python(code, limits=FAST)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever arrived
    assert result.ok, result
    assert result.stdout.splitlines()[0].startswith("BLOCKED"), result.stdout
    assert "INTERFACES ['lo']" in result.stdout


@needs_root
def test_no_socket_reaches_an_outside_address():
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never a real host, and the attempt fails at once anyway.
    code = """
import socket
try:
    socket.create_connection(("192.0.2.1", 80), timeout=1).close()
    print("CONNECTED")
except OSError as exc:
    print("TCP BLOCKED", exc.errno)
try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.sendto(b"hello", ("192.0.2.1", 53))
    print("SENT")
except OSError as exc:
    print("UDP BLOCKED", exc.errno)
"""
    start = time.monotonic()
    result = run_python(code, limits=FAST)
    assert result.ok, result
    assert result.stdout.startswith("TCP BLOCKED") and "UDP BLOCKED" in result.stdout, result.stdout
    assert time.monotonic() - start < FAST.wall_s


@needs_root
def test_a_fork_bomb_is_stopped_and_leaves_nothing_behind():
    limits = SandboxLimits(wall_s=1.5, cpu_s=2, processes=6, file_mb=1, output_kb=16)
    code = """
import os
print("UID", os.getuid(), flush=True)
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    start = time.monotonic()
    result = run_python(code, limits=limits)
    elapsed = time.monotonic() - start
    assert not result.ok and result.error in ("timeout", "cpu_limit"), result
    assert elapsed < limits.wall_s + 3
    _assert_nothing_left(result.stdout)
    after = run_python("print('still usable')", limits=FAST)
    assert after.ok and after.stdout == "still usable\n"


@needs_root
def test_the_process_limit_holds_and_no_child_outlives_the_run():
    code = """
import os, time
print("UID", os.getuid(), flush=True)
children = 0
try:
    while True:
        pid = os.fork()
        if pid == 0:
            if children == 0:
                os.setsid()  # try to escape the process group
            time.sleep(60)
            os._exit(0)
        children += 1
except OSError as exc:
    print(children, type(exc).__name__)
"""
    result = run_python(code, limits=FAST)  # processes=8, the program itself included
    assert result.ok, result
    children, error = result.stdout.splitlines()[1].split()
    assert int(children) == FAST.processes - 1 and error == "BlockingIOError"
    _assert_nothing_left(result.stdout)


@needs_root
def test_allocating_two_gigabytes_is_a_memory_limit():
    result = run_python("block = bytearray(2 * 1024 ** 3)\nprint('allocated')", limits=FAST)
    assert (result.ok, result.error) == (False, "memory_limit"), result
    assert "allocated" not in result.stdout
    assert result.as_observation().startswith("error: memory_limit: ")


@needs_root
def test_a_busy_loop_is_stopped_by_the_cpu_limit():
    limits = SandboxLimits(wall_s=4, cpu_s=1, file_mb=1, output_kb=16)
    result = run_python("while True:\n    pass", limits=limits)
    assert not result.ok and result.error in ("cpu_limit", "timeout"), result
    assert result.wall_s < limits.wall_s + 1.5
    if result.error == "cpu_limit":
        assert result.exit_code in (-24, -9)  # SIGXCPU at the soft limit, SIGKILL at the hard one


@needs_root
def test_sleeping_past_the_wall_time_is_a_timeout_and_keeps_what_was_printed():
    limits = SandboxLimits(wall_s=1, file_mb=1, output_kb=16)
    result = run_python("import os, time\nprint('UID', os.getuid())\ntime.sleep(100)", limits=limits)
    assert (result.ok, result.error, result.exit_code) == (False, "timeout", None), result
    assert result.stdout.startswith("UID ")
    assert limits.wall_s <= result.wall_s < limits.wall_s + 1.5
    assert result.as_observation().startswith(result.stdout + "error: timeout: ")
    _assert_nothing_left(result.stdout)


@needs_root
def test_an_output_flood_is_truncated_and_said_so():
    code = "import os\nprint('UID', os.getuid())\nwhile True:\n    print('x' * 1000)"
    result = run_python(code, limits=FAST)  # output_kb=16
    assert (result.ok, result.error) == (False, "output_limit"), result
    assert len(result.stdout.encode()) == FAST.output_kb * 1024
    assert "truncated" in result.as_observation()
    assert result.wall_s < FAST.wall_s
    _assert_nothing_left(result.stdout)


def _turn(text: str, *, turn: int = 0, finish: str = "stop", last: bool = False, answer: str = "84"):
    from april_async.agents.env import Trajectory, Turn

    turns = [Turn([1], [2], "earlier") for _ in range(turn)] + [Turn([3], [], text)]
    return Trajectory(sample_id=5, prompt_ids=[1], turns=turns, finish_reason=finish, task="math_python",
                      meta={"answer": answer}, last_turn=last)


def _qwen_call(code: str, name: str = "python") -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"code": code}}) + "\n</tool_call>"


@needs_root
def test_the_math_tasks_python_tool_runs_calls_in_the_sandbox_and_rewards_the_final_answer():
    """``tasks.math_python``: a call's program runs in the sandbox and its output is the tool's
    message; an escape is stopped and the message carries its typed error; a malformed call or
    another tool is a ``bad_call`` the policy sees; the final answer is rewarded."""
    from april_async.agents.env import Continue, Done
    from april_async.tasks.math_python import TOOL_NAME, PythonToolEnvironment

    env = PythonToolEnvironment(limits=FAST)
    step = env.step(_turn("Let me compute.\n" + _qwen_call("print((12 + 30) * 2)")))
    assert isinstance(step, Continue)
    assert step.observation == {"role": "tool", "name": TOOL_NAME, "content": "84\n"}

    def said(text: str) -> str:
        return env.step(_turn(text)).observation["content"]

    escape = said(_qwen_call("open('/etc/escaped', 'w').write('x')"))
    assert "error: crashed" in escape and "Read-only file system" in escape
    assert not Path("/etc/escaped").exists()
    slow = PythonToolEnvironment(limits=SandboxLimits(wall_s=1.0, cpu_s=5, processes=8, file_mb=1,
                                                      output_kb=16))
    assert "error: timeout" in slow.step(_turn(_qwen_call("while True: pass"))).observation["content"]
    assert said('{"name": "python", "parameters": {"code": "print(7)"}}') == "7\n"  # a Llama-3.1-style call
    assert said(_qwen_call("x", name="shell")).startswith("error: bad_call: there is no tool 'shell'")
    assert said("<tool_call>{not json</tool_call>").startswith("error: bad_call:")
    assert env.step(_turn("The answer is \\boxed{84}.", turn=1)) == Done(1.0)
    assert env.step(_turn("The answer is \\boxed{85}.", turn=1)) == Done(0.0)
    # the last turn (the broker's, or the limit) and a turn cut by its budget end it: no code runs
    assert env.step(_turn(_qwen_call("print(1)"), last=True)) == Done(0.0)
    assert env.step(_turn(_qwen_call("print(1)"), turn=3)) == Done(0.0)
    assert env.step(_turn(_qwen_call("print(1)"), finish="length")) == Done(0.0)
    with pytest.raises(ValueError, match="max_turns"):
        PythonToolEnvironment(max_turns=0)
