"""What a process's end costs, by how it ends, measured side by side in one run.

    .venv/bin/python tools/bench_exit.py                      # torch, then a learner's imports; 6 rounds
    .venv/bin/python tools/bench_exit.py --imports torch --rounds 10
    .venv/bin/python tools/bench_exit.py --quick              # a smoke run (no torch)

Each round starts one process per way of ending, in turn: it imports the chosen modules and ends
with ``sys.exit(0)`` (the interpreter's ordinary teardown), ``runtime.exit_process(0)`` (one
collection, ``gc.freeze()``, then the same teardown: how april's processes end) or ``os._exit(0)``
(no teardown at all: the floor). Its CPU (user + system, from ``wait4``) is the import plus the
end, so the differences between the columns are what the ends cost. Medians over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from april_async.runtime import spawn

ROOT = Path(__file__).resolve().parent.parent
IMPORTS = {
    "none": "",
    "torch": "import torch, torch.distributed",
    "learner": "import torch, torch.distributed\nimport april_async.learner.actor, april_async.learner.hf as hf\n"
               "hf._transformers().AutoModelForCausalLM",
}
ENDS = {
    "sys.exit": "sys.exit(0)",
    "exit_process": "from april_async.runtime import exit_process\nexit_process(0)",
    "os._exit": "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)",
}


def cpu_of(code: str) -> float:
    """The CPU seconds of one ``python -c code`` from its start to its end."""
    proc = spawn([sys.executable, "-c", code], cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"bench_exit: the probe exited {os.waitstatus_to_exitcode(status)}:\n{code}")
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--imports", nargs="+", choices=sorted(IMPORTS), default=["torch", "learner"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="one round without torch: the probe's path only")
    args = ap.parse_args(argv)
    if args.quick:
        args.imports, args.rounds = ["none"], 1
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    print(f"CPU seconds from start to end, median of {args.rounds} (python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")
    print(f"{'imports':8s} " + " ".join(f"{end:>13s}" for end in ENDS) + "   saved by exit_process")
    for imports in args.imports:
        runs = {end: [] for end in ENDS}
        for _ in range(args.rounds):
            for end, ending in ENDS.items():  # interleaved: a slow moment of the machine hits every end alike
                runs[end].append(cpu_of(f"import os, sys\n{IMPORTS[imports]}\n{ending}\n"))
        med = {end: statistics.median(v) for end, v in runs.items()}
        saved = med["sys.exit"] - med["exit_process"]
        print(f"{imports:8s} " + " ".join(f"{med[end]:13.3f}" for end in ENDS) +
              f"   {saved:+.3f} s ({saved / med['sys.exit']:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
