"""Tokenizers: Hugging Face ``tokenizer.json`` for real models, a small built-in one for the
synthetic tasks. Both map text <-> token ids and name their special tokens."""

from __future__ import annotations

from pathlib import Path

from april_async.model.decoder import CheckpointError


class CharTokenizer:
    """The built-in tokenizer of the synthetic tasks: one id per character of a fixed alphabet.

    Ids 0..2 are ``<pad>``, ``<bos>``, ``<eos>``; a character outside the alphabet is an error
    naming it (synthetic data never needs an unknown token).
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str = "0123456789+-*/=()#. abcdefghijklmnopqrstuvwxyz\n{}"):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("the alphabet repeats a character")
        self.alphabet = alphabet
        self._ids = {ch: i + len(self.SPECIALS) for i, ch in enumerate(alphabet)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.SPECIALS) + len(self.alphabet)

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        try:
            ids = [self._ids[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet") from None
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        n = len(self.SPECIALS)
        return "".join(self.alphabet[i - n] for i in ids if i >= n)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library), as shipped with a checkpoint."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - tokenizers comes with the test extra and transformers
            raise CheckpointError("reading tokenizer.json needs the 'tokenizers' package") from None
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"tokenizer file {str(path)!r} is missing")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own exception type for a bad file
            raise CheckpointError(f"{path}: not a valid tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = next((self._tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>")
                            if self._tok.token_to_id(t) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
