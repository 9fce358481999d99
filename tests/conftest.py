"""Hypothesis profiles: ``dev`` (default, quick) and ``ci`` (what .ci/run uses).

Pick one with HYPOTHESIS_PROFILE=ci. The broker state machine runs up to
``max_examples`` × ``stateful_step_count`` steps per test (CI: 400 × 50 per mode).
"""

import os

from hypothesis import HealthCheck, settings

COMMON = dict(
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile("ci", max_examples=400, print_blob=True, **COMMON)
settings.register_profile("dev", max_examples=60, **COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
