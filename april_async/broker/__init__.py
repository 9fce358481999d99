"""The broker: the rollout ledger and the APRIL policy (``core``), and its config."""

from april_async.broker.config import RolloutConfig
from april_async.broker.core import BrokerCore, Place

__all__ = ["BrokerCore", "Place", "RolloutConfig"]
