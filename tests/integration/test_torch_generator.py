"""The generator actor on the embedded PyTorch engine, against the real broker, end to end.

The test writes a tiny Hugging Face checkpoint, runs a broker, a torch generator and a scorer as
processes, and as the learner recomputes the log-prob of every delivered token with the same
checkpoint: behaviour and learner log-probs agree across processes. It then publishes version 1
(a second checkpoint) and checks that later tokens carry it.
"""

import torch

from april_async.wire import messages as m
from april_async.testing.cluster import Cluster
from april_async.testing.models import checkpoint, learner_logprobs

def test_torch_generator_end_to_end_with_logprob_agreement_and_a_weight_update(tmp_path):
    v0 = checkpoint(tmp_path / "v0", 0)
    checkpoint(tmp_path / "v1", 1)
    cluster = Cluster(tmp_path)
    # The test's learner is a bare client that is silent while the test computes reference log-probs: a
    # broker that dropped its session for that refused the weights_published sent next (no session), and the
    # generator never heard of version 1. The broker waits 10 s before it calls a peer gone here.
    cluster.broker({"mode": "async", "batch_groups": 2, "group_size": 2, "max_response_tokens": 12, "staleness_bound": 4},
                   extra={"prompts.length": 5, "link.peer_timeout_s": 10.0})
    cluster.generator("gen-torch", engine="torch", checkpoint=str(tmp_path / "v0"), slots=4, max_seq_len=64)
    cluster.scorer()
    learner = cluster.learner()
    try:
        batch = None
        for _ in range(60):
            cluster.assert_alive()
            batch = learner.next_batch(1.0)
            if batch is not None:
                break
        assert batch is not None, cluster.dump_logs()
        worst = 0.0
        for g in batch.groups:
            prompt = batch.prompt_tokens[g.prompt_offset : g.prompt_offset + g.prompt_len].tolist()
            for s in g.samples:
                assert [v.version for v in s.versions] == [0]
                behaviour = torch.tensor(batch.logprobs[s.response_offset : s.response_offset + s.response_len])
                worst = max(worst, (learner_logprobs(v0, batch, s, prompt) - behaviour).abs().max().item())
        assert worst <= 1e-4, worst
        learner.policy_version = 1
        learner.peer.send(m.WeightsPublished(version=1, source=str(tmp_path / "v1")))
        later = None
        for _ in range(60):
            b = learner.next_batch(1.0)
            if b is not None and any(v.version == 1 for g in b.groups for s in g.samples for v in s.versions):
                later = b
                break
        assert later is not None, cluster.dump_logs()
        assert "weights_loaded" in cluster.logs["gen-torch"].read_text()
    finally:
        learner.close()
        codes = cluster.stop_all()
    assert all(c == 0 for c in codes.values()), codes
