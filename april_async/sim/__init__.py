"""Simulated clusters around the real broker core: the settings (``config``), the event-driven
simulation (``simulation``), cost presets, workloads, and the command line (``report``)."""
