"""Hypothesis profiles: ``dev`` (default, quick) and ``ci`` (what .ci/run uses).

Pick one with HYPOTHESIS_PROFILE=ci. The broker state machine runs up to
``max_examples`` × ``stateful_step_count`` steps per test (CI: 400 × 50 per mode).
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
