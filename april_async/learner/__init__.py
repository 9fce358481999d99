"""The learner actor: GRPO/DAPO/GSPO on batches from the broker (``actor``), its losses, checkpoints,
metrics and batch client, and its settings (``config``)."""
