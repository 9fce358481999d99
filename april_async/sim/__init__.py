"""Simulated clusters around the real broker core."""
