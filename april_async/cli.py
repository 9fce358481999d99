"""The ``april`` command. One sub-command per actor or job; heavy imports happen inside each.

    april broker    [--config run.toml] [--set rollout.batch_groups=4 ...] [--dry-run]
    april generator [--config run.toml] [--set name=gen-1 ...] [--dry-run]
    april scorer    [--config run.toml] [--set reward=pkg.mod:fn ...] [--dry-run]
    april learner   [--config run.toml] [--set algorithm=dapo ...] [--dry-run]
    april broadcaster [--config run.toml] [--dry-run]
    april up        [--config run.toml] [--actors broker,generator:2,...]: the whole run, with a console
    april simulate  the real broker core in sync, april and async modes, side by side
    april keys DIR [--hosts HEAD,NAME,...]  make CurveZMQ keys for a run across hosts (then APRIL_KEYS)

An actor reads the section of its name from the TOML file (``[broker]``, ``[generator]``, ...);
``--set`` flags override it with dotted keys; ``--dry-run`` prints the resolved config and exits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from april_async import __version__


def _simulate(args: argparse.Namespace) -> int:
    from april_async.sim.report import run

    return run(args, prog="april simulate")


def _actor_config(args: argparse.Namespace):
    from april_async.config import ConfigError, actor_config_model, dump, resolve

    try:
        model = actor_config_model(args.command)
        cfg = resolve(model, file=args.config, section=args.command, overrides=args.set)
    except ConfigError as e:
        print(f"april {args.command}: {e}", file=sys.stderr)
        return None
    if args.dry_run:
        print(dump(cfg))
    return cfg


def _actor(args: argparse.Namespace) -> int:
    """``april <actor>``: its config resolved (``--dry-run``: printed), then ``main`` of its
    ``april_async/<actor>/main.py``, found by name like its config model."""
    cfg = _actor_config(args)
    if cfg is None or args.dry_run:
        return 2 if cfg is None else 0
    from importlib import import_module

    return import_module(f"april_async.{args.command}.main").main(cfg, args.stop)


def _up(args: argparse.Namespace) -> int:
    from april_async.up import main as up_main

    return up_main(args)


def _keys(args: argparse.Namespace) -> int:
    from april_async.transport.curve import KeysError, make_host_keys, make_keys

    try:
        if args.hosts is not None:
            hosts = make_host_keys(args.directory, [h.strip() for h in args.hosts.split(",")],
                                   _roles_given(args.roles))
        elif args.roles:
            raise KeysError("--roles binds per-host keys to roles: give --hosts too")
        else:
            written = make_keys(args.directory)
    except (KeysError, OSError) as e:
        print(f"april keys: {e}", file=sys.stderr)
        return 2
    if args.hosts is not None:
        _print_host_plan(args.directory, hosts)
        return 0
    for path in written:
        print(path)
    print(f"april keys: copy {args.directory} to every host of the run and set APRIL_KEYS={args.directory}; "
          f"the *.key_secret files are secrets", file=sys.stderr)
    return 0


def _roles_given(given: list[str]) -> dict[str, list[str]]:
    """``--roles NAME=ROLE,ROLE`` flags as host → roles (checked by ``curve.host_roles``)."""
    from april_async.transport.curve import KeysError

    out = {}
    for item in given:
        name, eq, roles = item.partition("=")
        if not eq or not name.strip():
            raise KeysError(f"--roles {item!r}: expected NAME=ROLE[,ROLE...], e.g. node2=generator,scorer")
        out[name.strip()] = [r.strip() for r in roles.split(",") if r.strip()]
    return out


def _print_host_plan(directory: Path, hosts: dict[str, list[Path]]) -> None:
    """What to copy where: each host's directory to that host alone, since it holds that host's secret."""
    import tomllib

    from april_async.transport.curve import ROLES_FILE

    head = next(iter(hosts))
    claims = tomllib.loads((directory / head / ROLES_FILE).read_text())["hosts"]
    for name, files in hosts.items():
        role = "the head: run the broker and the broadcaster here" if name == head else "a member"
        listed = " ".join(f.relative_to(directory / name).as_posix() for f in files)
        print(f"host {name} ({role}; may claim {','.join(claims[name])}): copy {directory / name}/ to host {name} "
              f"and point its APRIL_KEYS at the copy: {listed}")
    print(f"april keys: {directory} holds every host's secret key. Copy {directory}/NAME/ to host NAME only, at the "
          f"same path (launch/cluster.sh with APRIL_KEYS={directory} gives each host APRIL_KEYS={directory}/NAME), "
          f"keep {directory} off shared filesystems, and once copied delete the other hosts' *.key_secret files "
          f"here. To lock a host out, delete authorized/NAME.key in the head's directory and restart the broker "
          f"and the broadcaster. The roles each host's key may claim are in {directory / head / ROLES_FILE} (read "
          f"when the hubs start)", file=sys.stderr)


KEYS_EPILOG = """\
layouts:
  april keys DIR                   one directory for every host (one machine, or hosts that trust each
                                   other): DIR/server.key(+_secret), DIR/client.key(+_secret),
                                   DIR/authorized/client.key. Copy DIR everywhere, APRIL_KEYS=DIR.
  april keys DIR --hosts a,b,c     one directory per host; the first (a) is the head, which runs the
                                   broker and the broadcaster:
                                     DIR/a/: server.key, server.key_secret, client.key, client.key_secret,
                                             authorized/a.key authorized/b.key authorized/c.key
                                     DIR/b/, DIR/c/: server.key (public), client.key, client.key_secret
                                   Copy DIR/NAME/ to host NAME only and set APRIL_KEYS there to it (at the
                                   same path, launch/cluster.sh with APRIL_KEYS=DIR gives each host DIR/NAME). A
                                   member's directory cannot serve a hub: the hubs' secret stays on the head.
                                   Lock a host out: delete authorized/NAME.key in the head's directory and
                                   restart the broker and the broadcaster (the list is read when a hub starts).
                                   DIR/a/roles.toml: the roles each host's key may claim; the head all of
                                   them, the others generator and scorer, unless --roles NAME=ROLE,... (e.g.
                                   --roles b=learner,generator) says otherwise. A hub refuses a hello
                                   claiming any other.
secret files (*.key_secret) are mode 0600; nothing is ever overwritten.
"""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; ``command``: the sub-command being run, when known. Only ``simulate`` (or
    no known command: ``april --help``, a mistyped one) adds the simulator's flags, whose defaults
    import the simulator and the broker's core: ~50 ms of CPU that an actor's start would pay."""
    p = argparse.ArgumentParser(prog="april", description="Active Partial Rollouts (APRIL), fully asynchronous.")
    p.add_argument("--version", action="version", version=f"april-async {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in [
        ("broker", "the rollout broker (ROUTER; the source of truth)"),
        ("generator", "a generator: takes leases and runs them on an engine"),
        ("scorer", "a scorer: rewards finished samples"),
        ("learner", "the learner: GRPO/DAPO/GSPO on batches from the broker"),
        ("broadcaster", "the broadcaster: fans new weights out to the generators"),
    ]:
        a = sub.add_parser(name, help=text)
        a.add_argument("--config", type=Path, help=f"TOML file; its [{name}] section is read")
        a.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override one setting (dotted keys, TOML values), repeatable")
        a.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
        a.set_defaults(func=_actor)
    u = sub.add_parser("up", help="start every actor of a run on this machine, with a live console view")
    u.add_argument("--config", type=Path, help="TOML file: [run] plus one section per actor")
    u.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one setting of any section, e.g. run.max_steps=20 or learner.lr=3e-4")
    u.add_argument("--actors", default=None,
                   help="the actors to start here, e.g. broker,broadcaster,learner,scorer or generator:2; "
                        "learner:N starts the learner as N ranks (default: [run] actors, normally all of them)")
    u.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    u.add_argument("--warm-start-only", action="store_true",
                   help="make the initial policy (<run.dir>/init) if there is none, then exit: e.g. to start "
                        "SGLang servers from it")
    u.set_defaults(func=_up)
    k = sub.add_parser("keys", help="make CurveZMQ keys (hubs' and actors' key pairs, the admitted clients): one "
                                    "directory for all hosts, or with --hosts one per host; point APRIL_KEYS at it",
                       epilog=KEYS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    k.add_argument("directory", type=Path)
    k.add_argument("--hosts", metavar="HEAD[,NAME...]",
                   help="one keys directory per host, DIR/NAME/, each host with a client key of its own; the "
                        "first name is the head, the only one holding the hubs' secret")
    k.add_argument("--roles", action="append", default=[], metavar="NAME=ROLE[,ROLE...]",
                   help="with --hosts: the roles host NAME's key may claim (default: the head every role, other "
                        "hosts generator,scorer); repeatable")
    k.set_defaults(func=_keys)
    s = sub.add_parser("simulate", help="run the real broker core against simulated long-tail engines "
                                         "(tools/simulate.py)")
    if command == "simulate" or command not in sub.choices:
        from april_async.sim.report import add_arguments

        add_arguments(s)
    s.set_defaults(func=_simulate)
    return p


ACTORS = ("broker", "generator", "scorer", "learner", "broadcaster")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    stop = None
    if argv[:1] and argv[0] in ACTORS and "--dry-run" not in argv:
        from april_async.runtime import StopFlag

        # First, before the parser (which imports pydantic and the simulator's settings): a SIGTERM
        # during start-up then stops the actor cleanly (exit 0) instead of killing it (-15), which a
        # supervisor stopping a run early took for a crash.
        stop = StopFlag()
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    args.stop = stop
    return args.func(args)


def entry() -> NoReturn:
    """The ``april`` command and ``python -m april_async.cli``: ``main()``, then the process ends
    (``runtime.exit_process``)."""
    from april_async.runtime import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
