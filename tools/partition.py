"""Figures of a network cut: a three-host run in network namespaces (``testing.partition``), one
generator host's link cut after the learner's step 8, restored, and the learner's steps per minute
before, during and after the cut, with the time until the cut host holds the newest version again.

    sudo .venv/bin/python tools/partition.py                 # 25 s, link down (issue 29)
    sudo .venv/bin/python tools/partition.py --cut-s 15 --how drop --hosts 1,2

Needs root and ``ip netns``. Prints one JSON object; ``--catch-up-s`` bounds the wait for the host.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from april_async.testing.netns import unavailable  # noqa: E402
from april_async.testing.partition import ClusterRun, cut_and_measure  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cut-s", type=float, default=25.0, help="how long the link stays cut (default 25)")
    ap.add_argument("--how", choices=["link", "drop"], default="link",
                    help="link: the host's link down; drop: every packet lost both ways, link up")
    ap.add_argument("--hosts", default="2", help="the generator hosts to cut, by index (default 2)")
    ap.add_argument("--catch-up-s", type=float, default=120.0)
    ap.add_argument("--dir", help="where the run goes (default: a new temporary directory)")
    args = ap.parse_args(argv)
    why = unavailable()
    if why:
        print(f"partition: {why}", file=sys.stderr)
        return 2
    hosts = [int(h) for h in args.hosts.split(",")]
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="april-partition-"))
    with ClusterRun(tmp) as run:
        act = {"link": (run.hosts.cut, run.hosts.restore), "drop": (run.hosts.drop, run.hosts.undrop)}[args.how]
        fig = cut_and_measure(run, cut=lambda: [act[0](h) for h in hosts], restore=lambda: [act[1](h) for h in hosts],
                              cut_s=args.cut_s, watch=[f"n{h}-gen-0" for h in hosts], catch_up_s=args.catch_up_s)
        run.stop()
        fig.update(run.audit(), dir=str(tmp))
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in fig.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
