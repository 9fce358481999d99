"""The scorer actor: pulls score requests from the broker and answers each with ``scored``.

Per request: decode the tokens with the run's tokenizer, pick the task's reward (``rewards`` entry,
else the built-in task's, else ``reward``), run it in the worker process under ``timeout_s``, and
answer ``scored`` with the reward, or with ``error="<kind>: <detail>"`` when the reward raised
(``reward_error``), ran past its time (``reward_timeout``) or returned something that is not a
finite number (``bad_reward``). The broker retires the sample's group and counts it by that kind;
the scorer counts each kind too, and carries on. A response the reward could read no answer in
(it raised ``Unparsed``) is answered with reward 0 and counted as ``unparsed`` (apart from
``scored``). Requests go to a pool of ``workers`` reward processes, each to the first free one in
the order they came, and are answered as each ends (a slow call holds only its own worker); the
loop keeps polling the broker (heartbeats) while rewards run.

Start:  april scorer --config run.toml   (section [scorer])
"""

from __future__ import annotations

import time
from collections import Counter, deque

from april_async.agents.env import StepCache, Trajectory, Turn, load_environment
from april_async.logs import get_logger
from april_async.runtime import incarnation
from april_async.model.tokenizer import load_tokenizer
from april_async.scorer.config import ScorerConfig
from april_async.scorer.rewards import BUILTIN_TASK_REWARDS, RewardInput, load_reward, reward_path
from april_async.scorer.worker import OUTCOME_KINDS, Outcome, RewardWorker
from april_async.wire import messages as m

WAIT_SLICE_S = 0.02
"""While a reward runs, wait this long for it between polls of the broker."""
STATS_EVERY_S = 30.0
"""Log the counters this often (when they changed)."""


class ScorerActor:
    def __init__(self, cfg: ScorerConfig, peer_factory):
        self.cfg = cfg
        self.log = get_logger(actor="scorer", instance=cfg.name)
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        paths = sorted({cfg.reward, *cfg.rewards.values(), *BUILTIN_TASK_REWARDS.values()})
        for path in paths:
            load_reward(path)  # a bad path fails here, at start, naming it
        environments = sorted(set(cfg.environments.values()))
        for path in environments:
            load_environment(path)  # likewise (made once here, then once in each worker)
        self.workers = [RewardWorker(paths, timeout_s=cfg.timeout_s, environments=environments)
                        for _ in range(cfg.workers)]
        self.steps = StepCache()  # each step's answer, for a request the broker sends again
        self.counts: Counter[str] = Counter({k: 0 for k in OUTCOME_KINDS})
        self.queue: deque[tuple[str, m.ScoreRequest]] = deque()
        self.running: dict[int, tuple[str, m.ScoreRequest]] = {}  # worker index -> its call
        self._stats_at, self._stats_logged = time.monotonic(), dict(self.counts)
        self.peer = peer_factory(self._on_connect)

    def _on_connect(self, peer) -> None:
        peer.send(m.Hello(role="scorer", instance=self.cfg.name, capacity=self.cfg.capacity,
                          incarnation=incarnation()))

    # ------------------------------------------------------------------ loop

    def run(self, stop) -> None:
        self.log.info("serving", reward=self.cfg.reward, rewards=self.cfg.rewards,
                      timeout_s=self.cfg.timeout_s, workers=len(self.workers))
        try:
            while not stop:
                busy = bool(self.running) or bool(self.queue)
                msg = self.peer.poll(0.0 if busy else self.cfg.link.heartbeat_interval_s / 4)
                if msg is not None and isinstance(msg.body, m.ScoreRequest):
                    self.queue.append((msg.msg_id, msg.body))
                self._advance(WAIT_SLICE_S)
                self._log_stats()
        finally:
            for worker in self.workers:
                worker.close()
        self.peer.send(m.Bye(reason="shutdown"))
        self.peer.close()
        self.log.info("stopped", restarts=self.restarts, **self.counts)

    def scrape(self, out) -> None:
        """``/metrics`` (``april_async.telemetry``): calls by outcome, the queue, the workers."""
        for kind, n in list(self.counts.items()):
            out.counter("april_scorer_calls_total", "Reward and environment calls, by outcome (scored, "
                        "unparsed, continued, or an error kind)", n, outcome=kind)
        out.gauge("april_scorer_queued", "Score requests waiting for a worker", len(self.queue))
        out.gauge("april_scorer_running", "Score requests being run", len(self.running))
        out.gauge("april_scorer_workers", "Worker processes", len(self.workers))
        out.counter("april_scorer_worker_restarts_total", "Worker processes started again (a crash, a "
                    "timeout)", self.restarts)

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)

    def _advance(self, wait_s: float) -> None:
        """Hand queued requests to free workers, in order; answer every call that ended, waiting up
        to ``wait_s`` in all for the first."""
        for i, worker in enumerate(self.workers):
            while not worker.busy and self.queue:
                call = self.queue.popleft()
                outcome = self._submit(worker, call[1])
                if outcome is None:
                    self.running[i] = call
                else:  # could not even be prepared: answered now, the worker is still free
                    self._answer(call, outcome)
        for n, i in enumerate(sorted(self.running)):
            outcome = self.workers[i].wait(wait_s if n == 0 else 0.0)
            if outcome is not None:
                self._answer(self.running.pop(i), outcome)

    def _submit(self, worker: RewardWorker, req: m.ScoreRequest) -> Outcome | None:
        """Hand ``req`` to ``worker``; an outcome now when it cannot even be prepared, or (a step the
        broker sent again) when it was answered before."""
        env = self.cfg.environments.get(req.task)
        if env is not None:
            cached = self.steps.get(req.sample_id, req.turn)
            if cached is not None and cached[0] == req.lease_id:
                return cached[1]
        try:
            x = self._input(req) if env is None else self._trajectory(req)
        except Exception as e:  # a tokenizer that cannot decode these ids: the sample's error
            kind = "reward_error" if env is None else "env_error"
            return Outcome(error=f"{kind}: cannot decode the tokens ({type(e).__name__}: {e})")
        worker.submit(env or reward_path(req.task, default=self.cfg.reward, overrides=self.cfg.rewards), x)
        return None

    def _answer(self, call: tuple[str, m.ScoreRequest], outcome: Outcome) -> None:
        msg_id, req = call
        if req.task in self.cfg.environments and outcome.error is None:  # a failure is no answer: a step
            self.steps.put(req.sample_id, req.turn, (req.lease_id, outcome))  # sent again runs again
        self.peer.send(self._scored(req, outcome), parent_id=msg_id)

    def _scored(self, req: m.ScoreRequest, outcome: Outcome) -> m.Scored:
        self.counts[outcome.kind] += 1
        if outcome.error is not None:
            self.log.warning("reward_failed", sample_id=req.sample_id, task=req.task, kind=outcome.kind,
                             error=outcome.error)
            return m.Scored(sample_id=req.sample_id, lease_id=req.lease_id, error=outcome.error)
        if outcome.observation is not None:
            if not req.takes_observation:
                error = ("bad_step: the environment went on (Continue), but this request takes no "
                         "observation (a broker older than protocol 1.9, or a trajectory at its last turn)")
                self.log.warning("reward_failed", sample_id=req.sample_id, task=req.task, kind="bad_step",
                                 error=error)
                return m.Scored(sample_id=req.sample_id, lease_id=req.lease_id, error=error)
            try:
                ids = observation_ids(self.tokenizer, req, outcome.observation)
            except Exception as e:  # noqa: BLE001 - the sample's error, not the scorer's
                error = f"env_error: cannot render the observation ({type(e).__name__}: {e})"
                self.log.warning("reward_failed", sample_id=req.sample_id, task=req.task, kind="env_error",
                                 error=error)
                return m.Scored(sample_id=req.sample_id, lease_id=req.lease_id, error=error)
            return m.Scored(sample_id=req.sample_id, lease_id=req.lease_id, observation=ids)
        if outcome.unparsed is not None:  # early in a run, most samples: counted, logged only at debug
            self.log.debug("reward_unparsed", sample_id=req.sample_id, task=req.task,
                           detail=outcome.unparsed)
        return m.Scored(sample_id=req.sample_id, lease_id=req.lease_id, reward=outcome.reward)

    def _input(self, req: m.ScoreRequest) -> RewardInput:
        prompt, response = req.prompt.tolist(), req.response.tolist()
        return RewardInput(prompt_ids=prompt, response_ids=response, prompt_text=self.tokenizer.decode(prompt),
                           response_text=self.tokenizer.decode(response), finish_reason=req.finish_reason,
                           task=req.task, meta=dict(req.meta))

    def _trajectory(self, req: m.ScoreRequest) -> Trajectory:
        """The request as an environment sees it: the response split at its context spans (the
        observations) into turns, each policy turn's text decoded."""
        if req.turn != len(req.context):
            raise ValueError(f"turn {req.turn} with {len(req.context)} observation span(s): a response of "
                             f"turn k holds k observations")
        response = req.response.tolist()
        turns, at = [], 0
        for k, span in enumerate([*req.context, None]):
            end = len(response) if span is None else span.offset
            observation = [] if span is None else response[span.offset:span.offset + span.count]
            turns.append(Turn(policy_ids=response[at:end], observation_ids=observation,
                              policy_text=self.tokenizer.decode(response[at:end])))
            at = end if span is None else span.offset + span.count
        prompt = req.prompt.tolist()
        return Trajectory(sample_id=req.sample_id, prompt_ids=prompt, turns=turns,
                          finish_reason=req.finish_reason, task=req.task, meta=dict(req.meta),
                          prompt_text=self.tokenizer.decode(prompt), lease_id=req.lease_id,
                          last_turn=not req.takes_observation)

    def _log_stats(self) -> None:
        now = time.monotonic()
        if now - self._stats_at < STATS_EVERY_S:
            return
        self._stats_at = now
        if dict(self.counts) != self._stats_logged:
            self._stats_logged = dict(self.counts)
            self.log.info("progress", queued=len(self.queue), running=len(self.running),
                          restarts=self.restarts, **self.counts)

    # ------------------------------------------------------------------ one request, blocking

    def score(self, req: m.ScoreRequest) -> m.Scored:
        """Score one request to completion (at most ``timeout_s`` plus a worker start)."""
        worker = self.workers[0]
        outcome = self._submit(worker, req)
        if outcome is None:
            outcome = worker.result()
        return self._scored(req, outcome)


def observation_ids(tokenizer, req: m.ScoreRequest, observation: str | dict) -> list[int]:
    """An environment's answer to the turn ``req`` carries, as the ids the broker appends.

    A tokenizer without a chat template (the built-in one): the answer's text, encoded alone. One
    with a template: the template's delta for the tool's message after the turn's sampled ids
    (``agents.chat.ChatRenderer.observation_ids``), over the conversation the prompt was rendered
    from (``meta["messages"]``, which the broker adds to a trajectory's prompt) with the task's
    tools (``meta["tools"]``) — so that the prompt, the sampled ids and the observations are what the
    template renders for the whole conversation, and nothing sampled is tokenized again. The
    conversation holds the first prompt and this turn: a template that renders a message
    differently for the turns between them is not one this reproduces (the renderer refuses the
    ones it can tell: a turn rewritten, a tool message dropped)."""
    message = {"role": "tool", "content": observation} if isinstance(observation, str) else dict(observation)
    if not getattr(tokenizer, "chat_template", False):
        return list(tokenizer.encode(message["content"]))
    from april_async.agents.chat import ChatRenderer

    messages = req.meta.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("the tool's message is rendered after the conversation so far, and meta has no "
                         "'messages' (the broker adds them to a trajectory task's prompt rendered with the "
                         "chat template; a prompt given as ids has none)")
    last = req.context[-1] if req.context else None
    sampled = req.response.tolist()[last.offset + last.count if last is not None else 0:]
    return ChatRenderer(tokenizer, tools=req.meta.get("tools")).observation_ids(messages, sampled, message)
