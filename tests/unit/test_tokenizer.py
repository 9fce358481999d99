"""Tokenizers: the built-in character tokenizer and a real tokenizer.json written by the test."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from april_async.model.decoder import CheckpointError
from april_async.model.tokenizer import CharTokenizer, HFTokenizer


def test_char_tokenizer_round_trips_and_refuses_unknown_characters():
    tok = CharTokenizer()
    text = "12+30=42 #### 42"
    ids = tok.encode(text, bos=True)
    assert ids[0] == tok.bos_id and min(ids[1:]) >= 3 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="character '€' is not in the tokenizer's alphabet"):
        tok.encode("5€")


def test_hf_tokenizer_json_round_trips(tmp_path):
    trained = Tokenizer(models.BPE(unk_token="[UNK]"))
    trained.pre_tokenizer = pre_tokenizers.Whitespace()
    trained.train_from_iterator(["the answer is 42", "twelve plus thirty is 42", "</s>"],
                                trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "</s>"]))
    trained.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path)
    ids = tok.encode("the answer is 42")
    assert ids and tok.decode(ids) == "the answer is 42" and tok.eos_id == trained.token_to_id("</s>")


def test_missing_or_broken_tokenizer_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json' is missing"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid tokenizer.json"):
        HFTokenizer(tmp_path / "tokenizer.json")


def test_char_tokenizer_saves_into_a_checkpoint_and_load_tokenizer_finds_it(tmp_path):
    from april_async.model.tokenizer import load_tokenizer

    assert isinstance(load_tokenizer("char"), CharTokenizer)
    custom = CharTokenizer("0123456789+=#\n ")
    custom.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, CharTokenizer) and loaded.alphabet == custom.alphabet
    assert load_tokenizer(tmp_path / CharTokenizer.FILE).alphabet == custom.alphabet
    assert loaded.decode([1, 2, 5, 999, 0]) == "2"  # specials and ids past the vocabulary are skipped


def test_load_tokenizer_prefers_tokenizer_json_and_names_what_is_missing(tmp_path):
    from april_async.model.tokenizer import load_tokenizer

    trained = Tokenizer(models.BPE(unk_token="[UNK]"))
    trained.pre_tokenizer = pre_tokenizers.Whitespace()
    trained.train_from_iterator(["the answer is 42"], trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    trained.save(str(hf_dir / "tokenizer.json"))
    CharTokenizer().save(hf_dir)
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    copy = tmp_path / "copy"
    tok.save(copy)
    assert load_tokenizer(copy).encode("the answer is 42") == tok.encode("the answer is 42")
    with pytest.raises(CheckpointError, match="holds neither tokenizer.json nor char_tokenizer.json"):
        load_tokenizer(tmp_path / "copy" / "..")
    with pytest.raises(CheckpointError, match="not 'char'"):
        load_tokenizer("gpt2")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / CharTokenizer.FILE).write_text('{"kind": "bpe"}')
    with pytest.raises(CheckpointError, match="not a character tokenizer"):
        load_tokenizer(tmp_path / "bad")
