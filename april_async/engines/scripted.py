"""The *scripted test engine*: a stand-in for a model, for tests and benchmarks of the runtime.

It is named as such everywhere it appears. Tokens are deterministic — token ``p`` of sample
``s`` is ``(s * 31 + p) % vocab + 1`` with log-prob ``-0.01 * (p % 7) - 0.1`` — so a test can
check every delivered token. Each sample's true response length is ``lengths[s % len(lengths)]``
(a long tail is a list with a few large values), and a resumed partial continues toward the same
end. A decode step takes ``step_s_fixed + step_s_per_seq × active`` seconds of real time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from april_async.engines.base import Engine, EngineCaps, EngineOutput, EngineRequest
from april_async.engines.config import ScriptedEngineConfig


def scripted_token(sample_id: int, position: int, vocab: int) -> int:
    return (sample_id * 31 + position) % vocab + 1


def scripted_logprob(position: int) -> float:
    return -0.01 * (position % 7) - 0.1


@dataclass
class _Active:
    request: EngineRequest
    position: int  # response position of the next token
    target: int


class ScriptedEngine(Engine):
    """The scripted test engine (see the module docstring)."""

    name = "scripted"
    caps = EngineCaps(weights="none")  # its version is the broker's: no weights to wait for

    def __init__(self, cfg: ScriptedEngineConfig):
        self.cfg = cfg
        self.slots = cfg.slots
        self.policy_version = 0
        self._active: dict[int, _Active] = {}

    def submit(self, request: EngineRequest) -> None:
        if len(self._active) >= self.slots:
            raise RuntimeError(f"scripted engine: all {self.slots} slots are busy (lease {request.lease_id})")
        target = self.cfg.lengths[request.sample_id % len(self.cfg.lengths)]
        self._active[request.lease_id] = _Active(request, len(request.resume), target)

    def active(self) -> int:
        return len(self._active)

    def step(self) -> list[EngineOutput]:
        if not self._active:
            return []
        delay = self.cfg.step_s_fixed + self.cfg.step_s_per_seq * len(self._active)
        if delay:
            time.sleep(delay)
        outs = []
        for lid, a in list(self._active.items()):
            r = a.request
            tok = scripted_token(r.sample_id, a.position, self.cfg.vocab)
            out = EngineOutput(lid, [tok], [scripted_logprob(a.position)], [self.policy_version])
            a.position += 1
            if a.position >= a.target or tok in r.stop_token_ids:
                out.finish = "stop"
            elif a.position - len(r.resume) >= r.max_new_tokens:
                out.finish = "length"
            if out.finish:
                del self._active[lid]
            outs.append(out)
        return outs

    def abort(self, lease_id: int) -> EngineOutput:
        self._active.pop(lease_id, None)
        return EngineOutput(lease_id, finish="abort")
