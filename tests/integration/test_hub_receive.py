"""The hub's receive path: a large bulk frame (a weights version) is taken without a copy, a small
one as ``bytes``, and both decode to the bytes that were sent."""

from __future__ import annotations

import time

import numpy as np
import zmq

from april_async.config import LinkConfig
from april_async.transport.hub import ZERO_COPY_MIN_BYTES, Hub
from april_async.wire import messages as m
from april_async.wire.codec import encode

LINK = LinkConfig(heartbeat_interval_s=0.1, peer_timeout_s=1.0, max_message_bytes=8 << 20)


def _update(version: int, num_bytes: int) -> m.WeightsUpdate:
    data = (np.arange(num_bytes) % 251).astype(np.uint8)
    return m.WeightsUpdate(version=version, tensors=[m.TensorSpec("w", "float32", [num_bytes // 4], 0)], data=data)


def test_large_bulk_frames_are_views_of_the_received_message_and_small_ones_bytes():
    hub = Hub("tcp://127.0.0.1:0", link=LINK, name="broadcaster")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"learner-0")
    dealer.connect(hub.endpoint)
    try:
        sizes = {1: 4 << 20, 2: ZERO_COPY_MIN_BYTES - 4}
        dealer.send_multipart(encode(m.Hello(role="learner", instance="learner-0"), sender="learner-0", seq=1))
        for seq, (version, size) in enumerate(sizes.items(), start=2):
            dealer.send_multipart(encode(_update(version, size), sender="learner-0", seq=seq), copy=False)
        got = {}
        deadline = time.monotonic() + 5
        while len(got) < len(sizes) and time.monotonic() < deadline:
            for identity, msg in hub.poll(0.1):
                assert identity == b"learner-0"
                if isinstance(msg.body, m.WeightsUpdate):
                    got[msg.body.version] = msg.body.data
        assert sorted(got) == [1, 2]
        for version, data in got.items():
            assert np.array_equal(data, (np.arange(sizes[version]) % 251).astype(np.uint8))
            assert not data.flags.writeable
        assert isinstance(got[1].base, memoryview), "a weights version must not be copied out of ZeroMQ"
        assert isinstance(got[2].base, bytes)
    finally:
        dealer.close()
        hub.close()
