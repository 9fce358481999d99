"""Response-length workloads: the long tails every benchmark and simulation draws from.

A workload gives each sample a true response length, a pure function of the workload, its seed
and the sample's key, so a resumed partial continues toward the same end, and two runs (or two
modes in one run) see exactly the same lengths. Lengths are clipped to ``max_tokens``, the
response budget: like a real run, the clipped ones end at the budget.

Specs (``parse_workload``):

    math                      the default: a long tail like APRIL's math-reasoning rollouts
                              (arXiv 2509.18521, Fig. 1): lognormal, median 0.15·max, σ 1.0, so
                              p90 ≈ 0.54·max and ~3 % of responses run into the budget
    lognormal:median=48,sigma=1.0
    pareto:min=16,alpha=1.2   P(L > x) = (min/x)^alpha
    addchain                  the built-in task's worked-answer lengths (median 40, max 241)
    uniform:lo=16,hi=64       no tail: the control
    const:64
    file:PATH                 one length per line (or a JSON list); sample k gets lengths[k mod n],
                              after a seeded shuffle

A parameter written as a fraction of the budget (``median=0.15max``) scales with ``max_tokens``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path


class WorkloadError(ValueError):
    """A workload spec that cannot be read; the message names the problem."""


DEFAULT = "math"
NAMED = {"math": "lognormal:median=0.15max,sigma=1.0"}


@dataclass(frozen=True)
class Workload:
    spec: str
    kind: str
    params: dict = field(hash=False)
    max_tokens: int
    seed: int = 0
    table: tuple[int, ...] = ()  # file: the lengths, shuffled

    def length(self, key: int) -> int:
        """The true response length of sample ``key``, in 1..max_tokens."""
        if self.kind == "file":
            raw = self.table[key % len(self.table)]
        elif self.kind == "const":
            raw = self.params["n"]
        else:
            rng = random.Random(f"workload:{self.seed}:{key}")
            p = self.params
            if self.kind == "lognormal":
                raw = p["median"] * math.exp(rng.gauss(0.0, p["sigma"]))
            elif self.kind == "pareto":
                raw = p["min"] / (1.0 - rng.random()) ** (1.0 / p["alpha"])
            elif self.kind == "uniform":
                raw = rng.randint(int(p["lo"]), int(p["hi"]))
            else:  # addchain
                from april_async.tasks.addchain import make_problem

                raw = len(make_problem(self.seed, key).reference) + 1  # + end-of-sequence
        return max(1, min(self.max_tokens, round(raw)))

    def lengths(self, n: int, start: int = 0) -> list[int]:
        return [self.length(k) for k in range(start, start + n)]

    def stats(self, n: int = 20_000) -> dict[str, float]:
        """Median, p90, p99, max and mean over ``n`` samples, and the fraction clipped at the budget."""
        xs = sorted(self.lengths(n))
        at = lambda q: xs[min(n - 1, int(q * n))]  # noqa: E731
        return {"median": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": xs[-1], "mean": sum(xs) / n,
                "clipped": sum(x >= self.max_tokens for x in xs) / n}

    def describe(self) -> str:
        s = self.stats(5000)
        return (f"{self.spec} (budget {self.max_tokens}): median {s['median']}, p90 {s['p90']}, p99 {s['p99']}, "
                f"max {s['max']}, mean {s['mean']:.1f}, {s['clipped']:.1%} at the budget")


_PARAMS = {"lognormal": ("median", "sigma"), "pareto": ("min", "alpha"), "uniform": ("lo", "hi"),
           "const": ("n",), "addchain": (), "file": ()}


def parse_workload(spec: str = DEFAULT, *, max_tokens: int, seed: int = 0) -> Workload:
    """Read a workload spec (see the module docstring); ``WorkloadError`` names what is wrong."""
    if max_tokens < 1:
        raise WorkloadError(f"max_tokens must be at least 1, got {max_tokens}")
    text = NAMED.get(spec.strip(), spec.strip())
    kind, _, rest = text.partition(":")
    if kind not in _PARAMS:
        raise WorkloadError(f"workload {spec!r}: unknown kind {kind!r} (known: {', '.join([*NAMED, *_PARAMS])})")
    if kind == "file":
        return _from_file(spec, rest, max_tokens, seed)
    params: dict[str, float] = {}
    if kind == "const" and rest and "=" not in rest:
        rest = f"n={rest}"
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in _PARAMS[kind]:
            raise WorkloadError(f"workload {spec!r}: {kind} takes {', '.join(_PARAMS[kind]) or 'no parameters'}, "
                                f"got {item!r}")
        try:
            params[key] = float(value[:-3]) * max_tokens if value.endswith("max") else float(value)
        except ValueError:
            raise WorkloadError(f"workload {spec!r}: {key}={value!r} is not a number") from None
    missing = [k for k in _PARAMS[kind] if k not in params]
    if missing:
        raise WorkloadError(f"workload {spec!r}: {kind} needs {', '.join(missing)}")
    if any(v <= 0 for v in params.values()) or (kind == "uniform" and params["lo"] > params["hi"]):
        raise WorkloadError(f"workload {spec!r}: parameters must be positive (and lo <= hi)")
    return Workload(spec, kind, params, max_tokens, seed)


def _from_file(spec: str, path: str, max_tokens: int, seed: int) -> Workload:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise WorkloadError(f"workload {spec!r}: cannot read {path!r}: {e.strerror or e}") from None
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else [ln.split()[0] for ln in text.splitlines()
                                                                          if ln.strip() and not ln.startswith("#")]
        table = [int(float(v)) for v in values]
    except (ValueError, IndexError, json.JSONDecodeError):
        raise WorkloadError(f"workload {spec!r}: {path!r} must hold one length per line or a JSON list") from None
    if not table or min(table) < 1:
        raise WorkloadError(f"workload {spec!r}: {path!r} needs at least one length, all positive")
    random.Random(f"workload-file:{seed}").shuffle(table)
    return Workload(spec, "file", {"path": path}, max_tokens, seed, tuple(table))
