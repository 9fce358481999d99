"""structlog set-up: one structured event per line, console for people, JSON for machines."""

from __future__ import annotations

import logging
import sys

# structlog.dev imports rich (and pygments with it) when it is installed, for pretty tracebacks:
# ~80 ms of CPU at every process's start (~400 of them in the test suite). The console never uses
# it here (format_exc_info below turns exceptions into text first), so rich is kept out of that
# first import; ``import rich`` works as before afterwards.
_hide_rich = "rich" not in sys.modules and "structlog" not in sys.modules
if _hide_rich:
    sys.modules["rich"] = None  # an import of it now raises ImportError, which structlog.dev expects
try:
    import structlog
finally:
    if _hide_rich:
        del sys.modules["rich"]


def configure(*, json: bool = False, level: str = "info") -> None:
    """Configure structlog once per process; every event goes to stderr."""
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(**context):
    """A logger bound to ``context`` (actor, instance, ...)."""
    return structlog.get_logger().bind(**context)
