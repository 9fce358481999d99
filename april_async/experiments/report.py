"""An experiment's tables (markdown) and its block of ``docs/experiments.md``; a sweep's
``results.csv`` and ``results.json``."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

from april_async.experiments.grid import ExperimentError, Settings
from april_async.experiments.numbers import COLUMNS, Row
from april_async.experiments.paired import LEVEL, MIN_PAIRS


def _pm(row: dict, key: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
    """``mean ± sd`` of ``row[key]`` (just the mean when the spread is 0 or there is one seed)."""
    v, sd = row.get(key), row.get(f"{key}_sd")
    if v is None:
        return "—"
    return (f"{v * scale:{fmt}} ± {sd * scale:{fmt}}" if sd else f"{v * scale:{fmt}}") + unit


def _time_cell(c: dict, key: str, sync: dict | None, fmt: str = ".0f") -> str:
    """A time-to-level cell: mean ± sd, how many seeds reached it when not all, and the ratio to sync."""
    text = _pm(c, key, fmt)
    if c[f"{key}_reached"] < c["runs_ok"]:
        text += f" ({c[f'{key}_reached']}/{c['runs_ok']})"
    if sync and c is not sync and c.get(key) is not None and sync.get(key):
        text += f" [{c[key] / sync[key]:.2f}×]"
    return text


def tables(cfg: Settings, cells: list[dict], sim: list[dict] | None = None, notes: list[str] = ()) -> str:
    """The results as markdown: time to reward, the time split, and (with ``sim``) the projection;
    ``notes`` say where levels came from."""
    sync = next((c for c in cells if c["cell"] == "sync"), None)
    head = ["cell", "seeds", "steps", "trained tok/s"] + [f"t to {lv:g} (s)" for lv in cfg.levels] + [
        "final reward", "off-policy", "discarded", "retired", "ESS (min)"]
    lines = [f"Each run trains for {cfg.duration_s:g} s from the end of its first learner step; "
             f"mean ± sample sd over seeds. *t to L*: wall time until the {cfg.ma_steps}-step moving average "
             f"of the batch reward reaches L (k/n: seeds that reached it; the mean is over those); "
             f"*discarded*: generated tokens dropped by staleness restarts, *retired*: tokens of retired "
             f"groups (the `drop` policy, failures); "
             f"*ESS*: the learner's effective sample size of π_prox/μ, mean over steps (lowest step)"
             + ("; in brackets, relative to sync." if sync else ".")
             + "".join(f" Level {n}." for n in notes), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        cols = [c["label"], f"{c['runs_ok']}/{c['runs']}", _pm(c, "steps", ".1f"), _pm(c, "tokens_per_s", ",.0f")]
        cols += [_time_cell(c, f"t_{lv:g}", sync) for lv in cfg.levels]
        cols += [_pm(c, "reward_final", ".3f"), _pm(c, "off_policy_frac", ".1f", 100, " %"),
                 _pm(c, "discarded_frac", ".1f", 100, " %"), _pm(c, "retired_frac", ".1f", 100, " %"),
                 _pm(c, "ess", ".3f") + (f" ({c['ess_min']:.2f})" if c.get("ess_min") is not None else "")]
        lines.append("| " + " | ".join(cols) + " |")
    lines += ["", "Where the time goes (fractions of the window, from the learner's per-step `wait_s`, `train_s`, "
              "`step_s`): *waiting* for a batch (the rollout, in sync and april-abort), *training*, *hand-off* "
              "(weights out, batch report, checkpoints); from the generators' `busy` log lines, the share of the "
              "window each had a sequence decoding and the share of its slots in use (means over generators); the "
              "generators' output per wall second, discarded tokens included; *mixed*: the generated tokens "
              "computed after an in-flight weight update over a KV cache an earlier version wrote "
              "(their `busy` lines).", "",
              "| cell | waiting | training | hand-off | s per step | generators decoding | slots busy | generated tok/s "
              "| mean lag | mixed |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        cols = [c["label"], *(_pm(c, k, ".0f", 100, " %") for k in ("wait_frac", "train_frac", "handoff_frac")),
                _pm(c, "step_s_mean", ".2f"), _pm(c, "gen_busy_frac", ".0f", 100, " %"),
                _pm(c, "gen_slot_frac", ".0f", 100, " %"), _pm(c, "gen_tokens_per_s", ",.0f"), _pm(c, "lag_mean", ".2f"),
                _pm(c, "mixed_frac", ".1f", 100, " %")]
        lines.append("| " + " | ".join(cols) + " |")
    if sim:
        lines += ["", sim_table(sim)]
    return "\n".join(lines) + "\n"


def eval_table(cfg: Settings, cells: list[dict], levels: list[float], notes: list[str], initial: float) -> str:
    sync = next((c for c in cells if c["cell"] == "sync"), None)
    head = ["cell", "held-out reward at the window's end"] + [f"t to {lv:g} (s)" for lv in levels]
    lines = [f"The held-out reward: the policy's checkpoints ({cfg.eval_points} a run, spread over the window) "
             f"answering {cfg.eval_problems} problems no run trains on, at temperature {cfg.eval_temperature:g}; the "
             f"initial policy answers {initial:.3f}. Unlike the batch reward it does not depend on which groups a "
             f"mode delivers. *t to L*: linear between checkpoints; in brackets, relative to sync."
             + "".join(f" Level {n}." for n in notes), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        cols = [c["label"], _pm(c, "eval_final", ".3f")] + [_time_cell(c, f"te_{lv:g}", sync) for lv in levels]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


def samples_table(cells: list[dict], levels: list[float], eval_levels: list[float]) -> str:
    """Trained samples to each level, batch and held-out, beside the times of the tables above."""
    sync = next((c for c in cells if c["cell"] == "sync"), None)
    head = ["cell"] + [f"samples to batch {lv:g}" for lv in levels] + [f"samples to held-out {lv:g}"
                                                                        for lv in eval_levels]
    lines = ["Reward against samples: *samples to L* counts the trained samples (responses in the batches the "
             "learner trained on, every sample of a group) from the end of the first learner step until the reward "
             "reaches L, as *t to L* counts seconds (batch: the same moving average; held-out: linear between "
             "checkpoints, each placed at the samples trained by its time); mean ± sd over the seeds that reached "
             "it; in brackets, relative to sync. A mode that is faster per second but not per sample wins by "
             "throughput, not by what it trains on.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        cols = [c["label"]] + [_time_cell(c, f"s_{lv:g}", sync, ",.0f") for lv in levels] + [
            _time_cell(c, f"se_{lv:g}", sync, ",.0f") for lv in eval_levels]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


def length_table(cells: list[dict], edges: list[int], held_out: bool = False) -> str:
    """The batch reward (``held_out``: the held-out reward at the window's end) split by response
    length (``numbers.length_split``), every cell at the same edges."""
    key = "eval_length_split" if held_out else "length_split"
    bins = next(c[key] for c in cells if c.get(key))
    head = ["cell"] + [f"{b['bin']}: {what}" for b in bins for what in ("share", "reward")]
    edges_text = (f"in bins at the terciles of all cells' samples pooled (edges {', '.join(map(str, edges)) or 'none'}; "
                  "an edge that ties another or the longest response is left out), so every cell is split at the same "
                  "lengths")
    if held_out:
        intro = (f"Held-out reward by response length: each run's last checkpoint's answers to the held-out problems "
                 f"by their response tokens, {edges_text}. *share*: the cell's answers in the bin; *reward*: the share "
                 "of them right; means ± sd over seeds. No scheduler chooses these answers: a difference here is "
                 "the policy's.")
    else:
        intro = (f"Reward by response length: every trained sample of the window by its response tokens, {edges_text}. "
                 "*share*: the cell's samples in the bin; *reward*: their mean batch reward; means ± sd over seeds. A "
                 "cell whose batch reward rises only through a larger share of short answers gains by what it "
                 "delivers first, not by its schedule.")
    lines = [intro, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        cols = [c["label"]]
        for b in c.get(key) or [{}] * len(bins):
            cols += [_pm(b, "share", ".0f", 100, " %"), _pm(b, "reward", ".3f")]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


def paired_table(rows: list[dict], labels: dict[str, str], seeds: int) -> str:
    """Every cell's claims against sync (``paired.against_sync``): the ratio, its paired interval over
    seeds, the claim's family, and the verdict, one line a claim."""
    levels = sorted({r["level"] for r in rows if r["family"] == "primary"})
    primary = (f" *Primary* claims were named before the runs; their intervals are Bonferroni's, at "
               f"{', '.join(f'{lv:.1%}' for lv in levels)} each, so that they hold together at 95 %; every "
               "other row is *exploratory*, at 95 % unadjusted." if levels else
               " No primary claim was named: every row is exploratory, at 95 % unadjusted.")
    lines = [f"Against sync, seed by seed: each cell ran the same {seeds} seed(s) (prompt streams) as sync. *ratio*: "
             "the geometric mean over seeds of the cell's number over sync's; *interval*: the paired "
             "t-interval on the log of those ratios (95 % unless said), exponentiated. A time or number of "
             "samples to a level that a seed never reached is censored at the window's end, not dropped "
             "(*reached*: seeds of each side that reached it; a seed neither reached is left out of the "
             "pairs); an interval with censored seeds is read in the one direction they cannot flatter. "
             "*Verdict*: the side of 1 the whole interval lies on, else not distinguishable; none from fewer "
             f"than {MIN_PAIRS} pairs (`experiments/paired.py`)." + primary, "",
             "| cell | claim | family | ratio to sync | interval | pairs | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        iv = "—" if r["lo"] is None else f"[{r['lo']:.2f}, {r['hi']:.2f}]" + (
            "" if abs(r["level"] - LEVEL) < 1e-9 else f" ({r['level']:.1%})".replace("%", " %"))
        pairs = f"{r['pairs']} of {r['seeds']}"
        if r["reached"] != [r["seeds"], r["seeds"]]:
            pairs += f"; reached: cell {r['reached'][0]}, sync {r['reached'][1]}"
        lines.append(f"| {labels.get(r['cell'], r['cell'])} | {r['claim']} | {r['family']} | {ratio} | "
                     f"{iv} | {pairs} | {r['verdict']} |")
    return "\n".join(lines) + "\n"


def sim_table(sim: list[dict]) -> str:
    sync = next((s for s in sim if s["cell"] == "sync"), None)
    lines = [f"The same cells in the simulator (GPU-like costs, learner {sim[0]['train_s']:.3g} s per batch): "
             "useful tokens per simulated second, relative to sync; *retired*: tokens of retired groups over the whole "
             "simulated run (the others are over the measured batches).", "",
             "| cell | tok/s | × sync | off-policy | discarded | retired | idle slots |", "|---|---|---|---|---|---|---|"]
    for s in sim:
        rel = f"{s['tokens_per_s'] / sync['tokens_per_s']:.2f}" if sync else "—"
        label = s["label"]
        if s.get("not_simulated"):  # the simulator has the broker's knobs only: the row is the cell without its set
            label += f" (not simulated: {', '.join(f'`{o}`' for o in s['not_simulated'])}; the cell without it)"
        lines.append(f"| {label} | {s['tokens_per_s']:,.0f} | {rel} | {s['off_policy_frac']:.1%} | "
                     f"{s['discarded_frac']:.1%} | {s.get('retired_frac', 0.0):.1%} | "
                     f"{s['idle_fraction']:.1%} |".replace("%", " %"))
    return "\n".join(lines)


def write_docs(cfg: Settings, text: str, figures: list[str], out: Path, page_path: Path) -> None:
    """Copy the figures to ``cfg.docs`` and put the tables between the experiment's markers in
    ``page_path`` (``docs/experiments.md``; the rest of the page is left as it is)."""
    if cfg.docs is None:
        raise ExperimentError("[experiment] docs is not set: nowhere to copy the figures")
    cfg.docs.mkdir(parents=True, exist_ok=True)
    for name in figures:
        shutil.copyfile(out / name, cfg.docs / name)
    begin, end = f"<!-- experiment:{cfg.name}:begin -->", f"<!-- experiment:{cfg.name}:end -->"
    rel = cfg.docs.resolve().relative_to(page_path.parent.resolve()) if cfg.docs.resolve().is_relative_to(
        page_path.parent.resolve()) else cfg.docs
    pics = "\n".join(f"![{Path(n).stem.replace('_', ' ')}]({rel}/{n})" for n in figures)
    note = "<!-- written by tools/experiment.py --docs: edits here are overwritten -->"
    block = f"{begin}\n{note}\n\n{text}\n{pics}\n{end}"
    page = page_path.read_text() if page_path.is_file() else f"# Experiments\n\n{begin}\n{end}\n"
    if begin not in page or end not in page:
        page = page.rstrip("\n") + f"\n\n{begin}\n{end}\n"
    head, rest = page.split(begin, 1)
    page = head + block + rest.split(end, 1)[1]
    page_path.write_text(page)
    print(f"experiment: wrote {len(figures)} figures to {cfg.docs} and the {cfg.name} block of {page_path}")


def write_results(rows: list[Row], out: Path, meta: dict) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None else v) for k, v in row.flat().items() if k in COLUMNS})
    doc = {**meta, "rows": [{**row.flat(), **{k: v for k, v in row.values.items() if k not in COLUMNS},
                             "staleness_tokens": {str(k): v for k, v in sorted(row.staleness.items())},
                             "rewards": row.rewards} for row in rows]}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
