"""The figures of an experiment and of a sweep. matplotlib (the ``bench`` extra) is imported inside
each function, so that nothing else here needs it."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from april_async.experiments.grid import Settings, shown_mode
from april_async.experiments.numbers import Row, moving_average

DPI = 80


def _colors(cells: list[dict]) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    return {c["cell"]: ("black" if c["cell"] == "sync" else cmap(i % 10)) for i, c in enumerate(cells)}


def _band(runs: list[dict], axis: int, grid: list[float], k: int) -> tuple[list, list, list]:
    """Mean, lowest and highest over runs of the moving-average reward, sampled on ``grid``. A run
    holds its last value from its last step to the grid's end: the right edge is then the mean over
    every seed of what the table calls the final reward, not over the seeds that happen to have a
    step there (issue 43: a curve ended 0.1 above its table)."""
    import numpy as np

    ys = []
    for r in runs:
        xs = [p[axis] for p in r["curve"]]
        ma = moving_average([p[2] for p in r["curve"]], k)
        pts = [(x, m) for x, m in zip(xs, ma) if m is not None]
        if len(pts) < 2:
            continue
        px, py = zip(*pts)
        y = np.interp(grid, px, py, left=np.nan)
        ys.append(y)
    if not ys:
        return [], [], []
    a = np.vstack(ys)
    with warnings.catch_warnings():  # a column where no run has a point yet is NaN, as meant
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(a, 0), np.nanmin(a, 0), np.nanmax(a, 0)


def plot_experiment(cfg: Settings, cells: list[dict], runs: list[dict], out: Path) -> list[str]:
    """Draw an experiment's figures into ``out``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = []
    colors = _colors(cells)

    for axis, xlabel, fname in [(0, "wall time from the first learner step (s)", "reward_vs_time.png"),
                                (1, "samples trained", "reward_vs_samples.png")]:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        series = reward_series(cfg, cells, runs, axis)
        for c in cells:
            if c["cell"] in series:
                grid, mean, lo, hi = series[c["cell"]]
                ax.plot(grid, mean, color=colors[c["cell"]], label=c["label"], linewidth=1.6)
                ax.fill_between(grid, lo, hi, color=colors[c["cell"]], alpha=0.15, linewidth=0)
        for lv in cfg.levels:
            ax.axhline(lv, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"reward ({cfg.ma_steps}-step moving average)")
        ax.set_title(f"reward vs {'wall time' if axis == 0 else 'samples'} (band: lowest to highest seed)",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=DPI)
        plt.close(fig)
        names.append(fname)

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.8 / max(1, len(cfg.levels))
    for j, lv in enumerate(cfg.levels):
        key = f"t_{lv:g}"
        xs = np.arange(len(cells)) + (j - (len(cfg.levels) - 1) / 2) * width
        vals = [c[key] if c[key] is not None else 0.0 for c in cells]
        bars = ax.bar(xs, vals, width, yerr=[c[f"{key}_sd"] or 0.0 for c in cells], capsize=3,
                      label=f"reward {lv:g}", alpha=0.85, color=f"C{j}")
        for x, b, c in zip(xs, bars, cells):
            n_ok, n_hit = c["runs_ok"], c[f"{key}_reached"]
            if n_hit == 0:  # not reached in the window: an empty bar to the window's end
                ax.bar(x, cfg.duration_s, width, fill=False, hatch="//", edgecolor=f"C{j}", linewidth=0.5)
            text = "never" if n_hit == 0 else (f"{n_hit}/{n_ok}" if n_hit < n_ok else "")
            if text:
                ax.text(x, cfg.duration_s if n_hit == 0 else b.get_height(), text, ha="center", va="bottom",
                        fontsize=7)
    ax.axhline(cfg.duration_s, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xticks(range(len(cells)), [c["label"] for c in cells], rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("seconds to reach (mean ± sd)")
    ax.set_title(f"time to reward ({cfg.ma_steps}-step moving average); dotted: the window", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "time_to_reward.png", dpi=DPI)
    plt.close(fig)
    names.append("time_to_reward.png")

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    bottom = np.zeros(len(cells))
    for key, label, color in [("wait_frac", "waiting for a batch", "tab:orange"),
                              ("train_frac", "training", "tab:blue"), ("handoff_frac", "hand-off", "tab:green")]:
        vals = np.array([c[key] or 0.0 for c in cells])
        ax.bar(range(len(cells)), vals, bottom=bottom, label=label, color=color)
        bottom += vals
    ax.set_xticks(range(len(cells)), [c["label"] for c in cells], rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("share of the window")
    ax.set_ylim(0, 1.05)
    ax.set_title("the learner's time, per cell", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "time_split.png", dpi=DPI)
    plt.close(fig)
    names.append("time_split.png")

    n = len(cells)
    ncols = min(4, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.6 * ncols, 2.0 * nrows), squeeze=False)
    top = max((int(k) for c in cells for k in c["staleness_tokens"]), default=0)
    for ax, c in zip(axes.flat, cells):
        hist = {int(k): v for k, v in c["staleness_tokens"].items()}
        total = sum(hist.values())
        ax.bar(list(hist), [v / total for v in hist.values()] if total else [], color=colors[c["cell"]])
        ax.set_xlim(-0.6, top + 0.6)
        ax.set_ylim(0, 1)
        ax.set_title(c["label"], fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.supxlabel("lag of a trained token (versions)", fontsize=8)
    fig.supylabel("share of tokens", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=DPI)
    plt.close(fig)
    names.append("staleness.png")

    lines: dict[str, list[dict]] = {}  # cells that differ only in η: one line each
    for c in cells:
        if c["mode"] != "sync":
            if c.get("given_name") or c.get("groups_scale", 1) != 1:  # a control: a line of its own
                lines.setdefault(c["label"], []).append(c)
                continue
            extra = f" {c['over_bound']}" if c["over_bound"] != "abort" else ""
            shown = shown_mode(c["mode"], c["boundary"], c.get("admission", "continuous"))
            lines.setdefault(f"{shown} r={c['r']:g}{extra}", []).append(c)
    if any(len({c["eta"] for c in group}) > 1 for group in lines.values()):
        fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
        sync = next((c for c in cells if c["cell"] == "sync"), None)
        for ax, key, label, scale in [(axes[0], "tokens_per_s", "trained tokens / s", 1.0),
                                      (axes[1], "off_policy_frac", "off-policy token share", 1.0)]:
            for name, group in lines.items():
                group.sort(key=lambda c: c["eta"])
                ax.errorbar([c["eta"] for c in group], [(c[key] or math.nan) * scale for c in group],
                            yerr=[(c[f"{key}_sd"] or 0.0) * scale for c in group], marker="o", capsize=2,
                            label=name, linestyle="-" if name.startswith("april") else ":")
            if sync is not None and sync[key] is not None:
                ax.axhline(sync[key] * scale, color="black", linestyle="--", label="sync")
            ax.set_xlabel("staleness bound η")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "eta.png", dpi=DPI)
        plt.close(fig)
        names.append("eta.png")
    return names


def eval_series(cfg: Settings, cells: list[dict], runs: list[dict]) -> dict[str, tuple]:
    """Each cell's held-out reward on a grid over the window: (grid, mean, lowest, highest) over its
    seeds. A run holds its last checkpoint's reward to the window's end, so the right edge is the mean
    of every seed's ``eval_final``, the table's number (before issue 43 a run whose last checkpoint
    came early left the mean, and the recomputed cell's curve ended at 0.52 beside a table's 0.405)."""
    import numpy as np

    grid = np.linspace(0, cfg.duration_s, 100)
    out = {}
    for c in cells:
        ys = [np.interp(grid, [p[0] for p in r["eval_curve"]], [p[2] for p in r["eval_curve"]])
              for r in runs if r["cell"] == c["cell"] and r["status"] == "ok" and r.get("eval_curve")]
        if ys:
            a = np.vstack(ys)
            out[c["cell"]] = (grid, a.mean(0), a.min(0), a.max(0))
    return out


def reward_series(cfg: Settings, cells: list[dict], runs: list[dict], axis: int = 0) -> dict[str, tuple]:
    """Each cell's moving-average batch reward against time (``axis`` 0) or samples (1): (grid, mean,
    lowest, highest) over its seeds (``_band``)."""
    import numpy as np

    ok = [r for r in runs if r["status"] == "ok" and r.get("curve")]
    top = max((r["curve"][-1][axis] for r in ok), default=1.0)
    grid = np.linspace(0, top, 200)
    out = {}
    for c in cells:
        mean, lo, hi = _band([r for r in ok if r["cell"] == c["cell"]], axis, grid, cfg.ma_steps)
        if len(mean):
            out[c["cell"]] = (grid, mean, lo, hi)
    return out


def plot_eval(cfg: Settings, cells: list[dict], runs: list[dict], out: Path) -> str:
    """Held-out reward against wall time: mean over seeds, a band from the lowest to the highest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = _colors(cells)
    many = len(cells) > 8  # a legend beside the axes, not over the lines
    fig, ax = plt.subplots(figsize=(9.0 if many else 6.4, 4.0))
    series = eval_series(cfg, cells, runs)
    for c in cells:
        if c["cell"] not in series:
            continue
        grid, mean, lo, hi = series[c["cell"]]
        ax.plot(grid, mean, color=colors[c["cell"]], label=c["label"], linewidth=1.6,
                linestyle="--" if c.get("over_bound") == "drop" else "-")
        ax.fill_between(grid, lo, hi, color=colors[c["cell"]], alpha=0.15, linewidth=0)
    ax.set_xlabel("wall time from the first learner step (s)")
    ax.set_ylabel(f"held-out reward ({cfg.eval_problems} problems)")
    ax.set_title("held-out reward vs wall time (band: lowest to highest seed)", fontsize=10)
    ax.grid(alpha=0.3)
    if many:
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "eval_vs_time.png", dpi=DPI)
    plt.close(fig)
    return "eval_vs_time.png"


# ---------------------------------------------------------------------- a sweep's figures


def _value(row: Row, key: str) -> float:
    v = row.values.get(key)
    return math.nan if row.status != "ok" or v is None else float(v)


def plot_sweep(rows: list[Row], out: Path, backend: str) -> list[str]:
    """A sweep's figures; returns the notes (what was skipped and why)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    notes = []
    unit = "useful tokens / simulated s" if backend == "sim" else "useful tokens / s"
    for key, label, name in [("tokens_per_s", unit, "throughput_vs_eta.png"),
                             ("off_policy_frac", "off-policy token fraction", "offpolicy_vs_eta.png")]:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        lines: dict[tuple[str, float], list[Row]] = {}
        for row in rows:
            if row.cell.mode == "sync":
                ax.axhline(_value(row, key), color="black", linestyle="--", label="sync (r=1, η=0)")
            else:
                lines.setdefault((row.cell.mode, row.cell.r), []).append(row)
        for (mode, r), group in lines.items():
            group.sort(key=lambda x: x.cell.eta)
            ax.plot([x.cell.eta for x in group], [_value(x, key) for x in group], marker="o",
                    linestyle="-" if mode == "april" else ":", label=f"{mode} r={r:g}")
        etas = sorted({row.cell.eta for row in rows if row.cell.mode != "sync"})
        if etas:
            ax.set_xticks(etas)
        ax.set_xlabel("staleness bound η")
        ax.set_ylabel(label)
        ax.set_title(f"{label} against η ({backend})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)

    n = len(rows)
    cols = min(4, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.5 * nrows), squeeze=False)
    for ax, row in zip(axes.flat, rows):
        total = sum(row.staleness.values())
        lags = sorted(row.staleness)
        ax.bar(lags, [row.staleness[k] / total for k in lags] if total else [], color="tab:blue")
        ax.set_xticks(range(0, max(lags, default=0) + 1))
        ax.set_xlim(-0.6, max(lags, default=0) + 0.6)
        ax.set_title(row.cell.name, fontsize=9)
        ax.set_xlabel("lag (versions)", fontsize=8)
        ax.set_ylabel("share of tokens", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"delivered tokens by staleness ({backend})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=110)
    plt.close(fig)

    if backend == "sim":
        notes.append("rewards.png: not drawn for --sim (the simulator trains nothing)")
    else:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for row in rows:
            if row.rewards:
                ax.plot(range(1, len(row.rewards) + 1), row.rewards, label=row.cell.name, linewidth=1)
        ax.set_xlabel("learner step")
        ax.set_ylabel("reward (mean of the batch)")
        ax.set_title("reward per step, per cell")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "rewards.png", dpi=110)
        plt.close(fig)
    return notes
