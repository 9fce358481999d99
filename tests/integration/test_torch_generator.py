"""The generator actor on the embedded PyTorch engine, against the real broker, end to end.

The test writes a tiny Hugging Face checkpoint, runs a broker, a torch generator and a scorer as
processes, and as the learner recomputes the log-prob of every delivered token with the same
checkpoint: behaviour and learner log-probs agree across processes. It then publishes version 1
(a second checkpoint) and checks that later tokens carry it.
"""

import torch

from april_async.model.decoder import CausalLM, ModelConfig
from april_async.wire import messages as m
from tests.integration.harness import Cluster

TINY = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


def checkpoint(path, seed):
    torch.manual_seed(seed)
    CausalLM(TINY).save_pretrained(path)
    return CausalLM.from_pretrained(path)


def learner_logprobs(model, batch, sample, prompt):
    resp = batch.response_tokens[sample.response_offset : sample.response_offset + sample.response_len]
    seq = torch.tensor([list(prompt) + resp.tolist()])
    with torch.no_grad():
        logits, _ = model(seq)
    lp = torch.log_softmax(logits[0, len(prompt) - 1 : -1], -1)
    return lp.gather(1, torch.tensor(resp.tolist())[:, None])[:, 0]


def test_torch_generator_end_to_end_with_logprob_agreement_and_a_weight_update(tmp_path):
    v0 = checkpoint(tmp_path / "v0", 0)
    checkpoint(tmp_path / "v1", 1)
    cluster = Cluster(tmp_path)
    cluster.broker({"mode": "async", "batch_groups": 2, "group_size": 2, "max_response_tokens": 12, "staleness_bound": 4},
                   extra={"prompts.length": 5})
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
