"""A lease the engine can never run is reported, not fatal: ``RequestRefused`` from ``submit``
becomes ``finished`` with reason ``"error"`` and the engine's words, and the generator goes on
with the leases behind it."""

from types import SimpleNamespace

import numpy as np

from april_async.config import LinkConfig
from april_async.engines.base import Engine, EngineCaps, RequestRefused
from april_async.generator.actor import GeneratorActor
from april_async.generator.config import GeneratorConfig
from april_async.wire import messages as m


class Picky(Engine):
    """Refuses any prompt with a token id of 99 or more; runs the rest (never steps them)."""

    name, slots, policy_version = "picky", 4, 0
    caps = EngineCaps(weights="none")

    def __init__(self):
        self.running = []

    def active(self) -> int:
        return len(self.running)

    def submit(self, request) -> None:
        if max(request.prompt) >= 99:
            raise RequestRefused(f"lease {request.lease_id}: token id {max(request.prompt)} is outside the vocabulary")
        self.running.append(request.lease_id)


class Sent:
    def __init__(self):
        self.messages = []

    def send(self, body) -> int:
        self.messages.append(body)
        return len(self.messages)


def lease(lease_id: int, prompt: list[int]) -> SimpleNamespace:
    body = m.Generate(lease_id=lease_id, sample_id=lease_id, group_id=1, prompt=np.asarray(prompt, dtype=np.int32),
                      resume=np.zeros(0, dtype=np.int32), max_new_tokens=4, min_policy_version=0)
    return SimpleNamespace(proto_version="1.7", body=body)


def test_a_refused_lease_is_finished_with_an_error_and_the_next_one_starts():
    sent = Sent()
    actor = GeneratorActor(GeneratorConfig(link=LinkConfig(keys=None)), Picky(), lambda on_connect: sent)
    actor.broker_proto = "1.7"
    actor.handle(lease(1, [5, 120]))
    actor.handle(lease(2, [5, 6]))
    actor._start_waiting()
    assert actor.engine.running == [2] and list(actor.work) == [2]
    [fin] = [b for b in sent.messages if isinstance(b, m.Finished)]
    assert (fin.lease_id, fin.reason, fin.offset, len(fin.tokens)) == (1, "error", 0, 0)
    assert "token id 120 is outside the vocabulary" in fin.error
