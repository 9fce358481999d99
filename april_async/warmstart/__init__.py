"""The supervised warm start that ``april up`` runs when no initial policy is given: its settings
(``config``) and the training itself (``sft``). Not an actor: it runs once, before the actors start."""


class WarmStartStopped(Exception):
    """The warm start was asked to stop (its ``stop()`` said so, e.g. after a Ctrl-C of ``april up``)
    before it finished; nothing was written. Here, not in ``sft``, so that catching it imports no torch."""
