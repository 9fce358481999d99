"""Errors of the model package that torch-free code raises too (the tokenizer, which the broker
and the scorer load without importing torch)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and, where it applies, the tensor."""
