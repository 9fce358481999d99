"""Moved to ``april_async.engines.sglang_engine``; kept only for ``cli.py``'s generator build, which
another part of issue 26 replaces with ``engines.factory.build_engine`` (then delete this file)."""

from april_async.engines.sglang_engine import SGLangEngine  # noqa: F401
