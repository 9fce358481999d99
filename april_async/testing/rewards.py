"""Reward plug-ins for the live-swap tests (named as ``package.module:function`` in a scorer's config)."""

from april_async.scorer.rewards import RewardInput


def minus_one(x: RewardInput) -> float:
    """A reward no built-in gives: every batch scored after the swap shows it."""
    return -1.0
