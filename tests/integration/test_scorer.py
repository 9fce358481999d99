"""The scorer: a reward that raises, hangs past its time limit, returns NaN or text, or kills its
worker is answered with a typed error, and the scorer carries on (and keeps heartbeating).

The reward functions below are loaded by path (``tests.integration.test_scorer:...``) inside the
real worker process.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np

from april_async.agents.env import Continue, Done, Trajectory, Turn
from april_async.tasks.addchain_calc import CalcEnvironment
from april_async.config import LinkConfig
from april_async.model.tokenizer import CharTokenizer
from april_async.scorer.config import ScorerConfig
from april_async.scorer.rewards import RewardInput, Unparsed
from april_async.scorer.worker import RewardWorker
from april_async.tasks.math_verified import WORST_CASE_S
from april_async.transport.hub import Hub
from april_async.wire import messages as m
from april_async.testing.cluster import FAST_LINK, Cluster

HERE = "tests.integration.test_scorer"
TIMEOUT_S = 1.0


def reward_raises(x: RewardInput) -> float:
    raise RuntimeError(f"boom on {x.response_text!r}")


def reward_hangs(x: RewardInput) -> float:
    time.sleep(60)
    return 1.0


def reward_nan(x: RewardInput) -> float:
    return float("nan")


def reward_text(x: RewardInput) -> float:
    return "high"  # type: ignore[return-value]


def reward_exits(x: RewardInput) -> float:
    os._exit(3)


def reward_length(x: RewardInput) -> float:
    return len(x.response_text)


def reward_slow(x: RewardInput) -> float:
    time.sleep(3.0)  # a slow tool, or a hard answer to verify
    return 0.5


def reward_unparsed(x: RewardInput) -> float:
    raise Unparsed(f"nothing in {x.response_text!r}")


class EnvTwoTurns:
    """A tool call on the first turn, the reward on the second."""

    def step(self, t: Trajectory):
        return Continue(f"= {t.step_id}") if t.turn == 0 else Done(1.0)


class EnvRaises:
    def step(self, t: Trajectory):
        raise RuntimeError(f"tool broke at {t.step_id}")


class EnvHangs:
    def step(self, t: Trajectory):
        time.sleep(60)


class EnvJunk:
    def step(self, t: Trajectory):
        return 5


class EnvExits:
    def step(self, t: Trajectory):
        os._exit(4)


class EnvLogged:
    """The calculator, writing each step it runs to ``meta["log"]`` (a tool with a side effect)."""

    def step(self, t: Trajectory):
        with open(t.meta["log"], "a") as f:
            f.write(t.step_id + "\n")
        return CalcEnvironment().step(t)


def steps_of(*texts: str, meta: dict | None = None) -> Trajectory:
    turns = [Turn(policy_ids=[5], observation_ids=[6] if i < len(texts) - 1 else [], policy_text=text)
             for i, text in enumerate(texts)]
    return Trajectory(sample_id=3, prompt_ids=[1], turns=turns, finish_reason="stop", task="t",
                      meta=meta or {})


def test_an_environments_steps_run_in_the_worker_and_each_failure_has_its_kind():
    envs = [f"{HERE}:{name}" for name in ("EnvTwoTurns", "EnvRaises", "EnvHangs", "EnvJunk", "EnvExits",
                                         "NoSuchEnv")] + ["april_async.tasks.addchain_calc:CalcEnvironment"]
    worker = RewardWorker([], environments=envs, timeout_s=TIMEOUT_S)
    try:
        first = worker.run(f"{HERE}:EnvTwoTurns", steps_of("call"))
        assert (first.kind, first.observation, first.reward) == ("continued", "= 3:0", None), first
        assert worker.run(f"{HERE}:EnvTwoTurns", steps_of("call", "answer")).reward == 1.0
        calc = "april_async.tasks.addchain_calc:CalcEnvironment"
        assert worker.run(calc, steps_of("calc{17+8x5}", meta={"answer": "57"})).observation == "\n= 57\n"
        assert worker.run(calc, steps_of("calc{17+8x5}", "#### 57", meta={"answer": "57"})).reward == 1.0
        cases = {"EnvRaises": ("env_error", r"raised RuntimeError: tool broke at 3:0"),
                 "EnvHangs": ("env_timeout", r"EnvHangs ran past 1 s"),
                 "EnvJunk": ("bad_step", r"returned int 5, not Continue\(\.\.\.\) or Done"),
                 "EnvExits": ("env_error", r"the reward worker died \(exit code 4\)"),
                 "NoSuchEnv": ("env_error", r"has no 'NoSuchEnv'")}
        for name, (kind, detail) in cases.items():
            out = worker.run(f"{HERE}:{name}", steps_of("x"))
            assert out.kind == kind and re.search(detail, out.error), out
            assert worker.run(f"{HERE}:EnvTwoTurns", steps_of("x")).kind == "continued"  # served after it
    finally:
        worker.close()


def sample(text: str = "#### 7") -> RewardInput:
    return RewardInput(prompt_ids=[1], response_ids=[5], prompt_text="q", response_text=text,
                       finish_reason="stop", task="t", meta={})


def test_worker_answers_every_failure_with_its_kind_and_recovers():
    paths = [f"{HERE}:{name}" for name in ("reward_raises", "reward_hangs", "reward_nan", "reward_text",
                                          "reward_exits", "reward_length", "reward_unparsed")]
    worker = RewardWorker(paths, timeout_s=TIMEOUT_S)
    try:
        ok = worker.run(f"{HERE}:reward_length", sample("abc"))
        assert ok.reward == 3.0 and ok.kind == "scored"
        unparsed = worker.run(f"{HERE}:reward_unparsed", sample("??"))  # reward 0, no error, no restart
        assert (unparsed.kind, unparsed.reward, unparsed.error) == ("unparsed", 0.0, None), unparsed
        assert unparsed.unparsed == f"{HERE}:reward_unparsed: nothing in '??'"
        cases = {"reward_raises": ("reward_error", r"raised RuntimeError: boom on '#### 7'"),
                 "reward_hangs": ("reward_timeout", r"reward_hangs ran past 1 s"),
                 "reward_nan": ("bad_reward", r"returned nan"),
                 "reward_text": ("bad_reward", r"returned str 'high', not a number"),
                 "reward_exits": ("reward_error", r"the reward worker died \(exit code 3\)")}
        for name, (kind, detail) in cases.items():
            t0 = time.monotonic()
            out = worker.run(f"{HERE}:{name}", sample())
            assert out.reward is None and out.kind == kind and re.search(detail, out.error), out
            assert time.monotonic() - t0 < TIMEOUT_S + 5
            after = worker.run(f"{HERE}:reward_length", sample("abcd"))  # the next call is served
            assert after.reward == 4.0, (name, after)
        assert worker.restarts == 2  # the hung worker and the one that exited
    finally:
        worker.close()


def test_math_verify_in_the_worker_scores_a_pathological_answer_0_within_its_bound():
    # The worker calls rewards in its main thread, so math-verify's own time limits hold there and
    # fire before the scorer's default limit: 0, and no worker killed.
    path = "april_async.scorer.rewards:math_verify"

    def math(text: str, answer: str) -> RewardInput:
        return RewardInput([1], [5], "q", text, "stop", "math", {"answer": answer})

    worker = RewardWorker([path], timeout_s=ScorerConfig().timeout_s)
    try:
        first = worker.run(path, math(r"so $\boxed{\frac{1}{2}}$", "0.5"))
        assert (first.kind, first.reward) == ("scored", 1.0), first
        t0 = time.monotonic()
        out = worker.run(path, math(r"$\boxed{9^{9^{9^{9}}}}$", "1"))  # verify: a number of ~10^8 digits
        assert (out.kind, out.reward) == ("scored", 0.0), out
        assert time.monotonic() - t0 < WORST_CASE_S + 2 and worker.restarts == 0
        garbage = worker.run(path, math("no idea", "1"))
        assert (garbage.kind, garbage.reward) == ("unparsed", 0.0), garbage
    finally:
        worker.close()


def score_request(sample_id: int, task: str, text: str, meta: dict | None = None) -> m.ScoreRequest:
    tok = CharTokenizer()
    return m.ScoreRequest(sample_id=sample_id, lease_id=100 + sample_id, group_id=sample_id,
                          prompt=np.asarray(tok.encode("3+4x1\n", bos=True), dtype=np.int32),
                          response=np.asarray(tok.encode(text) + [tok.eos_id], dtype=np.int32),
                          finish_reason="stop", task=task, meta=meta or {})


def wait_for_hello(hub: Hub, cluster: Cluster) -> tuple[bytes, m.Hello]:
    """The scorer's identity on ``hub`` and its ``hello``, within 30 s of its start."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for ident, msg in hub.poll(0.1):
            if isinstance(msg.body, m.Hello):
                return ident, msg.body
    raise AssertionError(f"the scorer never said hello\n{cluster.dump_logs()}")


def test_scorer_process_retires_failures_by_kind_and_keeps_serving(tmp_path):
    cluster = Cluster(tmp_path)
    link = LinkConfig(**{k.split(".")[1]: v for k, v in FAST_LINK.items()})
    hub = Hub(cluster.endpoint, link=link)
    try:
        cluster.scorer(**{"timeout_s": TIMEOUT_S, "rewards.raises": f"{HERE}:reward_raises",
                          "rewards.hangs": f"{HERE}:reward_hangs", "rewards.nan": f"{HERE}:reward_nan"})
        identity, hello = wait_for_hello(hub, cluster)
        assert hello.role == "scorer", cluster.dump_logs()
        requests = [score_request(1, "addchain", "1) 3+4=7\n#### 7", {"answer": "7"}),
                    score_request(2, "raises", "x"),
                    score_request(3, "hangs", "x"),
                    score_request(4, "nan", "x"),
                    score_request(5, "math", "#### 8", {"answer": "7"}),
                    score_request(6, "scripted", "ab"),  # parity of 3 tokens (with <eos>)
                    score_request(7, "math", "#### 7", {}),  # no answer in meta
                    score_request(8, "math", "so x = 1/2", {"answer": r"\frac{1}{2}"}),  # math-verify
                    score_request(9, "math", "no idea", {"answer": "7"})]  # unparsed: 0, not an error
        for req in requests:
            hub.send(identity, req)
        answers: dict[int, m.Scored] = {}
        deadline = time.monotonic() + 20 + TIMEOUT_S
        while len(answers) < len(requests) and time.monotonic() < deadline:
            hub.send(identity, m.Heartbeat())
            for _, msg in hub.poll(0.05):
                if isinstance(msg.body, m.Scored):
                    answers[msg.body.sample_id] = msg.body
            assert hello.instance not in [*hub.expired_peers(time.monotonic())], "the scorer went silent"
        assert len(answers) == len(requests), cluster.dump_logs()
        assert all(answers[r.sample_id].lease_id == r.lease_id for r in requests)
        assert answers[1].reward == 1.0 and answers[5].reward == 0.0 and answers[6].reward == 0.0
        assert (answers[8].reward, answers[9].reward, answers[9].error) == (1.0, 0.0, None)
        kinds = {i: (answers[i].error or "").split(":")[0] for i in (2, 3, 4, 7)}
        assert kinds == {2: "reward_error", 3: "reward_timeout", 4: "bad_reward", 7: "reward_error"}
        assert "meta has no 'answer'" in answers[7].error
    finally:
        codes = cluster.stop_all()
        hub.close()
    assert codes == {"scorer-0": 0}, cluster.dump_logs()
    log = cluster.logs["scorer-0"].read_text()
    assert re.search(r"stopped .*bad_reward=1 .*reward_error=2 .*reward_timeout=1 .*scored=4 .*unparsed=1", log), log[-2000:]


def test_a_slow_reward_holds_only_its_own_worker(tmp_path):
    """Two workers (the default): the rewards queued behind a slow one are answered while it runs,
    and it is answered too, last."""
    cluster = Cluster(tmp_path)
    link = LinkConfig(**{k.split(".")[1]: v for k, v in FAST_LINK.items()})
    hub = Hub(cluster.endpoint, link=link)
    try:
        cluster.scorer(**{"timeout_s": 10.0, "workers": 2, "rewards.slow": f"{HERE}:reward_slow",
                          "rewards.len": f"{HERE}:reward_length"})
        identity, hello = wait_for_hello(hub, cluster)
        requests = [score_request(1, "slow", "x")] + [score_request(i, "len", "ab" * i) for i in range(2, 8)]
        for req in requests:
            hub.send(identity, req)
        order: list[int] = []
        answers: dict[int, m.Scored] = {}
        deadline = time.monotonic() + 30
        while len(answers) < len(requests) and time.monotonic() < deadline:
            hub.send(identity, m.Heartbeat())
            for _, msg in hub.poll(0.05):
                if isinstance(msg.body, m.Scored):
                    answers[msg.body.sample_id] = msg.body
                    order.append(msg.body.sample_id)
        assert len(answers) == len(requests), cluster.dump_logs()
        assert order[-1] == 1 and sorted(order[:-1]) == list(range(2, 8)), order
        assert answers[1].reward == 0.5 and all(answers[i].reward == 2 * i for i in range(2, 8))
    finally:
        cluster.stop_all()
        hub.close()


def test_the_scorer_steps_an_environment_and_answers_a_resent_step_from_its_cache(tmp_path):
    cluster = Cluster(tmp_path)
    link = LinkConfig(**{k.split(".")[1]: v for k, v in FAST_LINK.items()})
    hub = Hub(cluster.endpoint, link=link)
    tok = CharTokenizer()
    log = tmp_path / "steps.log"
    meta = {"answer": "57", "log": str(log)}

    def turn_request(sample_id, lease_id, turns, observations, takes=True, task="calc"):
        ids, context = [], []
        for k, text in enumerate(turns):
            ids += tok.encode(text)
            if k < len(observations):
                context.append(m.TokenSpan(len(ids), len(tok.encode(observations[k]))))
                ids += tok.encode(observations[k])
        return m.ScoreRequest(sample_id=sample_id, lease_id=lease_id, group_id=sample_id,
                              prompt=np.asarray(tok.encode("17+8x5\n", bos=True), dtype=np.int32),
                              response=np.asarray(ids, dtype=np.int32), finish_reason="stop", task=task,
                              meta=meta, turn=len(observations), context=context, takes_observation=takes)
    try:
        cluster.scorer(**{"timeout_s": 10.0, "environments.calc": f"{HERE}:EnvLogged",
                          "environments.stubborn": f"{HERE}:EnvTwoTurns"})
        identity, hello = wait_for_hello(hub, cluster)

        def ask(req) -> m.Scored:
            hub.send(identity, req)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                hub.send(identity, m.Heartbeat())
                for _, msg in hub.poll(0.05):
                    if isinstance(msg.body, m.Scored) and msg.body.sample_id == req.sample_id:
                        return msg.body
            raise AssertionError(cluster.dump_logs())

        first = ask(turn_request(1, 10, ["calc{17+8x5}"], []))
        assert first.observation == tok.encode("\n= 57\n") and first.reward is None, first
        again = ask(turn_request(1, 10, ["calc{17+8x5}"], []))  # the broker's re-send: from the cache
        assert again.observation == first.observation
        assert log.read_text().splitlines() == ["1:0:10"]  # the tool ran once
        done = ask(turn_request(1, 11, ["calc{17+8x5}", "#### 57"], ["\n= 57\n"]))
        assert done.reward == 1.0, done
        last = ask(turn_request(2, 20, ["calc{1+1}"], [], takes=False))  # the broker's last turn: it ends
        assert last.reward == 0.0, last
        unasked = ask(turn_request(4, 40, ["x"], [], takes=False, task="stubborn"))  # goes on regardless
        assert unasked.error.startswith("bad_step: the environment went on"), unasked
        bad = ask(m.ScoreRequest(sample_id=3, lease_id=30, group_id=3, prompt=np.asarray([1], dtype=np.int32),
                                 response=np.asarray(tok.encode("#### 57"), dtype=np.int32),
                                 finish_reason="stop", task="calc", meta=meta, turn=1))
        assert bad.error.startswith("env_error: cannot decode the tokens (ValueError: turn 1 with 0"), bad
        assert log.read_text().splitlines() == ["1:0:10", "1:1:11", "2:0:20"]
    finally:
        cluster.stop_all()
        hub.close()
