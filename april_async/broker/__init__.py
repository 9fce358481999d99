"""The broker: the rollout ledger and the APRIL policy (``core``: ``ledger``, ``policy``,
``delivery``, ``snapshot``), its service and write-ahead journal (``service``, ``journal``,
``records``), and its config."""

from april_async.broker.config import RolloutConfig
from april_async.broker.core import BrokerCore, Place

__all__ = ["BrokerCore", "Place", "RolloutConfig"]
