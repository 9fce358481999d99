"""The supervised warm start that ``april up`` runs when no initial policy is given: its settings
(``config``) and the training itself (``sft``). Not an actor: it runs once, before the actors start."""
