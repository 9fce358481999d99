"""``april up``: every actor of a run as child processes of one supervisor, with a console view.

    april up --config run.toml                  # the actors of [run] actors here (by default all:
                                                # broker, broadcaster, scorer, learner, 2 generators)
    april up --config run.toml --actors generator:2    # only some (launch/cluster.sh does this)
    april up --config run.toml --actors broker,broadcaster,scorer,learner:4,generator:2  # 4 learner ranks
    april up --config run.toml --set run.max_steps=20 --set learner.lr=3e-4

What it does, in order:

1. Resolve the config: ``[run]`` plus one section per actor (``[broker]``, ``[generator]``,
   ``[scorer]``, ``[learner]``, ``[broadcaster]``, ``[warmstart]``), ``--set`` overrides with a
   section prefix. Addresses come from ``[run]`` (or the environment: ``APRIL_HEAD`` is the host
   that runs the broker and the broadcaster, ``APRIL_BIND`` what they bind to,
   ``APRIL_NODE`` a prefix that keeps actor names unique across hosts).
2. Make the initial policy when ``learner.checkpoint`` is empty: the built-in supervised warm
   start, written once to ``<run.dir>/init`` and reused by later runs.
3. Write each actor's resolved config to ``<run.dir>/config/<name>.json`` and start it as
   ``python -m april_async.cli <actor> --config <that file>``, its output in
   ``<run.dir>/logs/<name>.log``. A child dies with the supervisor (``PR_SET_PDEATHSIG``).
   The learner is a group of N processes (``learner:N``, else ``[learner] ranks``):
   ``learner-0`` and ``learner-0-r<r>``, each with the same config and a torchrun-style
   environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` = ``run.learner_port``), all on this host.
4. Show progress from the learner's ``metrics.jsonl``: step, reward, response length,
   throughput, off-policy share, recycled partials. On a cluster only the head (the host that
   runs the broker) shows it; the other hosts show their own actors' starts, restarts, deaths and
   stops, each line prefixed with the host's ``run.node``. Everything shown is also appended to
   ``<run.dir>/logs/up.log`` (``up-<node>.log``), and a terminal that goes away (ssh closed: EIO;
   ``| head``: EPIPE) only ends the console: the run goes on, or stops in order, as without it.
5. With ``run.restart = "on-failure"``, restart a child that crashed (a non-zero exit or a
   signal, ``kill -9`` included) the way a process supervisor would: after a back-off that
   doubles while it keeps dying young, at most ``max_restarts`` times per actor within
   ``restart_window_s``. Every actor recovers its own state (the broker from its journal, the
   learner from its newest checkpoint) and the others reconnect to it. Exit code 2 (a bad
   config, a refused peer) is never retried. The learner's ranks are one unit: when one dies
   the others are killed (``SIGKILL``) and the group restarts together, counted once. Rank 0
   exiting 0 means the learner finished; a rank r > 0 exits 0 only when rank 0 stops the
   group, so one that does while rank 0 runs on (past ``stop_timeout_s``) failed.
   ``<run.dir>/children.json`` (``children-<node>.json`` with ``run.node`` set, one per host)
   always lists each child (each learner rank) with its pid and restarts.
6. Stop on Ctrl-C, SIGTERM, SIGHUP (an ssh session closed), ``run.max_steps``, ``run.duration_s``,
   the learner finishing or a child that dies and is not restarted (exit code 0 for all but the
   last): the learner group first (``SIGTERM`` to every rank;
   rank 0 stops the others and writes a checkpoint), then — once the generators hold its
   last version — generators, scorer, broadcaster and broker last; whatever has not exited
   after ``stop_timeout_s`` is killed. Nothing is left running.

The modules, in the order a run meets them: ``config`` (the run file as one typed model,
``RunFile``), ``plan`` (the children and their configs, copied from it), ``supervisor`` (start,
watch, restart, stop), ``console`` (the terminal that may go away).
"""

from __future__ import annotations

import json
import signal
import sys

from april_async.config import ConfigError
from april_async.runfiles import per_node
from april_async.up.config import ACTOR_KINDS, SECTIONS, RunConfig, RunFile, load_document, parse_actors
from april_async.up import preflight
from april_async.up.console import Console, SafeStream, safe_console
from april_async.up.plan import Child, allocator_env, allocator_library, plan, plan_run
from april_async.up.supervisor import Supervisor
from april_async.warmstart import WarmStartStopped

__all__ = ["ACTOR_KINDS", "SECTIONS", "Child", "Console", "RunConfig", "RunFile", "SafeStream", "Supervisor",
           "allocator_env", "allocator_library", "load_document", "main", "parse_actors", "plan", "plan_run",
           "safe_console"]


def main(args) -> int:
    """``april up``, its console safe from a terminal that goes away (see ``SafeStream``)."""
    with safe_console() as console:
        return _main(args, console)


def _main(args, console: Console) -> int:
    try:
        files = RunFile.load(load_document(args.config, args.set), args.actors)
        run, children, configs = plan_run(files)
    except ConfigError as e:
        print(f"april up: {e}", file=sys.stderr)
        return 2
    found = preflight.problems(files)
    if found and not args.dry_run:
        plural = "s" * (len(found) > 1)
        print(f"april up: {len(found)} problem{plural} found before any actor started:", file=sys.stderr)
        for line in found:
            print(f"  {line}", file=sys.stderr)
        return 2
    if args.dry_run:
        for c in children:
            print(f"{c.name}: {' '.join([*(f'{k}={v}' for k, v in c.env.items()), *c.argv])}")
            print(json.dumps(configs[c.name], indent=2, sort_keys=True))
        return 0
    sup = Supervisor(run, children, configs, files.init_warm_start)
    console.attach(sup.dir / "logs" / per_node("up.log", run.node))
    signal.signal(signal.SIGINT, sup._on_signal)
    signal.signal(signal.SIGTERM, sup._on_signal)
    signal.signal(signal.SIGHUP, sup._on_signal)  # the ssh session of launch/cluster.sh closed
    try:
        sup.ensure_initial_policy()
    except ConfigError as e:
        sup.say(str(e), err=True)
        return 2
    except WarmStartStopped as e:  # a signal during the warm start: no actor was started
        sup.say(f"stopped ({sup.stop_reason}) during the warm start, {e}; {sup.dir / 'init'} was not written")
        return 130
    if args.warm_start_only:  # e.g. before starting SGLang servers from <run.dir>/init
        sup.say(f"initial policy ready in {sup.dir / 'init'}")
        return 0
    code = 0
    try:
        sup.start()
        code = sup.watch()
    finally:
        sup.stop()
    sup.show_end(sup.summary())
    return code
