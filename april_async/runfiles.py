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


CHILDREN = "children.json"
"""``april up``'s children: name -> kind, pid (None while waiting for a restart), restarts, log."""


def per_node(name: str, node: str) -> str:
    """``name`` as one host of a cluster writes it (``children.json`` -> ``children-n1.json``): the hosts
    share the run directory, and one file for all would hold only the last writer's rows."""
    if not node:
        return name
    stem, dot, ext = name.partition(".")
    return f"{stem}-{node}{dot}{ext}"


def read_children(run_dir: Path) -> dict[str, dict]:
    """Every host's children files (``children.json``, ``children-<node>.json``) as one mapping; actor
    names are unique across hosts (``APRIL_NODE`` prefixes them). {} while there is none."""
    rows: dict[str, dict] = {}
    for path in sorted(Path(run_dir).glob("children*.json")):
        rows.update(read_json(path, {}) or {})
    return rows
