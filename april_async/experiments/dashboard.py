"""A Grafana dashboard (``launch/grafana/april.json``) drawn without Grafana: each panel's queries
run against Prometheus' HTTP API (``/api/v1/query_range``) and drawn as one matplotlib subplot,
placed as the dashboard's ``gridPos`` places it (``tools/render_dashboard.py`` is the command).

What is read of the dashboard model: ``panels`` (rows' nested ``panels`` too) with ``title``,
``gridPos``, ``targets`` (``expr``, ``legendFormat``, ``refId``, ``hide``), and from
``fieldConfig.defaults`` the ``unit`` and ``custom.stacking.mode`` (``normal``: stacked areas).
Legends substitute ``{{label}}`` as Grafana does; an empty one (or ``__auto``) shows the series'
selector. matplotlib is imported only when drawing; nothing here needs torch."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

GRID_COLUMNS = 24
"""Grafana's grid: 24 columns; a ``gridPos`` unit of height is 30 pixels."""
MAX_POINTS = 300
"""Points per series ``choose_step`` aims at (Prometheus refuses more than 11,000)."""


class QueryError(RuntimeError):
    """A query Prometheus did not answer: unreachable, an HTTP error or ``"status": "error"``."""


@dataclass
class Target:
    expr: str
    legend: str = ""
    ref: str = "A"


@dataclass
class Panel:
    title: str
    targets: list[Target]
    grid: tuple[int, int, int, int] = (0, 0, 12, 8)  # x, y, w, h
    unit: str = ""
    stacked: bool = False


@dataclass
class Series:
    label: str
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)  # NaN where Prometheus had no number


@dataclass
class Result:
    panel: Panel
    series: list[Series]

    @property
    def points(self) -> int:
        """Finite points over every series: a series of NaNs (a quantile of no observations) is no data."""
        return sum(1 for s in self.series for v in s.values if math.isfinite(v))


def load_dashboard(path: Path) -> tuple[str, list[Panel]]:
    """The dashboard's title and its time-series panels, in the order of the file."""
    model = json.loads(Path(path).read_text())
    panels = []

    def walk(items: list[dict]) -> None:
        for p in items:
            if p.get("type") == "row":
                walk(p.get("panels", []))
                continue
            targets = [Target(t["expr"], t.get("legendFormat", ""), t.get("refId", "A"))
                       for t in p.get("targets", []) if t.get("expr") and not t.get("hide")]
            if not targets:
                continue
            pos = p.get("gridPos", {})
            defaults = p.get("fieldConfig", {}).get("defaults", {})
            stacking = defaults.get("custom", {}).get("stacking", {}).get("mode", "none")
            panels.append(Panel(p.get("title", ""), targets,
                                (pos.get("x", 0), pos.get("y", 0), pos.get("w", 12), pos.get("h", 8)),
                                defaults.get("unit", ""), stacking == "normal"))

    walk(model.get("panels", []))
    return model.get("title", ""), panels


_FIELD = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def legend(fmt: str, labels: dict[str, str]) -> str:
    """A series' name as Grafana writes it: ``{{label}}`` replaced by the label's value (empty when
    the series has none); no format, or ``__auto``, gives ``name{label="value", ...}``."""
    if fmt and fmt != "__auto":
        return _FIELD.sub(lambda m: labels.get(m.group(1), ""), fmt)
    name = labels.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{name}{{{rest}}}" if rest or not name else name


def choose_step(start: float, end: float, points: int = MAX_POINTS) -> float:
    """A query step giving about ``points`` points over ``[start, end]``, whole seconds, at least 1."""
    return float(max(1, math.ceil((end - start) / points)))


def query_range(prometheus: str, expr: str, start: float, end: float, step: float,
                timeout_s: float = 30.0) -> list[dict]:
    """``/api/v1/query_range``'s ``result`` (a list of ``{"metric": ..., "values": [[t, "v"], ...]}``);
    a ``QueryError`` with Prometheus' own words when it fails."""
    form = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                   "step": f"{step:g}"})
    url = prometheus.rstrip("/") + "/api/v1/query_range"
    try:
        with urllib.request.urlopen(url, data=form.encode(), timeout=timeout_s) as r:
            body = r.read()
    except urllib.error.HTTPError as e:  # a bad query is a 400 with the error in its JSON body
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", detail)
        except json.JSONDecodeError:
            pass
        raise QueryError(f"HTTP {e.code} from {url}: {detail.strip()[:500]}") from None
    except (urllib.error.URLError, OSError) as e:
        raise QueryError(f"no answer from {url}: {getattr(e, 'reason', e)}") from None
    try:
        answer = json.loads(body)
    except json.JSONDecodeError:
        raise QueryError(f"{url} answered something other than JSON: {body[:200]!r}") from None
    if answer.get("status") != "success":
        raise QueryError(f"Prometheus: {answer.get('errorType', 'error')}: {answer.get('error', answer)}")
    return answer["data"]["result"]


def fetch(prometheus: str, panel: Panel, start: float, end: float, step: float) -> Result:
    """Every target of ``panel`` over the window: one ``Series`` per returned series. A failed query
    raises ``QueryError`` naming the panel and its expression."""
    series = []
    for t in panel.targets:
        try:
            found = query_range(prometheus, t.expr, start, end, step)
        except QueryError as e:
            raise QueryError(f"panel {panel.title!r}, query {t.ref} ({t.expr}): {e}") from None
        for s in found:
            values = s.get("values", [])
            series.append(Series(legend(t.legend, s.get("metric", {})), [float(ts) for ts, _ in values],
                                 [float(v) for _, v in values]))  # float() reads "NaN" and "+Inf"
    return Result(panel, series)


def layout(panels: list[Panel]) -> tuple[int, list[tuple[slice, slice]]]:
    """The grid's height in ``gridPos`` units and each panel's (rows, columns) in it: a matplotlib
    ``GridSpec(height, 24)`` indexed by these places the panels as Grafana does."""
    height = max((y + h for _, y, _, h in (p.grid for p in panels)), default=1)
    places = []
    for p in panels:
        x, y, w, h = p.grid
        x = min(max(0, x), GRID_COLUMNS - 1)
        places.append((slice(y, y + max(1, h)), slice(x, min(GRID_COLUMNS, x + max(1, w)))))
    return height, places


_UNITS = {"s": "seconds", "percentunit": "share", "short": "", "none": "", "bytes": "bytes", "Bps": "bytes/s"}


def draw(results: list[Result], out: Path, window: tuple[float, float], *, title: str = "",
         width_in: float = 16.0, dpi: int = 80) -> Path:
    """Every panel as a subplot at its ``gridPos``, one line per series (stacked areas for stacked
    panels), the x axis the ``window`` (Unix seconds) in minutes from its start; ``out`` written as
    a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.gridspec import GridSpec

    height, places = layout([r.panel for r in results])
    row_in = width_in / GRID_COLUMNS * 0.5  # a grid unit's height: Grafana's 30 px per unit on a wide screen
    fig = plt.figure(figsize=(width_in, max(2.0, height * row_in + (0.4 if title else 0))), dpi=dpi,
                     layout="constrained")
    grid = GridSpec(height, GRID_COLUMNS, figure=fig)
    t0, minutes = window[0], (window[1] - window[0]) / 60
    for result, (rows, cols) in zip(results, places):
        ax = fig.add_subplot(grid[rows, cols])
        ax.set_xlim(0, minutes)
        ax.set_title(result.panel.title, fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if result.panel.unit in _UNITS and _UNITS[result.panel.unit]:
            ax.set_ylabel(_UNITS[result.panel.unit], fontsize=7)
        if not result.points:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
            continue
        _plot(ax, result, t0)
        ax.set_xlabel("minutes", fontsize=7)
        ax.legend(fontsize=6, loc="upper left", ncol=2 if len(result.series) > 4 else 1, framealpha=0.6)
    if title:
        fig.suptitle(title, fontsize=11)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return out


def _plot(ax, result: Result, t0: float) -> None:
    import numpy as np

    if not result.panel.stacked:
        for s in result.series:
            few = sum(1 for v in s.values if math.isfinite(v)) < 3  # a line of one point shows nothing
            ax.plot([(t - t0) / 60 for t in s.times], s.values, lw=1.1, label=s.label,
                    marker="." if few else None)
        return
    # Stacked: the series on one time axis (each step's union), a missing point counting as 0.
    times = sorted({t for s in result.series for t in s.times})
    index = {t: i for i, t in enumerate(times)}
    ys = np.zeros((len(result.series), len(times)))
    for i, s in enumerate(result.series):
        for t, v in zip(s.times, s.values):
            ys[i, index[t]] = v if math.isfinite(v) else 0.0
    xs = [(t - t0) / 60 for t in times]
    if len(times) < 3:  # too few for areas: each series' top as points
        for s, top in zip(result.series, ys.cumsum(axis=0)):
            ax.plot(xs, top, marker="o", lw=1.1, label=s.label)
        return
    ax.stackplot(xs, ys, labels=[s.label for s in result.series], alpha=0.8)
