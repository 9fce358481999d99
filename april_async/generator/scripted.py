"""Moved to ``april_async.engines.scripted``; kept only for ``cli.py``'s generator build, which
another part of issue 26 replaces with ``engines.factory.build_engine`` (then delete this file)."""

from april_async.engines.scripted import ScriptedEngine  # noqa: F401
