"""Hypothesis strategies for fuzzing the wire."""

from __future__ import annotations

import msgpack
from hypothesis import strategies as st

from april_async.wire import messages as m

frames_strategy = st.lists(  # one message's frames: junk, any msgpack, or an envelope with a junk body
    st.one_of(
        st.binary(max_size=64),
        st.builds(msgpack.packb, st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=8)
                                              | st.binary(max_size=8),
                                              lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                                              max_leaves=12)),
        st.builds(lambda body, t: msgpack.packb({"msg_id": "f", "msg_type": t, "sender": "fuzz", "seq": 1,
                                                 "proto_version": "1.0", "sent_at": 0.0, "body": body}),
                  st.dictionaries(st.text(max_size=10), st.integers(-2**40, 2**40) | st.text(max_size=5), max_size=5),
                  st.sampled_from(sorted(m.MESSAGE_TYPES))),
    ),
    min_size=1,
    max_size=3,
)
