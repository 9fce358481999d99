"""april-async: Active Partial Rollouts (APRIL) as a fully asynchronous actor system."""

__version__ = "0.1.0"
