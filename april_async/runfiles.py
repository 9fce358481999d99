"""The files a run leaves in its directory, and their readers (used by ``april up``, the tools and the
tests alike; the learner writes ``metrics.jsonl`` through ``learner/metrics.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
"""One JSON object per learner step."""


def read_metrics(path: Path) -> list[dict]:
    """Every complete line of a ``metrics.jsonl`` (a line being written is skipped); [] if there is none.
    ``path`` may be the run directory or the file."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS
    rows = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_json(path: Path, default: Any = None) -> Any:
    """A JSON file another process replaces atomically; ``default`` while it is missing or half-written."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return default
