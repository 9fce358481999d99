"""Where a run's time went, from the learner's ``metrics.jsonl``: waiting for rollouts, training, hand-off.

    .venv/bin/python tools/time_split.py runs/addchain-long-sync            # the run directory (or its metrics.jsonl)
    .venv/bin/python tools/time_split.py runs/addchain-long-sync --skip 2 --json split.json

Each learner step reports ``wait_s`` (from the end of the previous step to its batch: the learner
idle while the generators roll out), ``train_s`` (batch to updated weights) and ``step_s``
(``train_s`` plus the hand-off of the weights, the batch report and any checkpoint). Summed over the
steps after the first ``--skip`` (the first waits for start-up: processes, the first rollout),
their shares of the learner's wall clock are the time split that ``tools/experiment.py`` reports
per cell. In ``sync`` the generators run only while the learner waits, so ``wait`` is the rollout's
share of a step and ``train`` the learner's (issue 30 asks for a preset where it is at most 20 %).
Also printed: the response lengths and the trained tokens of those steps, and the batch reward of
the first and last of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from april_async.runfiles import read_metrics  # noqa: E402


def time_split(rows: list[dict], skip: int = 1) -> dict:
    """The split of ``rows`` (``metrics.jsonl`` lines) after the first ``skip``: seconds per step and
    the shares of wait, train and hand-off; a ``ValueError`` when no step is left."""
    win = rows[skip:]
    if not win:
        raise ValueError(f"{len(rows)} learner steps: none left after skipping {skip}")
    wait = sum(float(r["wait_s"]) for r in win)
    train = sum(float(r["train_s"]) for r in win)
    handoff = sum(float(r["step_s"]) - float(r["train_s"]) for r in win)
    total = wait + train + handoff
    return {
        "steps": len(win), "seconds": round(total, 2), "step_s_mean": round(total / len(win), 3),
        "wait_s_mean": round(wait / len(win), 3), "train_s_mean": round(train / len(win), 3),
        "wait_frac": round(wait / total, 4), "train_frac": round(train / total, 4),
        "handoff_frac": round(handoff / total, 4),
        "response_len_mean": round(statistics.fmean(float(r["response_len_mean"]) for r in win), 1),
        "response_len_max": max(int(r["response_len_max"]) for r in win),
        "tokens_per_step": round(statistics.fmean(int(r["tokens"]) for r in win)),
        "reward_first": round(float(win[0]["reward_mean"]), 4), "reward_last": round(float(win[-1]["reward_mean"]), 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a run directory (or its metrics.jsonl)")
    p.add_argument("--skip", type=int, default=1, help="leading steps left out (start-up); default 1")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    args = p.parse_args(argv)
    split = time_split(read_metrics(args.run), args.skip)
    print(f"{split['steps']} steps, {split['step_s_mean']:.2f} s each: wait (rollout) {split['wait_frac']:.1%}, "
          f"train {split['train_frac']:.1%}, hand-off {split['handoff_frac']:.1%} | response tokens mean "
          f"{split['response_len_mean']:.0f}, max {split['response_len_max']} | {split['tokens_per_step']} "
          f"trained tokens a step | reward {split['reward_first']:.3f} -> {split['reward_last']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(split, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
