"""Where a generator's policy versions come from: one ``WeightsLink``, chosen once when it starts.

A version is announced to a generator twice on the wire: by the broadcaster, which holds the
weights and fans them out (``weights_announce``, or its heartbeats to a generator on SGLang
servers), and by the broker, which forwards the ``weights_published`` of whoever made the version
(the broadcaster once a round is over, or a learner without one, naming the checkpoint directory
it saved). A generator takes its versions from one of them, the one that holds the weights for it:

    WeightSubscriber    a broadcaster, an engine that loads weights in process (torch): the bytes
                        come over the broadcaster's group (``weights.subscriber``);
    ServerWeightsLink   a broadcaster, an engine whose servers are pushed to (sglang): the
                        broadcaster's heartbeats say when to read the servers' versions;
    BrokerNotices       no broadcaster: the broker's ``weights_published`` is the version notice
                        (load the checkpoint it names; read the servers' versions; or, for an
                        engine that holds no weights, take its number).

A link that takes its versions from the broadcaster ignores the broker's ``weights_published``
(``published`` does nothing): the broker still sends it, and still gates each lease on its
``min_policy_version``, which the generator honours whatever the link.

``weights_link`` in ``generator.actor`` chooses; this module imports no torch.
"""

from __future__ import annotations

from april_async.wire import messages as m


class WeightsLink:
    """The base of a generator's weights link; the defaults are those of a link with nothing to
    wait on, poll or close, which takes no version notice from the broker."""

    def waitables(self) -> list:
        """What an idle generator waits on besides its broker session (``transport.peer.wait_any``)."""
        return []

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Take what arrived and load a version that is in (between decode steps); True when one was."""
        return False

    def published(self, notice: m.WeightsPublished) -> None:
        """The broker's ``weights_published``: a version notice only for ``BrokerNotices``."""

    def close(self) -> None:
        """Say bye to the broadcaster, if any, and let go of what the link holds."""


class BrokerNotices(WeightsLink):
    """No broadcaster: each ``weights_published`` the broker forwards is a version notice. What it
    does is chosen once, by ``engine.caps.weights``:

    - ``in_process``: load the checkpoint directory it names (``source``) between decode steps; a
      notice without one names nothing to load, and a directory that cannot be read is logged and
      skipped (the next version is loaded as usual);
    - ``pushed``: read the servers' versions now (``refresh_versions``), rather than at the next
      liveness probe;
    - ``none`` (the scripted test engine holds no weights): the engine's version becomes the notice's.

    A notice at or below the version the engine holds is stale and ignored."""

    def __init__(self, engine, log):
        self.engine, self.log = engine, log
        self._take = {"in_process": self._load, "pushed": self._refresh, "none": self._adopt}[engine.caps.weights]

    def published(self, notice: m.WeightsPublished) -> None:
        if notice.version > self.engine.policy_version:
            self._take(notice)

    def _load(self, notice: m.WeightsPublished) -> None:
        if notice.source is None:
            return
        from april_async.model.decoder import CausalLM, CheckpointError

        try:
            state = CausalLM.from_pretrained(notice.source).state_dict()
        except CheckpointError as e:
            self.log.error("weights_not_loaded", version=notice.version, source=notice.source, error=str(e))
            return
        self.engine.load_weights(state, notice.version)
        self.log.info("weights_loaded", version=notice.version, source=notice.source)

    def _refresh(self, notice: m.WeightsPublished) -> None:
        self.engine.refresh_versions()

    def _adopt(self, notice: m.WeightsPublished) -> None:
        self.engine.policy_version = notice.version
