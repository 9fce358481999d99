"""Prometheus endpoints: each actor can serve ``/metrics`` on a port of its own (``metrics.port``; off
unless set, any free port with 0).

An actor says what it has through one method, ``scrape(out: Families)``, called on the HTTP
server's thread at each scrape: it reads numbers the actor's own loop keeps (plain ints and floats,
or a snapshot its loop replaces whole), so a scrape costs the loop nothing and never sees a
half-made state. The histograms the loops fill (``Histogram``) are a list of counts and a sum,
updated without a lock by the one thread that owns them; a scrape copies the counts in one step.

Names follow Prometheus' conventions: ``april_<role>_<what>``, base units (``_seconds``,
``_bytes``), ``_total`` on counters, ``_ratio`` on fractions. Every sample carries the labels
``role`` and ``instance`` (the actor's name, ``n1-gen-0`` on a cluster): a Prometheus that scrapes
them keeps them with ``honor_labels: true`` (``launch/prometheus.yml``). Each process also exports
``process_*`` (CPU seconds, resident memory, open files) from ``prometheus_client``.

Discovery: once bound, an actor writes its target to ``metrics.targets_file`` in the format of
Prometheus' ``file_sd_configs`` (``[{"targets": ["host:port"], "labels": {...}}]``; ``april up``
puts them in ``<run.dir>/prometheus/``), and deletes it when it stops.

This module imports no torch; ``prometheus_client`` is imported when an endpoint starts.
"""

from __future__ import annotations

import json
import math
import os
import socket
from bisect import bisect_left
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from april_async.config import MetricsConfig

SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
"""Buckets for durations from a broker's message (tens of microseconds) to a long trajectory."""


class Histogram:
    """Counts of observations at or under each bound (Prometheus' ``le``), their sum and count.

    One thread observes; any thread may read ``snapshot``. ``observe`` is a bisect and two adds,
    cheap enough for every message a broker handles."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float] = SECONDS_BUCKETS):
        self.bounds = tuple(float(b) for b in bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must increase: {self.bounds}")
        self.counts = [0] * (len(self.bounds) + 1)  # the last: over every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def add_counts(self, per_bucket: Iterable[int], total: float) -> None:
        """Many observations at once: ``per_bucket[i]`` of them in bucket ``i`` (not cumulative),
        summing to ``total``."""
        for i, n in enumerate(per_bucket):
            self.counts[i] += int(n)
        self.sum += total

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative ``(le, count)`` pairs ending with ``+Inf``, and the sum."""
        counts, total = list(self.counts), self.sum  # one copy: the buckets agree with each other
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), counts):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(bound), running))
        return out, total


class Families:
    """What one scrape exports, built by an actor's ``scrape(out)``: each call adds one sample."""

    def __init__(self, role: str, instance: str):
        self.base = {"role": role, "instance": instance}
        self._families: dict[str, tuple[str, str, list[str], list]] = {}

    def gauge(self, name: str, help: str, value: float | None, **labels: Any) -> None:
        self._add("gauge", name, help, labels, value)

    def counter(self, name: str, help: str, value: float | None, **labels: Any) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r}: a counter's name ends in _total")
        self._add("counter", name, help, labels, value)

    def histogram(self, name: str, help: str, hist: Histogram, **labels: Any) -> None:
        self._add("histogram", name, help, labels, hist.snapshot())

    def _add(self, kind: str, name: str, help: str, labels: dict, value) -> None:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return  # not known (yet): no sample rather than a made-up one
        names = [*self.base, *sorted(labels)]
        fam = self._families.setdefault(name, (kind, help, names, []))
        if fam[0] != kind or fam[2] != names:
            raise ValueError(f"metric {name!r}: added as {fam[0]} {fam[2]}, now as {kind} {names}")
        fam[3].append(
            ([str(v) for v in self.base.values()] + [str(labels[k]) for k in sorted(labels)], value)
        )

    def collect(self) -> list:
        """The families as ``prometheus_client`` builds its exposition from them."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        out = []
        for name, (kind, help, names, samples) in self._families.items():
            if kind == "gauge":
                fam = GaugeMetricFamily(name, help, labels=names)
                for values, v in samples:
                    fam.add_metric(values, float(v))
            elif kind == "counter":
                fam = CounterMetricFamily(name, help, labels=names)
                for values, v in samples:
                    fam.add_metric(values, float(v))
            else:
                fam = HistogramMetricFamily(name, help, labels=names)
                for values, (buckets, total) in samples:
                    fam.add_metric(values, buckets, sum_value=total)
            out.append(fam)
        return out


class Source(Protocol):
    def scrape(self, out: Families) -> None: ...


class _Collector:
    """The registry's view of one actor: its ``scrape`` at each scrape. A scrape that fails is a bug
    in the actor's method; it is logged, and that scrape is answered without the actor's metrics
    (a metrics endpoint must never stop an actor)."""

    def __init__(self, source: Source, role: str, instance: str, log):
        self.source, self.role, self.instance, self.log = source, role, instance, log
        self.failures = 0

    def collect(self):
        out = Families(self.role, self.instance)
        try:
            self.source.scrape(out)
            return out.collect()
        except Exception as e:  # see the class docstring
            self.failures += 1
            if self.failures <= 3:
                self.log.error("metrics_failed", error=f"{type(e).__name__}: {e}")
            return []


class MetricsServer:
    """One actor's ``/metrics``: ``start`` binds ``cfg.port`` at ``cfg.bind`` (``OSError`` naming them
    when it cannot) and writes the target file; ``close`` stops serving and deletes it."""

    def __init__(self, cfg: MetricsConfig, source: Source, *, role: str, instance: str, log):
        self.cfg, self.role, self.instance, self.log = cfg, role, instance, log
        self.source = source
        self.port: int | None = None
        self._server = self._thread = None

    def start(self) -> int:
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        registry.register(_Collector(self.source, self.role, self.instance, self.log))
        try:
            self._server, self._thread = start_http_server(
                self.cfg.port, addr=self.cfg.bind, registry=registry
            )
        except OSError as e:
            raise OSError(
                e.errno, f"metrics.port {self.cfg.port} at {self.cfg.bind}: {e.strerror or e}"
            ) from None
        self.port = self._server.server_address[1]
        self._write_target()
        self.log.info("metrics_serving", url=f"http://{self.target}/metrics")
        return self.port

    @property
    def target(self) -> str:
        host = self.cfg.address or self.cfg.bind
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def _write_target(self) -> None:
        path = self.cfg.targets_file
        if path is None:
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(
            json.dumps([{"targets": [self.target], "labels": {"role": self.role, "instance": self.instance}}])
        )
        tmp.replace(path)

    def close(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        if self.cfg.targets_file is not None:
            Path(self.cfg.targets_file).unlink(missing_ok=True)


def serve(cfg: MetricsConfig | None, actor: Any, *, role: str, instance: str, log) -> MetricsServer | None:
    """Start ``actor``'s endpoint when ``cfg.port`` is set and the actor has ``scrape`` (a learner's
    rank above 0 has none: rank 0 speaks for the group); None otherwise."""
    if cfg is None or cfg.port is None or not hasattr(actor, "scrape"):
        return None
    server = MetricsServer(cfg, actor, role=role, instance=instance, log=log)
    server.start()
    return server
