"""What a run left in its directory, as numbers: an experiment's run over its training window
(``run_numbers``; the module docstring of ``tools/experiment.py`` defines each), a sweep's cell
(``engine_numbers``); reward levels and the times and trained samples to reach them; the reward
split by response length; a cell's mean and spread over seeds."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from april_async.experiments.grid import Cell, Settings

COLUMNS = ("cell", "backend", "mode", "r", "eta", "status", "tokens_per_s", "groups_per_s", "off_policy_frac",
           "discarded_frac", "reward_mean", "reward_last", "steps", "wall_s")


@dataclass
class Row:
    """One cell of a sweep: its numbers, staleness histogram and reward curve."""

    cell: Cell
    backend: str
    status: str = "ok"
    values: dict = field(default_factory=dict)
    staleness: dict[int, int] = field(default_factory=dict)  # lag -> delivered tokens
    rewards: list[float] = field(default_factory=list)  # reward_mean per learner step

    def flat(self) -> dict:
        out = {"cell": self.cell.name, "backend": self.backend, "mode": self.cell.mode, "r": self.cell.r,
               "eta": self.cell.eta, "status": self.status}
        for key in COLUMNS:
            out.setdefault(key, self.values.get(key))
        return out


def engine_numbers(run_dir: Path) -> tuple[dict, dict[int, int], list[float]]:
    """Throughput, off-policy and discarded shares, rewards: from what ``april up`` left in ``run_dir``."""
    from april_async.runfiles import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        raise ValueError("metrics.jsonl has no learner step")
    ledger = json.loads((run_dir / "broker_state.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    c = ledger["counters"]
    rewards = [float(r["reward_mean"]) for r in rows]
    k = max(1, len(rows) // 4)
    values = {"steps": len(rows), "wall_s": summary.get("wall_s"),
              "reward_mean": sum(rewards) / len(rewards), "reward_last": sum(rewards[-k:]) / k,
              "off_policy_frac": c["off_policy_tokens"] / max(1, c["tokens_delivered"]),
              "discarded_frac": c["tokens_discarded"] / max(1, c["tokens_generated"])}
    span = rows[-1]["time"] - rows[0]["time"]
    if len(rows) >= 2 and span > 0:  # from the end of the first step to the end of the last
        values["tokens_per_s"] = sum(r["tokens"] for r in rows[1:]) / span
        values["groups_per_s"] = sum(r["groups"] for r in rows[1:]) / span
    staleness = {int(lag): int(n) for lag, n in c.get("staleness_tokens", {}).items()}
    return values, staleness, rewards


# ---------------------------------------------------------------------- an experiment's run


def run_numbers(run_dir: Path, cfg: Settings) -> dict:
    """One run's numbers over its window (see the module's docstring)."""
    from april_async.runfiles import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    if len(rows) < 2:
        raise ValueError(f"metrics.jsonl has {len(rows)} learner steps (2 or more needed)")
    n = json.loads((run_dir / "config" / "broker.json").read_text())["rollout"]["group_size"]
    t_first = rows[0]["time"]
    rows = [r for r in rows if r["time"] - t_first <= cfg.duration_s + 1e-6]
    win = rows[1:]  # the steps that end inside the window
    span = cfg.duration_s
    t = [r["time"] - t_first for r in rows]
    rewards = [float(r["reward_mean"]) for r in rows]
    samples = []
    acc = 0
    for r in rows:
        acc += int(r["groups"]) * n
        samples.append(acc)
    tokens = sum(int(r["tokens"]) for r in win)
    out: dict[str, Any] = {
        "steps": len(win), "tokens_per_s": tokens / span, "samples": samples[-1] - samples[0],
        "reward_first": statistics.fmean(rewards[:cfg.ma_steps]),
        "reward_final": statistics.fmean(rewards[-cfg.ma_steps:]),
        "off_policy_frac": sum(float(r.get("off_policy_frac", 0.0)) * int(r["tokens"]) for r in win) / max(1, tokens),
        "ess": statistics.fmean(float(r["ess"]) for r in win) if all("ess" in r for r in win) else None,
        "ess_min": min(float(r["ess"]) for r in win) if all("ess" in r for r in win) else None,
        "lag_mean": sum(float(r.get("lag_mean", 0.0)) * int(r["tokens"]) for r in win) / max(1, tokens),
        "wait_frac": sum(float(r["wait_s"]) for r in win) / span,
        "train_frac": sum(float(r["train_s"]) for r in win) / span,
        "handoff_frac": sum(float(r["step_s"]) - float(r["train_s"]) for r in win) / span,
        "step_s_mean": statistics.fmean(float(r["wait_s"]) + float(r["step_s"]) for r in win),
    }
    for level in cfg.levels:
        out[f"t_{level:g}"] = time_to(list(zip(t, rewards)), level, cfg.ma_steps)
    first, last = rows[0], rows[-1]
    if "tokens_generated" in last and "tokens_generated" in first:
        gen = last["tokens_generated"] - first["tokens_generated"]
        out["gen_tokens_per_s"] = gen / span
        out["discarded_frac"] = (last.get("tokens_discarded", 0) - first.get("tokens_discarded", 0)) / max(1, gen)
        if "tokens_retired" in last and "tokens_retired" in first:  # a learner before 2026-11-25 left it out
            out["retired_frac"] = (last["tokens_retired"] - first["tokens_retired"]) / max(1, gen)
    out.update(generator_shares(run_dir, t_first, t_first + span))
    ledger_file = run_dir / "broker_state.json"
    if ledger_file.is_file():
        state = json.loads(ledger_file.read_text())
        c = state["counters"]
        clock = state.get("sample_seconds") or {}  # a broker before issue 45 left it out
        if clock.get("p99") is not None:
            out["sample_p50_s"], out["sample_p99_s"] = clock["p50"], clock["p99"]
            turns = {int(k): v for k, v in clock.get("turns", {}).items()}
            out["multi_turn_frac"] = sum(v for k, v in turns.items() if k > 1) / max(1, sum(turns.values()))
        out["staleness_tokens"] = {str(k): int(v) for k, v in sorted(c.get("staleness_tokens", {}).items(),
                                                                      key=lambda kv: int(kv[0]))}
        out.setdefault("discarded_frac", c["tokens_discarded"] / max(1, c["tokens_generated"]))
        out.setdefault("retired_frac", c.get("tokens_retired", 0) / max(1, c["tokens_generated"]))
    out["curve"] = [[round(ti, 2), s, round(rw, 4)] for ti, s, rw in zip(t, samples, rewards)]
    hist = length_hist(win)
    if hist:
        out["length_hist"] = hist
    return out


BUSY_FIELDS = ("busy_s", "slot_s", "slots", "t", "tokens", "mixed_tokens")
"""What a generator's ``busy`` line carries (``tokens`` and ``mixed_tokens`` since 2026-11-26)."""


def busy_lines(log: Path) -> list[dict[str, float]]:
    """A generator log's ``busy`` records (console or JSON lines), as numbers."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "busy":
                out.append({k: float(rec[k]) for k in BUSY_FIELDS if k in rec})
        elif " busy " in line and "busy_s=" in line:
            fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            try:
                rec = {k: float(fields[k]) for k in ("busy_s", "slot_s", "slots", "t")}
                rec.update({k: float(fields[k]) for k in ("tokens", "mixed_tokens") if k in fields})
            except (KeyError, ValueError):
                continue
            out.append(rec)
    return out


def generator_shares(run_dir: Path, t0: float, t1: float) -> dict[str, float]:
    """The generators' side of the time split over the window [t0, t1] (epoch seconds): the share
    of wall time each had a sequence decoding (``gen_busy_frac``) and its slots' occupancy
    (``gen_slot_frac``), means over generators; from the first to the last ``busy`` record in the
    window. Nothing when the logs have none (a run before generators logged them). With the
    generators' token counts, ``mixed_frac``: their tokens over the window computed after an
    in-flight weight update over a cache older weights wrote, a share of all they generated."""
    busy, slots = [], []
    tokens = mixed = 0.0
    counted = True
    for log in sorted((run_dir / "logs").glob("*gen-*.log")):
        recs = [r for r in busy_lines(log) if t0 - 1e-6 <= r.get("t", -1) <= t1 + 1e-6]
        if len(recs) < 2 or recs[-1]["t"] <= recs[0]["t"]:
            continue
        a, b = recs[0], recs[-1]
        dt = b["t"] - a["t"]
        busy.append((b["busy_s"] - a["busy_s"]) / dt)
        slots.append((b["slot_s"] - a["slot_s"]) / (dt * max(1.0, b["slots"])))
        if "mixed_tokens" in a and "mixed_tokens" in b:
            tokens += b["tokens"] - a["tokens"]
            mixed += b["mixed_tokens"] - a["mixed_tokens"]
        else:
            counted = False
    if not busy:
        return {}
    out = {"gen_busy_frac": statistics.fmean(busy), "gen_slot_frac": statistics.fmean(slots)}
    if counted:
        out["mixed_frac"] = mixed / max(1.0, tokens)
    return out


# ---------------------------------------------------------------------- levels and times to reach them


def moving_average(xs: list[float], k: int) -> list[float | None]:
    """The mean of the last ``k`` values at each index; None until ``k`` exist."""
    out: list[float | None] = []
    acc = 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / k if i >= k - 1 else None)
    return out


def time_to(curve: list, level: float, k: int) -> float | None:
    """The first time in ``curve`` ([t, ..., reward] points) at which the ``k``-step moving average
    of the reward is at least ``level``; None if it never is."""
    ma = moving_average([p[-1] for p in curve], k)
    return next((p[0] for p, m in zip(curve, ma) if m is not None and m >= level - 1e-9), None)


def time_to_eval(curve: list, level: float) -> float | None:
    """The first t at which the held-out reward, linear between evaluated checkpoints, reaches ``level``."""
    for (t0, _, r0), (t1, _, r1) in zip(curve, curve[1:]):
        if r0 >= level - 1e-9:
            return t0
        if r1 >= level - 1e-9:
            return t0 + (t1 - t0) * (level - r0) / (r1 - r0)
    return curve[-1][0] if curve and curve[-1][2] >= level - 1e-9 else None


def samples_to(curve: list, level: float, k: int) -> float | None:
    """As ``time_to``, in trained samples instead of seconds: the samples of the steps after the
    first (the curve's ``[t, samples, reward]``, counted from its first point, as t is)."""
    if not curve:
        return None
    s0 = curve[0][1]
    return time_to([[p[1] - s0, p[-1]] for p in curve], level, k)


def samples_at(curve: list, t: float) -> float:
    """Samples trained since the curve's first point by time ``t`` (the last step that ended by then)."""
    s0 = curve[0][1]
    return max((p[1] for p in curve if p[0] <= t + 1e-6), default=s0) - s0


def samples_to_eval(eval_curve: list, curve: list, level: float) -> float | None:
    """As ``time_to_eval``, in trained samples: each checkpoint placed at the samples trained by
    its time, linear between checkpoints."""
    if not eval_curve or not curve:
        return None
    return time_to_eval([[samples_at(curve, t), step, rw] for t, step, rw in eval_curve], level)


def resolve_levels(cfg: Settings, runs: list[dict]) -> tuple[list[float], list[str], dict[float, float]]:
    """``levels`` plus those ``sync_levels`` makes of the sync runs, sorted; a note for each of those;
    and each fraction's level (1.0: sync's final batch reward, the primary claim ``t_sync_end``)."""
    levels, notes, by_fraction = list(cfg.levels), [], {}
    sync = [r for r in runs if r["cell"] == "sync" and r["status"] == "ok" and len(r.get("curve", ())) >= cfg.ma_steps]
    if cfg.sync_levels and sync:
        start = statistics.fmean(moving_average([p[2] for p in r["curve"]], cfg.ma_steps)[cfg.ma_steps - 1]
                                 for r in sync)
        final = statistics.fmean(r["reward_final"] for r in sync)
        for f in cfg.sync_levels:
            level = round(start + f * (final - start), 3)
            levels.append(level)
            by_fraction[f] = level
            notes.append(f"{level:g} = sync's start {start:.3f} + {f:g} × its climb to {final:.3f}")
    return sorted(set(levels)), notes, by_fraction


def resolve_eval_levels(cfg: Settings, runs: list[dict], initial: float | None
                        ) -> tuple[list[float], list[str], dict[float, float]]:
    """Held-out reward levels read off the sync cell as ``sync_levels`` are: the initial policy's
    held-out reward plus those fractions of sync's climb to its last evaluated checkpoint; and each
    fraction's level (1.0: sync's final held-out reward, the primary claim ``te_sync_end``)."""
    sync = [r["eval_curve"][-1][2] for r in runs if r["cell"] == "sync" and r["status"] == "ok" and r.get("eval_curve")]
    if initial is None or not sync or not cfg.sync_levels:
        return [], [], {}
    final = statistics.fmean(sync)
    levels, notes, by_fraction = [], [], {}
    for f in cfg.sync_levels:
        level = round(initial + f * (final - initial), 3)
        levels.append(level)
        by_fraction[f] = level
        notes.append(f"{level:g} = the initial policy's {initial:.3f} + {f:g} × sync's climb to {final:.3f}")
    return sorted(set(levels)), notes, by_fraction


# ---------------------------------------------------------------------- reward by response length


def length_hist(rows: list[dict]) -> dict[str, list[float]]:
    """``{response tokens: [samples, reward sum]}`` over the samples of ``rows`` (the learner's
    ``sample_response_lens`` and ``sample_rewards``; steps without them add nothing)."""
    hist: dict[int, list[float]] = {}
    for r in rows:
        for n, rw in zip(r.get("sample_response_lens", ()), r.get("sample_rewards", ()), strict=True):
            h = hist.setdefault(int(n), [0, 0.0])
            h[0] += 1
            h[1] += float(rw)
    return {str(n): [c, round(rw, 6)] for n, (c, rw) in sorted(hist.items())}


def length_edges(runs: list[dict], bins: int = 3, key: str = "length_hist") -> list[int]:
    """The upper edges (response tokens, inclusive) of all but the last length bin: the
    ``bins``-quantiles of the samples in ``key`` (``length_hist``: the trained ones;
    ``eval_length_hist``: the last checkpoint's held-out answers) of every finished run of every
    cell, pooled, so that each cell is split at the same lengths. Fewer edges where lengths tie;
    none without lengths."""
    pooled: dict[int, int] = {}
    for r in runs:
        if r.get("status") == "ok":
            for n, (c, _) in (r.get(key) or {}).items():
                pooled[int(n)] = pooled.get(int(n), 0) + int(c)
    total = sum(pooled.values())
    if not total:
        return []
    lengths = sorted(pooled)
    edges, acc, i = [], 0, 1
    for n in lengths:
        acc += pooled[n]
        while i < bins and acc >= total * i / bins:
            if n < lengths[-1] and (not edges or edges[-1] != n):
                edges.append(n)
            i += 1
    return edges


def length_bins(edges: list[int]) -> list[str]:
    """The bins ``length_edges`` makes, in words: ``≤ 40 tok``, ``41–72 tok``, ``> 72 tok``."""
    if not edges:
        return ["all lengths"]
    lows = [None, *(e + 1 for e in edges)]
    highs = [*edges, None]
    return [(f"≤ {hi}" if lo is None else f"> {lo - 1}" if hi is None else f"{lo}–{hi}" if lo != hi else f"{lo}")
            + " tok" for lo, hi in zip(lows, highs)]


def length_split(hist: dict[str, list[float]], edges: list[int]) -> list[tuple[float, float | None]]:
    """Per bin: the share of the run's samples in it and their mean reward (None when it has none)."""
    counts = [0] * (len(edges) + 1)
    sums = [0.0] * (len(edges) + 1)
    for n, (c, rw) in hist.items():
        b = next((i for i, e in enumerate(edges) if int(n) <= e), len(edges))
        counts[b] += int(c)
        sums[b] += float(rw)
    total = max(1, sum(counts))
    return [(c / total, (sm / c) if c else None) for c, sm in zip(counts, sums)]


# ---------------------------------------------------------------------- cells: mean ± spread over seeds

AGGREGATED = ("steps", "tokens_per_s", "gen_tokens_per_s", "sample_p50_s", "sample_p99_s", "multi_turn_frac",
              "reward_final", "off_policy_frac", "discarded_frac",
              "retired_frac", "ess", "ess_min", "lag_mean", "wait_frac", "train_frac", "handoff_frac", "step_s_mean",
              "eval_final", "gen_busy_frac", "gen_slot_frac", "mixed_frac")


def _mean_sd(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _length_rows(ok: list[dict], key: str, edges: list[int] | None) -> list[dict]:
    """A cell's ``key`` histograms split at ``edges``: per bin, share and reward, mean ± sd over seeds."""
    split = [length_split(r[key], edges) for r in ok if r.get(key)] if edges is not None else []
    if not split:
        return []
    out = []
    for b, name in enumerate(length_bins(edges)):
        share, share_sd = _mean_sd([s[b][0] for s in split])
        reward, reward_sd = _mean_sd([s[b][1] for s in split if s[b][1] is not None])
        out.append({"bin": name, "share": share, "share_sd": share_sd, "reward": reward, "reward_sd": reward_sd,
                    "runs": len(split)})
    return out


def aggregate(cells: list[Cell], runs: list[dict], levels: list[float], eval_levels: list[float] = (),
              edges: list[int] | None = None, eval_edges: list[int] | None = None) -> list[dict]:
    """Each cell over its seeds: mean and sd of every number, time and samples to every level (over
    the seeds that reached it), the staleness histogram, and with ``edges`` (``eval_edges``) the
    batch (held-out) reward by response length."""
    out = []
    for cell in cells:
        ok = [r for r in runs if r["cell"] == cell.name and r["status"] == "ok"]
        row: dict[str, Any] = {"cell": cell.name, "label": cell.label, **cell.model_dump(),
                               "runs": len([r for r in runs if r["cell"] == cell.name]), "runs_ok": len(ok)}
        for key in AGGREGATED:
            row[key], row[f"{key}_sd"] = _mean_sd([r[key] for r in ok if r.get(key) is not None])
        for key in [f"{p}_{lv:g}" for p in ("t", "s") for lv in levels] + [
                f"{p}_{lv:g}" for p in ("te", "se") for lv in eval_levels]:
            reached = [r[key] for r in ok if r.get(key) is not None]
            row[key], row[f"{key}_sd"] = _mean_sd(reached)
            row[f"{key}_reached"] = len(reached)
        hist: dict[str, int] = {}
        for r in ok:
            for lag, n in r.get("staleness_tokens", {}).items():
                hist[lag] = hist.get(lag, 0) + n
        row["staleness_tokens"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        for key, at in (("length", edges), ("eval_length", eval_edges)):
            split = _length_rows(ok, f"{key}_hist", at)
            if split:
                row[f"{key}_split"] = split
        out.append(row)
    return out
