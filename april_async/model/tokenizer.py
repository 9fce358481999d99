"""Tokenizers: Hugging Face ``tokenizer.json`` for real models, a small built-in one for the
synthetic tasks. Both map text <-> token ids and name their special tokens.

``load_tokenizer(spec)`` is how every actor gets the run's tokenizer from a config string: the
word ``char`` (the built-in one), or a checkpoint directory that holds ``tokenizer.json`` or the
built-in one's ``char_tokenizer.json`` (``save`` writes either into a checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

from april_async.model.errors import CheckpointError


class CharTokenizer:
    """The built-in tokenizer of the synthetic tasks: one id per character of a fixed alphabet.

    Ids 0..2 are ``<pad>``, ``<bos>``, ``<eos>``; a character outside the alphabet is an error
    naming it (synthetic data never needs an unknown token).
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    FILE = "char_tokenizer.json"

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
        """Special tokens and ids outside the vocabulary are skipped (as the tokenizers library does)."""
        n, size = len(self.SPECIALS), self.vocab_size
        return "".join(self.alphabet[i - n] for i in ids if n <= i < size)

    def save(self, directory: Path) -> Path:
        """Write ``char_tokenizer.json`` into ``directory`` (a checkpoint); returns its path."""
        path = Path(directory) / self.FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kind": "char", "specials": list(self.SPECIALS), "alphabet": self.alphabet},
                                   indent=2))
        return path

    @classmethod
    def load(cls, path: Path) -> CharTokenizer:
        """Read ``char_tokenizer.json`` (or the directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / cls.FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"tokenizer file {str(path)!r} is missing") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("kind") != "char" or not isinstance(data.get("alphabet"), str):
            raise CheckpointError(f"{path}: not a character tokenizer (needs kind 'char' and an alphabet)")
        if data.get("specials", list(cls.SPECIALS)) != list(cls.SPECIALS):
            raise CheckpointError(f"{path}: specials {data['specials']!r} differ from {list(cls.SPECIALS)!r}")
        try:
            return cls(data["alphabet"])
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None


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
        self.path = path
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = next((self._tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>")
                            if self._tok.token_to_id(t) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def save(self, directory: Path) -> Path:
        """Write ``tokenizer.json`` into ``directory`` (a checkpoint); returns its path."""
        path = Path(directory) / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path))
        return path


def load_tokenizer(spec: str | Path) -> CharTokenizer | HFTokenizer:
    """The tokenizer a config names: ``char`` (the built-in alphabet), a directory holding
    ``tokenizer.json`` or ``char_tokenizer.json``, or the path of either file."""
    if str(spec) == "char":
        return CharTokenizer()
    path = Path(spec)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer(path)
        if (path / CharTokenizer.FILE).is_file():
            return CharTokenizer.load(path)
        raise CheckpointError(f"tokenizer {str(spec)!r}: the directory holds neither tokenizer.json "
                              f"nor {CharTokenizer.FILE}")
    if path.name == CharTokenizer.FILE:
        return CharTokenizer.load(path)
    if path.name.endswith(".json") and path.is_file():
        return HFTokenizer(path)
    raise CheckpointError(f"tokenizer {str(spec)!r}: not 'char', and no tokenizer directory or file of that name")
