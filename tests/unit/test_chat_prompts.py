"""A checkpoint's own tokenizer, used as ``transformers`` uses it: its special tokens, every EOS id
it and the checkpoint name, and its chat template for the prompts (with a system turn), on
tokenizer files the test trains and writes itself."""

from __future__ import annotations

import json

import pytest

from april_async.model.errors import CheckpointError
from april_async.model.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer
from april_async.tasks.base import Problem
from april_async.tasks.source import PromptSourceConfig, encode_prompt
from april_async.testing.checkpoints import chat_tokenizer

transformers = pytest.importorskip("transformers")

QUESTION = "What is 12 + 30?"
SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def problem(text: str = QUESTION) -> Problem:
    return Problem(prompt_id="p0", prompt=text, task="math", meta={"answer": "42"})


@pytest.fixture
def checkpoint(tmp_path):
    chat_tokenizer(tmp_path)
    # Qwen3 and Llama 3 ship several end ids: the tokenizer's, and lists in the model's files.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "eos_token_id": 0}))
    return tmp_path


def test_prompts_go_through_the_checkpoints_chat_template_as_transformers_applies_it(checkpoint):
    tok = load_tokenizer(checkpoint)
    reference = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    assert isinstance(tok, HFTokenizer) and tok.chat_template
    for system, messages in [(None, [{"role": "user", "content": QUESTION}]),
                             (SYSTEM, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])]:
        want = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert encode_prompt(problem(), tok, system=system) == want  # chat by default: the checkpoint ships a template
        assert encode_prompt(problem(), tok, chat=True, system=system) == want
    text = tok.decode(encode_prompt(problem(), tok, system=SYSTEM))
    assert text.endswith(f"{SYSTEM}\nuser\n{QUESTION}\nassistant\n"), text  # the specials are skipped when decoding
    # Without the template: the plain text, with whatever specials the tokenizer adds itself.
    assert encode_prompt(problem(), tok, chat=False) == reference(QUESTION)["input_ids"]


def test_every_end_id_the_checkpoint_names_is_kept(checkpoint):
    tok = load_tokenizer(checkpoint)
    im_end = transformers.AutoTokenizer.from_pretrained(str(checkpoint)).convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_id == im_end == 2
    assert tok.eos_ids == (2, 0)  # the tokenizer's, then generation_config's and config.json's, once each


def test_a_chat_prompt_without_a_template_is_refused_by_name(tmp_path):
    chat_tokenizer(tmp_path, chat=False)
    tok = load_tokenizer(tmp_path)
    assert not tok.chat_template
    assert encode_prompt(problem(), tok) == tok._tok(QUESTION)["input_ids"]  # no template: plain by default
    with pytest.raises(CheckpointError, match="chat = true, but the tokenizer ships no chat template"):
        encode_prompt(problem(), tok, chat=True)
    with pytest.raises(CheckpointError, match="built-in character tokenizer has none"):
        encode_prompt(problem("12+30"), CharTokenizer(), chat=True)
    assert encode_prompt(problem("12+30"), CharTokenizer()) == CharTokenizer().encode("12+30", bos=True)


def test_a_system_prompt_without_chat_is_a_config_error():
    with pytest.raises(ValueError, match="system_prompt is only used with chat"):
        PromptSourceConfig(kind="addchain", chat=False, system_prompt=SYSTEM)
    assert PromptSourceConfig(kind="addchain", system_prompt=SYSTEM).chat is None  # None: the tokenizer decides
