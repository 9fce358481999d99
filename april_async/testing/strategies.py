"""Hypothesis strategies for fuzzing the wire, and the search settings of the planted-bug tests."""

from __future__ import annotations

import msgpack
from hypothesis import HealthCheck, Phase, settings
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


def planted_search(max_examples: int, steps: int) -> settings:
    """The fixed search a planted-bug test runs a state machine with: the same examples every run
    (a planted bug is found, or the test fails), stopping at the first failure, unshrunk."""
    return settings(max_examples=max_examples, stateful_step_count=steps, deadline=None, database=None,
                    derandomize=True, report_multiple_bugs=False, phases=(Phase.generate,),
                    suppress_health_check=list(HealthCheck))
