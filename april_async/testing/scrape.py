"""Reading a run's Prometheus endpoints as Prometheus would: the target files the actors write
(``<run.dir>/prometheus/*.json``, ``file_sd_configs`` format) and the text format they serve,
parsed by ``prometheus_client``'s own parser."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path


def targets(run_dir: Path) -> dict[str, dict]:
    """Each actor's target by instance: ``{"url": ..., "labels": {...}}``, from the files written so far."""
    out = {}
    for path in sorted((Path(run_dir) / "prometheus").glob("*.json")):
        try:
            entries = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # being replaced
        for entry in entries:
            labels = entry["labels"]
            for target in entry["targets"]:
                out[labels["instance"]] = {"url": f"http://{target}/metrics", "labels": labels}
    return out


class Scraped:
    """One scrape: every sample by name and labels."""

    def __init__(self, text: str):
        from prometheus_client.parser import text_string_to_metric_families

        self.text = text
        self.types: dict[str, str] = {}
        self.samples: list[tuple[str, dict, float]] = []
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.samples.append((s.name, dict(s.labels), s.value))

    def all(self, name: str, **labels) -> list[tuple[dict, float]]:
        return [
            (ls, v)
            for n, ls, v in self.samples
            if n == name and all(ls.get(k) == str(want) for k, want in labels.items())
        ]

    def value(self, name: str, **labels) -> float:
        """The one sample of ``name`` with ``labels`` (an ``AssertionError`` naming it if not exactly one)."""
        found = self.all(name, **labels)
        assert len(found) == 1, f"{name} {labels}: {len(found)} samples\n{self.text[-3000:]}"
        return found[0][1]

    def total(self, name: str, **labels) -> float:
        """The sum of ``name``'s samples with ``labels``."""
        return sum(v for _, v in self.all(name, **labels))


def scrape(url: str, timeout_s: float = 10.0) -> Scraped:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        assert r.status == 200, f"{url}: HTTP {r.status}"
        return Scraped(r.read().decode())
