"""SGLang's response contract as ``april_async.sglang.api`` reads it (shapes from sglang 0.5.10.post1,
0.5.15.post1 and 0.5.23: ``managers/tokenizer_manager.py``, ``managers/schedule_batch.py``)."""

import pytest
import torch

from april_async.sglang import api
from april_async.sglang.api import SGLangError
from april_async.weights.flat import layout, tensor_buckets

TOKENS = [(-0.5, 7), (-1.25, 3), (-0.125, 9), (-2.0, 2), (-0.75, 11)]


def event(pairs, total, finish=None, version="default"):
    return {"text": "", "output_ids": [t for _, t in pairs],
            "meta_info": {"id": "r", "finish_reason": finish, "completion_tokens": total, "weight_version": version,
                          "output_token_logprobs": [[lp, t, None] for lp, t in pairs]}}


def read(events):
    stream = api.Stream("http://s", "r")
    deltas = [stream.take(e) for e in events]
    return ([t for d in deltas for t in d.tokens], [lp for d in deltas for lp in d.logprobs], deltas)


def test_cumulative_and_incremental_streams_give_the_same_tokens():
    cuts = [1, 3, 5]
    cumulative = [event(TOKENS[:c], c) for c in cuts]
    incremental = [event(TOKENS[a:b], b) for a, b in zip([0, *cuts], cuts)]
    # sglang 0.5.10 with --incremental-streaming-output: ids sliced, log-probs still cumulative
    mixed = [event(TOKENS[:c], c) for c in cuts]
    for e, (a, b) in zip(mixed, zip([0, *cuts], cuts)):
        e["output_ids"] = [t for _, t in TOKENS[a:b]]
    cumulative[-1]["meta_info"]["finish_reason"] = {"type": "stop", "matched": 11}
    for events in (cumulative, incremental, mixed):
        tokens, logprobs, _ = read(events)
        assert tokens == [t for _, t in TOKENS] and logprobs == [lp for lp, _ in TOKENS]
    assert read(cumulative)[2][-1].finish == "stop"


def test_finish_reasons_and_weight_versions_are_read():
    _, _, deltas = read([event(TOKENS[:2], 2, version="4"),
                         event(TOKENS[:3], 3, {"type": "abort", "message": "Aborted", "status_code": None}, "5")])
    assert [d.weight_version for d in deltas] == [4, 5]
    assert deltas[-1].finish == "abort" and deltas[-1].finish_detail["message"] == "Aborted"
    assert read([event([], 0, {"type": "length", "length": 0})])[2][0].finish == "length"
    assert read([event(TOKENS[:1], 1)])[2][0].weight_version is None  # "default": never updated


@pytest.mark.parametrize("bad, words", [
    ({"error": {"message": "boom"}}, "server error: boom"),
    ({"text": ""}, "no meta_info"),
    ({"meta_info": {"completion_tokens": 1}}, "output_token_logprobs"),
    (event(TOKENS[:2], 1), "2 log-probs for 1 new"),
    (event([(-0.5, "x")], 1), "is not [logprob, token_id, text]"),
    (event(TOKENS[:1], 1, {"type": "cancelled"}), "finish_reason"),
    ([1, 2], "not an object"),
])
def test_events_that_break_the_contract_are_typed_errors(bad, words):
    with pytest.raises(SGLangError, match=words.replace("[", r"\[").replace("]", r"\]")) as e:
        api.Stream("http://s", "r").take(bad)
    assert e.value.server == "http://s" and e.value.endpoint == "/generate"


def test_a_stream_that_goes_backwards_is_refused():
    stream = api.Stream("http://s", "r")
    stream.take(event(TOKENS[:3], 3))
    with pytest.raises(SGLangError, match="completion_tokens 2 after 3"):
        stream.take(event(TOKENS[:2], 2))


def test_request_ids_are_prefix_free_because_sglang_aborts_by_prefix():
    ids = [api.request_id("april-gen-0-1", lease, attempt) for lease in (1, 12, 123) for attempt in (0, 1, 10)]
    assert len(set(ids)) == len(ids)
    assert not [(a, b) for a in ids for b in ids if a != b and b.startswith(a)]


def test_sampling_params_follow_sglang_conventions():
    p = api.sampling_params(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=(2,), seed=3)
    assert p["top_k"] == -1 and p["stop_token_ids"] == [2] and "sampling_seed" not in p
    assert api.sampling_params(max_new_tokens=5, temperature=1.0, top_p=1.0, top_k=8, stop_token_ids=(), seed=3,
                               send_seed=True)["sampling_seed"] == 3
    body = api.generate_body([1, 2], p, "rid;", stream=True)
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1 and body["input_ids"] == [1, 2]


def test_weight_versions_parse_to_policy_versions():
    assert [api.parse_weight_version(v) for v in ("3", " 12 ", 4, "default", None, True)] == [3, 12, 4, None, None, None]


def test_tensor_buckets_keep_whole_tensors_within_the_size():
    """The push to SGLang's servers sends ``flat.tensor_buckets``' tensors, one bucket per call."""
    specs, _ = layout((f"t{i}", torch.float32, [n]) for i, n in enumerate([4, 4, 10, 1, 1]))  # 16, 16, 40, 4, 4 B

    def indices(bucket_bytes):
        return [idx for _, _, idx in tensor_buckets(specs, bucket_bytes)]

    assert indices(32) == [[0, 1], [2], [3, 4]]
    assert indices(1) == [[0], [1], [2], [3], [4]]
    assert indices(1 << 20) == [[0, 1, 2, 3, 4]]


def test_a_refusal_is_typed_and_read_by_its_message():
    """``http_server.py`` ``generate_request``: a streamed refusal is an ``{"error": {"message"}}`` event."""
    long = "Requested token count exceeds the model's maximum context length of 512 tokens."
    with pytest.raises(api.Refused) as e:
        api.Stream("http://s", "r").take({"error": {"message": long, "code": 400}})
    assert e.value.message == long and e.value.per_request
    for message, mine in ((long, True), ("Duplicate request ID detected: r", True),
                          ("The input (600 tokens) is longer than the model's context length (512 tokens).", True),
                          ("temperature must be non-negative, got -1.0", False), ("unknown field `x`", False)):
        assert api.refusal_is_per_request(message) is mine, message


def test_status_coded_aborts_and_weight_version_spans_are_read():
    """``schedule_batch.py`` ``FINISH_ABORT`` (status_code) and ``utils/weight_versions.py`` spans."""
    e = event(TOKENS[:4], 4, {"type": "abort", "message": "waited too long", "status_code": 503}, "5")
    e["meta_info"]["weight_versions"] = [{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 4}]
    stream = api.Stream("http://s", "r")
    first = event(TOKENS[:1], 1, version="4")
    first["meta_info"]["weight_versions"] = [{"version": "4", "start": 0, "end": 1}]
    assert stream.take(first).versions == ["4"]
    d = stream.take(e)
    assert d.versions == ["5", "5", "5"] and d.status_code == 503 and d.finish == "abort"
    assert read([event(TOKENS[:1], 1, {"type": "abort", "message": "Aborted", "status_code": None})])[2][0].status_code \
        is None


def test_adapter_names_bodies_and_lora_refusals():
    assert api.adapter_name(12) == "april-v12" and api.adapter_version("april-v12") == 12
    assert [api.adapter_version(n) for n in ("april-vx", "other", None, "april-v")] == [None] * 4
    body = api.generate_body([1, 2], {}, "r;", stream=True, lora_path="april-v3")
    assert body["lora_path"] == "april-v3"
    assert "lora_path" not in api.generate_body([1, 2], {}, "r;", stream=True)
    off = api.LoraRefused("http://s", "/load_lora_adapter",
                          "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
    assert off.not_enabled and isinstance(off, SGLangError) and off.status == 400
    dup = api.LoraRefused("http://s", "/load_lora_adapter",
                          "Failed to load LoRA adapter a because it is already loaded")
    assert not dup.not_enabled and "already loaded" in str(dup)
