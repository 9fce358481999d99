"""The testing kit: what the tests use to start real processes and stand in for the parts they do
not run. Not used by any actor or tool, and not in the wheel (``pyproject.toml`` excludes it).

    procs          ``april_async.runtime``'s child processes, from the checkout; ``wait_for``
    cluster        actor processes on loopback through the real CLI, the scripted engine's check
    runs           whole ``april up`` runs: a tiny run's config, its children, its metrics
    fake_broker    a ``Hub`` standing in for the broker where a test needs only its replies
    models         a tiny model shape and a learner's log-probs of a delivered sample
    strategies     hypothesis strategies of malformed frames
    rewards        reward plug-ins the live-swap tests name
    weights        the broadcaster's test cluster: members over a recording engine, small policies
"""
