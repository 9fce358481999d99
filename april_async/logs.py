"""structlog set-up: one structured event per line, console for people, JSON for machines."""

from __future__ import annotations

import logging
import sys

import structlog


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
