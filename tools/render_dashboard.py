"""Draw a Grafana dashboard's panels from a Prometheus into one PNG, with no Grafana.

    .venv/bin/python tools/render_dashboard.py --prometheus http://127.0.0.1:9090 --last 600 --out dash.png
    .venv/bin/python tools/render_dashboard.py --start 2026-11-29T05:50:00Z --end 2026-11-29T05:55:00Z \\
        --dashboard launch/grafana/april.json --out docs/dashboard.png --require-data

Every panel's queries (``expr``) run through ``/api/v1/query_range`` over the window (``--start``/
``--end``: Unix seconds or ISO 8601, a time without zone being UTC; or the last ``--last`` seconds),
at a step that gives about 300 points (``--step`` to set it); each panel is a subplot placed by its
``gridPos``, one line per returned series named by the target's ``legendFormat``. One line is
printed per panel: its title, how many series and finite points it got. ``--require-data`` exits 1
when a panel got none (naming them; ``--allow-empty TITLE`` exempts a panel); a query Prometheus
refuses or cannot answer exits 2 naming the panel and its expression."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from april_async.experiments.dashboard import (  # noqa: E402
    QueryError,
    choose_step,
    draw,
    fetch,
    load_dashboard,
)


def when(text: str) -> float:
    """Unix seconds from ``text``: a number, or ISO 8601 (UTC unless it names a zone)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither Unix seconds nor an ISO 8601 time") from None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus' base URL")
    ap.add_argument("--dashboard", type=Path, default=ROOT / "launch" / "grafana" / "april.json")
    ap.add_argument("--out", type=Path, default=Path("dashboard.png"), help="the PNG to write")
    ap.add_argument("--start", type=when, help="the window's start (Unix seconds or ISO 8601)")
    ap.add_argument("--end", type=when, help="the window's end (default: now)")
    ap.add_argument("--last", type=float, help="the window: the last SECONDS up to --end")
    ap.add_argument("--step", type=float, help="seconds between points (default: about 300 points)")
    ap.add_argument("--title", help="the picture's title (default: the dashboard's)")
    ap.add_argument("--width", type=float, default=16.0, help="the picture's width in inches")
    ap.add_argument("--dpi", type=int, default=80)
    ap.add_argument("--require-data", action="store_true", help="exit 1 when a panel got no data")
    ap.add_argument("--allow-empty", action="append", default=[], metavar="TITLE",
                    help="a panel --require-data lets be empty (repeatable)")
    args = ap.parse_args(argv)
    args.end = time.time() if args.end is None else args.end
    if (args.start is None) == (args.last is None):
        ap.error("give the window as --start (and --end) or as --last SECONDS")
    if args.start is None:
        args.start = args.end - args.last
    if args.end <= args.start:
        ap.error(f"the window ends ({args.end:.0f}) before it starts ({args.start:.0f})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    title, panels = load_dashboard(args.dashboard)
    if not panels:
        print(f"render_dashboard: {args.dashboard} has no panel with a query", file=sys.stderr)
        return 2
    unknown = set(args.allow_empty) - {p.title for p in panels}
    if unknown:
        print(f"render_dashboard: --allow-empty names no panel: {sorted(unknown)}", file=sys.stderr)
        return 2
    step = args.step or choose_step(args.start, args.end)
    results = []
    for panel in panels:
        try:
            result = fetch(args.prometheus, panel, args.start, args.end, step)
        except QueryError as e:
            print(f"render_dashboard: {e}", file=sys.stderr)
            return 2
        results.append(result)
        points = result.points
        print(f"{panel.title}: {len(result.series)} series, {points} points", flush=True)
    began = datetime.fromtimestamp(args.start, timezone.utc)
    span = f"{began:%Y-%m-%d %H:%M:%S}Z + {args.end - args.start:.0f} s"
    out = draw(results, args.out, (args.start, args.end), title=f"{args.title or title} ({span})",
               width_in=args.width, dpi=args.dpi)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB; step {step:g} s)")
    empty = [r.panel.title for r in results if not r.points and r.panel.title not in args.allow_empty]
    if args.require_data and empty:
        print(f"render_dashboard: no data in {len(empty)} panel(s): {'; '.join(empty)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
