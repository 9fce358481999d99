"""Time to reward: sync, april and async on the real loop, each for the same wall time, over seeds.

    .venv/bin/python tools/experiment.py launch/experiments/time_to_reward.toml          # the reference run
    .venv/bin/python tools/experiment.py launch/experiments/eta.toml                     # the η sweep
    .venv/bin/python tools/experiment.py launch/experiments/time_to_reward.toml --smoke  # CI's size, ~1 min
    .venv/bin/python tools/experiment.py launch/experiments/time_to_reward.toml --sim    # the GPU-cost projection
    .venv/bin/python tools/experiment.py CONFIG --report [--docs]   # redraw and re-tabulate <out>/results.json

APRIL's claim is end to end: the same or better reward in less wall time. Throughput alone does
not show it (a faster mode may train on staler data), so every cell here is a whole ``april up``
run (all five actors, the built-in addchain task) and is judged by when its reward gets there.

The config. ``[experiment]`` names the base ``april up`` file (``base``), the cells (``cells``: a
list of small grids, each ``{mode, r, eta, boundary, over_bound, admission}`` with lists crossed,
plus ``groups_scale``, B as a multiple of the base's), the seeds,
the training window (``duration_s``), the reward levels (``levels``) and the moving average that
must reach them (``ma_steps``; ``sync_levels`` adds levels read off the sync cell); ``[smoke]``
replaces any of those for ``--smoke`` (into ``<out>-smoke``, with its own warm start); ``[sim]`` is
``tools/simulate.py``'s settings for ``--sim``. Relative paths are read from the current directory.

Controls. A cell's name (its directory and row) and label are made from its knobs, so they say
what runs: ``sync-2B`` ("sync 2B") trains on twice the base's groups a step, which keeps as many
groups in flight as april at r = 2; ``async-r2-eta4-perstep`` ("async + APRIL's admission count")
is async leasing continuously but starting at most ceil(r·B) groups a version
(``broker.rollout.async_admission``). A cell may also carry ``set = [...]``, ``april up --set``
overrides for its runs only; it then needs a ``name`` (one cell, beginning with its mode) and may
give a ``label`` (beginning with its mode as shown). An override of a key the cell's knobs own
(mode, r, η, boundary, over_bound, admission, B) or that the tool sets per run (the seed, the run
directory, the ports) is refused, naming it; every cell's run file is checked before anything runs.

One run (a cell at a seed). Every run starts from one initial policy, made once by the base's warm
start into ``init`` (default ``<out>/init``; ``warm_start`` in ``april_async/experiments/runs.py``), so runs differ
only in their knobs and seed; a warm start that stopped below its target reward is refused. The seed is the broker's prompt stream (``broker.prompts.seed``); the generators'
sampling is unseeded (each process's own torch generator), and thread timing differs run to run,
so seeds measure the spread a user would see. A run is stopped as Ctrl-C stops it once
``duration_s`` has passed since its *first learner step ended*: start-up (processes, the first
rollout) is outside the window, and every mode gets the same training time. Only the learner steps
that end inside the window count.

What a run reports (from its ``metrics.jsonl``, one line per learner step, and the broker's
``broker_state.json``); t = 0 is the end of the first step:

- ``steps``, ``tokens_per_s``: learner steps ending in (0, duration_s], their trained tokens / s;
- ``t_<level>``: the first t at which the moving average of the batch reward over the last
  ``ma_steps`` steps is at least ``level`` (no value until ``ma_steps`` steps exist; None if never),
  timed from the stored reward curve, so that ``--report`` can time other levels;
- ``s_<level>``: the same, in trained samples instead of seconds (responses in the batches the
  learner trained on, counted from the end of the first step as t is); ``te_<level>`` and
  ``se_<level>``, time and samples to a held-out level, linear between evaluated checkpoints;
- ``length_hist``: the window's trained samples by response tokens (``{tokens: [samples, reward
  sum]}``, from the learner's ``sample_response_lens`` and ``sample_rewards``), which the report
  splits into bins at the terciles of every cell's samples pooled: per cell, the share of samples
  and the mean batch reward in each bin, to tell a scheduling gain from short answers delivered
  first; ``eval_length_hist``, the same of the last evaluated checkpoint's held-out answers (split
  at their own terciles);
- ``reward_final``: the mean batch reward of the window's last ``ma_steps`` steps;
- ``off_policy_frac``: trained tokens from an older policy version (token-weighted over the window);
  ``discarded_frac``: generated tokens dropped by staleness restarts, both from the broker's
  counters carried on each batch; ``ess``: the learner's per-step effective sample size of the
  importance weights π_prox/μ, averaged over the window;
- the time split, from the learner's per-step ``wait_s`` (end of the last step to the next batch:
  the learner idle, waiting for rollouts), ``train_s`` (the step itself) and ``step_s − train_s``
  (hand-off of the weights, the batch report, checkpoints), as fractions of the window; with the
  generators' output over the same window (``gen_tokens_per_s``, every generated token, discarded
  ones included). In sync and april (abort) the generators run only while the learner waits, so
  ``wait`` is the rollout's share; in async and april + in-flight updates they also run during
  ``train``. ``mixed_frac``: of the generators' tokens (their ``busy`` lines), those computed after
  an in-flight weight load over a KV cache an earlier version wrote.

A cell is the mean and sample standard deviation of those over its seeds (``t_<level>`` over the
seeds that reached it, with how many did).

Against sync (``april_async/experiments/paired.py``): every cell runs the same seeds, so each
claim — time and trained samples to each level (batch and held-out reward), trained tokens/s, the
held-out reward at the window's end — is a ratio to sync (the geometric mean of the per-seed
ratios) with the paired t-interval on their logs and a verdict (faster / slower than sync, or not
distinguishable; none from fewer than 4 pairs). A level a seed never reached counts: its time is
censored at the window's end, not dropped. The claims named in ``[experiment] primary`` before the
runs get Bonferroni-adjusted intervals; every other row is exploratory. In the tables,
``results.md`` and ``results.json`` (``against_sync``).

Cells run in a random order within each seed (seeded by ``order_seed`` and the seed, recorded in
each run's ``order`` and in ``results.json``'s ``orders``): a fixed order on a shared machine would
give one cell the quiet start of every seed. Every run's numbers, per seed, go to
``[experiment] docs``/``runs.json`` with ``--docs``; ``--report --from-docs`` rebuilds every table and
figure from that file alone.

Writes to ``<out>``: ``results.json`` (every run with its reward curve, every cell's aggregate,
the settings; rewritten after each run, so an interrupted experiment keeps what it finished),
``results.md`` (the tables) and the figures: ``reward_vs_time.png`` and ``reward_vs_samples.png``
(the moving average, mean over seeds, a band from the lowest to the highest seed),
``time_to_reward.png``, ``time_split.png``, ``staleness.png`` and, when the cells vary η,
``eta.png`` (throughput and off-policy share against η). ``--docs`` also copies the figures
(80 dpi) to ``[experiment] docs`` and rewrites that experiment's block of ``docs/experiments.md``.

``--sim`` runs the same cells (one seed: the simulator is deterministic) in the cluster simulator
(``april_async/sim/``, the real broker core around simulated GPU generators). With
``sim_train_share`` set, the learner's seconds per batch are chosen so that training is that share
of a sync step (APRIL, arXiv 2509.18521, §1: rollout is more than 90 % of RL runtime, so 0.1):
a sync rollout-only run is simulated first to measure the rollout. The tables go to
``<out>/sim.json`` and ``sim.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # april_async from this checkout

from april_async.experiments.cli import experiment_main  # noqa: E402

DOCS_PAGE = ROOT / "docs" / "experiments.md"
"""The page ``--docs`` rewrites a block of."""


def main(argv: list[str] | None = None) -> int:
    return experiment_main(argv, docs_page=DOCS_PAGE, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
