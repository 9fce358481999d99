"""The reward worker: reward functions and environment steps run in a child process, one call at a
time, with a time limit.

A reward is user code: it may raise, hang, or return something that is not a number. The scorer
never runs it in its own process: it hands each call to a ``RewardWorker`` and polls for the
outcome between its other work (so heartbeats keep flowing while a reward runs). A call past its
deadline gets the worker killed and replaced; a worker that dies is replaced too. Each outcome
is a reward, a reward of 0 for a response the reward could not parse (it raised ``Unparsed``), or
an error ``"<kind>: <detail>"`` with kind one of ``ERROR_KINDS``.

A call is a reward's when it carries a ``RewardInput``, an environment's step when it carries a
``Trajectory`` (``april_async.agents.env``): the step's outcome is a reward (``Done``) or an
observation (``Continue``: ``Outcome.observation``), and its errors have kinds of their own
(``env_error``, ``env_timeout``, ``bad_step``).

The child is started with ``spawn`` (a clean interpreter: nothing of the scorer's sockets), imports
every configured reward once at start, and exits when the scorer goes away (its pipe closes, and
on Linux the parent-death signal kills it even mid-call).
"""

from __future__ import annotations

import math
import multiprocessing
import numbers
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

from april_async.agents.env import BadStep, Done, Trajectory, checked, load_environment
from april_async.runtime import die_with_parent
from april_async.scorer.rewards import RewardInput, Unparsed, load_reward

ERROR_KINDS = ("reward_error", "reward_timeout", "bad_reward", "env_error", "env_timeout", "bad_step")
"""reward_error: the function raised (or its worker died); reward_timeout: it ran past the
limit; bad_reward: it returned something that is not a finite number. The same three for an
environment's step: env_error, env_timeout, bad_step (neither ``Continue`` nor ``Done``, or
malformed: ``agents.env.checked``)."""
OUTCOME_KINDS = ("scored", "unparsed", "continued", *ERROR_KINDS)
"""What each call ends as: scored (a reward), unparsed (reward 0: the reward raised ``Unparsed``),
continued (an environment's step answered with an observation) or an error."""
UNPARSED_REWARD = 0.0
WORKER_START_TIMEOUT_S = 60.0
"""A worker that is not ready this long after its start (importing the rewards) is given up."""
KILL_GRACE_S = 2.0


@dataclass(frozen=True)
class Outcome:
    reward: float | None = None
    error: str | None = None  # "<kind>: <detail>"
    unparsed: str | None = None
    """Why the reward read no answer in the response (its ``Unparsed``); the reward is then 0."""
    observation: str | dict | None = None
    """An environment's step went on (``Continue``): the tool's answer, for the next turn."""

    @property
    def kind(self) -> str:
        """One of ``OUTCOME_KINDS``."""
        if self.error is not None:
            return self.error.split(":", 1)[0]
        if self.observation is not None:
            return "continued"
        return "scored" if self.unparsed is None else "unparsed"


class RewardWorker:
    """``submit`` one call, then poll ``wait`` for its ``Outcome`` (or block: ``result``, ``run``)."""

    def __init__(self, paths: Iterable[str], *, timeout_s: float,
                 start_timeout_s: float = WORKER_START_TIMEOUT_S, environments: Iterable[str] = ()):
        self.paths = tuple(paths)
        self.environments = tuple(environments)
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._proc = None
        self._conn = None
        self._ready = False
        self._started_at = 0.0
        self._call: tuple[str, RewardInput] | None = None
        self._deadline: float | None = None  # set once the call is handed to a ready worker
        self.restarts = 0
        """Workers given up (killed at a time limit, or dead) and replaced."""
        self._spawn()

    @property
    def busy(self) -> bool:
        return self._call is not None

    def submit(self, path: str, x: RewardInput | Trajectory) -> None:
        if self._call is not None:
            raise RuntimeError("the reward worker is busy: wait for its outcome before the next call")
        self._call = (path, x)
        if self._proc is None:
            self._spawn()
        if self._ready:
            self._send()

    def wait(self, timeout_s: float) -> Outcome | None:
        """The outcome of the submitted call, or None if it is still running after ``timeout_s``."""
        if self._call is None:
            raise RuntimeError("nothing was submitted to the reward worker")
        until = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            if not self._ready:
                if now - self._started_at > self.start_timeout_s:
                    self._kill()
                    self.restarts += 1
                    return self._finish(Outcome(error=f"reward_error: the reward worker did not start within "
                                                      f"{self.start_timeout_s:g} s"))
                if not self._poll(min(until, self._started_at + self.start_timeout_s) - now):
                    if time.monotonic() >= until:
                        return None
                    continue
                try:
                    self._conn.recv()  # "ready"
                except (EOFError, OSError):
                    return self._finish(self._died())
                self._ready = True
                self._send()
                continue
            if now >= self._deadline:
                path, x = self._call
                self._kill()
                self.restarts += 1
                self._spawn()  # warm for the next call
                kind = "env_timeout" if isinstance(x, Trajectory) else "reward_timeout"
                return self._finish(Outcome(error=f"{kind}: {path} ran past {self.timeout_s:g} s"))
            if not self._poll(min(until, self._deadline) - now):
                if time.monotonic() >= until:
                    return None
                continue
            try:
                status, value = self._conn.recv()
            except (EOFError, OSError):
                return self._finish(self._died())
            if status == "ok":
                return self._finish(Outcome(reward=value))
            if status == "unparsed":
                return self._finish(Outcome(reward=UNPARSED_REWARD, unparsed=value))
            if status == "continue":
                return self._finish(Outcome(observation=value))
            return self._finish(Outcome(error=f"{status}: {value}"))

    def result(self) -> Outcome:
        """Wait for the submitted call's outcome (at most the start and call time limits)."""
        while (outcome := self.wait(1.0)) is None:
            pass
        return outcome

    def run(self, path: str, x: RewardInput | Trajectory) -> Outcome:
        """``submit`` and wait for the outcome."""
        self.submit(path, x)
        return self.result()

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(None)  # "exit"
        except OSError:
            pass
        self._proc.join(KILL_GRACE_S)
        self._kill()

    # ------------------------------------------------------------------ internals

    def _spawn(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=serve, args=(child, self.paths, self.environments), daemon=True,
                                       name="reward-worker")
        self._proc.start()
        child.close()
        self._conn, self._ready, self._started_at = parent, False, time.monotonic()

    def _send(self) -> None:
        self._deadline = time.monotonic() + self.timeout_s
        try:
            self._conn.send(self._call)
        except OSError:
            pass  # the worker died while idle: the pipe reads as closed, and ``wait`` reports it

    def _poll(self, timeout_s: float) -> bool:
        try:
            return self._conn.poll(max(0.0, timeout_s))
        except (EOFError, OSError):
            return True  # recv will see the end

    def _died(self) -> Outcome:
        self._proc.join(KILL_GRACE_S)
        code = self._proc.exitcode
        self._kill()
        self.restarts += 1
        kind = "env_error" if isinstance(self._call[1], Trajectory) else "reward_error"
        return Outcome(error=f"{kind}: the reward worker died (exit code {code}) in {self._call[0]}")

    def _kill(self) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(KILL_GRACE_S)
        self._conn.close()
        self._proc.close()
        self._proc = self._conn = None
        self._ready = False

    def _finish(self, outcome: Outcome) -> Outcome:
        self._call = self._deadline = None
        return outcome


def serve(conn, paths: tuple[str, ...], environments: tuple[str, ...] = ()) -> None:
    """The worker process: import the rewards and make the environments, then answer
    ``(path, RewardInput | Trajectory)`` calls until told to stop (``None``) or the scorer goes away."""
    die_with_parent(signal.SIGKILL)  # a closed pipe ends an idle worker anyway; a busy one needs this
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the scorer's to handle
    rewards, broken, envs = {}, {}, {}
    for path in paths:
        try:
            rewards[path] = load_reward(path)
        except Exception as e:  # the scorer checked the paths; report what still fails per call
            broken[path] = f"{type(e).__name__}: {e}"
    for path in environments:
        try:
            envs[path] = load_environment(path)
        except Exception as e:
            broken[path] = f"{type(e).__name__}: {e}"
    conn.send(("ready", None))
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):
            return
        if call is None:
            return
        path, x = call
        step = isinstance(x, Trajectory)
        conn.send(_step(envs, broken, path, x) if step else _call(rewards, broken, path, x))


def _loaded(cache: dict, broken: dict, path: str, load) -> tuple[object, str | None]:
    """``path``'s function or environment, loaded once per worker; or why it cannot be."""
    if path in broken:
        return None, broken[path]
    if path not in cache:
        try:
            cache[path] = load(path)
        except Exception as e:
            return None, f"{type(e).__name__}: {e}"
    return cache[path], None


def _step(envs: dict, broken: dict, path: str, t: Trajectory) -> tuple[str, object]:
    env, why = _loaded(envs, broken, path, load_environment)
    if why is not None:
        return "env_error", why
    try:
        value = env.step(t)
    except BaseException as e:  # user code: anything it raises is the sample's error, not the worker's
        return "env_error", f"{path} raised {type(e).__name__}: {e}"
    try:
        step = checked(value, where=path)
    except BadStep as e:
        return "bad_step", str(e)
    return ("ok", step.reward) if isinstance(step, Done) else ("continue", step.observation)


def _call(rewards: dict, broken: dict, path: str, x: RewardInput) -> tuple[str, object]:
    fn, why = _loaded(rewards, broken, path, load_reward)
    if why is not None:
        return "reward_error", why
    try:
        value = fn(x)
    except Unparsed as e:  # the response's fault, not the reward's: scored 0
        return "unparsed", f"{path}: {e}"
    except BaseException as e:  # user code: anything it raises is the sample's error, not the worker's
        return "reward_error", f"{path} raised {type(e).__name__}: {e}"
    if isinstance(value, str | bytes) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        return "bad_reward", f"{path} returned {type(value).__name__} {value!r:.80}, not a number"
    try:
        reward = float(value)
    except Exception as e:
        return "bad_reward", f"{path} returned {type(value).__name__} that float() refuses ({e})"
    if not math.isfinite(reward):
        return "bad_reward", f"{path} returned {reward}"
    return "ok", reward

