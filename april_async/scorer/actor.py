"""The scorer actor: pulls score requests from the broker and answers each with ``scored``.

A reward function that raises is answered with ``scored.error`` (the broker retires the group
and counts the reason); the scorer itself carries on.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from april_async.config import LinkConfig, LogConfig
from april_async.logs import get_logger
from april_async.scorer.rewards import load_reward
from april_async.wire import messages as m


class ScorerConfig(BaseModel):
    """The ``[scorer]`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "scorer-0"
    link: LinkConfig = LinkConfig()
    reward: str = "april_async.scorer.rewards:parity_reward"
    """The reward function, as ``package.module:function``."""
    capacity: int = Field(16, ge=1)
    """Score requests taken at once."""
    log: LogConfig = LogConfig()


class ScorerActor:
    def __init__(self, cfg: ScorerConfig, peer_factory):
        self.cfg = cfg
        self.reward = load_reward(cfg.reward)
        self.log = get_logger(actor="scorer", instance=cfg.name)
        self.scored = 0
        self.failed = 0
        self.peer = peer_factory(self._on_connect)

    def _on_connect(self, peer) -> None:
        peer.send(m.Hello(role="scorer", instance=self.cfg.name, capacity=self.cfg.capacity))

    def run(self, stop) -> None:
        while not stop:
            msg = self.peer.poll(self.cfg.link.heartbeat_interval_s / 4)
            if msg is not None and isinstance(msg.body, m.ScoreRequest):
                self.peer.send(self.score(msg.body), parent_id=msg.msg_id)
        self.peer.send(m.Bye(reason="shutdown"))
        self.peer.close()
        self.log.info("stopped", scored=self.scored, failed=self.failed)

    def score(self, req: m.ScoreRequest) -> m.Scored:
        try:
            reward = float(self.reward(req.prompt.tolist(), req.response.tolist(), req.task, req.meta))
            if not np.isfinite(reward):
                raise ValueError(f"reward is {reward}")
        except Exception as e:  # a user's plug-in: any failure is reported, never fatal
            self.failed += 1
            self.log.warning("reward_failed", sample_id=req.sample_id, error=repr(e))
            return m.Scored(sample_id=req.sample_id, lease_id=req.lease_id, error=f"{type(e).__name__}: {e}")
        self.scored += 1
        return m.Scored(sample_id=req.sample_id, lease_id=req.lease_id, reward=reward)
