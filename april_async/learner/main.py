"""``april learner``: one process of the learner's group (``learner.ranks``; the environment says which),
rank 0 the actor that talks to the broker and the broadcaster, the others its workers. Heavy modules
(torch) are imported in ``build``, once logging is set up."""

from __future__ import annotations

import functools

from april_async.learner.config import LearnerConfig
from april_async.runtime import StopFlag, exit_past_torch_teardown, run_actor


def build(cfg: LearnerConfig, distributed: list[bool] | None = None):
    """This process's part of the learner. ``distributed`` receives whether it formed a
    ``torch.distributed`` group as soon as it did, so that ``main`` knows to end past torch's teardown
    even when the actor then fails to start."""
    if cfg.wandb:  # refused before torch and transformers are imported: at once, not seconds later
        from april_async.learner.metrics import import_wandb

        import_wandb()
    from april_async.learner.actor import LearnerActor, RankWorker
    from april_async.learner.parallel import join
    from april_async.model.decoder import CheckpointError
    from april_async.transport.peer import peer_factory

    group = join(cfg)  # with learner.ranks > 1, one of several processes (the env names which)
    if distributed is not None:
        distributed.append(group.distributed)
    broadcaster = None if cfg.broadcaster is None else peer_factory(cfg.broadcaster, cfg.name, cfg.link)
    try:
        if group.rank > 0:
            return RankWorker(cfg, group)
        return LearnerActor(cfg, peer_factory(cfg.link.broker, cfg.name, cfg.link), broadcaster, group=group)
    except CheckpointError as e:
        raise ValueError(str(e)) from None


def main(cfg: LearnerConfig, stop: StopFlag) -> int:
    distributed: list[bool] = []
    code = run_actor("learner", cfg, functools.partial(build, distributed=distributed), stop)
    if any(distributed):
        exit_past_torch_teardown(code)  # a process that formed a torch.distributed group ends here
    return code
