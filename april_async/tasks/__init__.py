"""Tasks: where prompts come from and how an answer is checked.

``base`` (the ``Problem`` record), ``addchain`` (the built-in synthetic family, long-tailed
response lengths), ``math_answer`` (``#### 42`` / ``\\boxed{42}`` answers, addchain's),
``math_verified`` (answers checked with math-verify, the data sets'), ``datasets`` (JSONL and
Parquet files) and ``source`` (the broker's prompt stream). Nothing here imports an actor, so any
actor (and the warm start) may use it.
"""
