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

    chat_template = False
    """The built-in tokenizer has no chat template: its tasks' prompts are plain text."""

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def encode_prompt(self, text: str, *, chat: bool, system: str | None = None,
                      tools: list[dict] | None = None) -> list[int]:
        """``<bos>`` and ``text``'s ids (``chat`` is refused: there is no template; no ``tools``)."""
        if chat:
            raise CheckpointError("chat = true needs a tokenizer with a chat template: the built-in character "
                                  "tokenizer has none")
        return self.encode(text, bos=True)

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
    """A checkpoint's Hugging Face tokenizer, loaded and used as ``transformers`` does
    (``AutoTokenizer``): ``tokenizer.json`` with what ``tokenizer_config.json`` and
    ``special_tokens_map.json`` say of the special tokens, and the chat template the checkpoint
    ships (in ``tokenizer_config.json`` or ``chat_template.jinja``). A lone ``tokenizer.json``
    file is read as the ``tokenizers`` library defines it, with no special tokens named."""

    FALLBACK_EOS = ("<|endoftext|>", "</s>", "<eos>")
    """End-of-sequence tokens looked for when the tokenizer's files name none."""

    def __init__(self, path: Path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise CheckpointError(f"tokenizer file {str(file)!r} is missing")
        try:
            import transformers

            transformers.utils.logging.set_verbosity_error()
            if path.is_dir():
                self._tok = transformers.AutoTokenizer.from_pretrained(str(path))
            else:
                self._tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(file))
        except Exception as e:  # the libraries raise their own exception types for a bad file
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{file}: not a valid tokenizer.json ({first})") from None
        self.path = file
        self.directory = path if path.is_dir() else None
        self.vocab_size = len(self._tok)
        named = self._tok.eos_token_id
        if named is None:
            named = next((i for i in map(self._tok.convert_tokens_to_ids, self.FALLBACK_EOS)
                          if i is not None and i != self._tok.unk_token_id), None)
        self.eos_id: int | None = named
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(
            ([named] if named is not None else []) + list(checkpoint_eos_ids(path) if path.is_dir() else ())))
        """Every id that ends a response: the tokenizer's end-of-sequence token, then those of the
        checkpoint's model files (``checkpoint_eos_ids``; a list in Qwen3 and Llama 3)."""

    @property
    def chat_template(self) -> bool:
        """Whether the checkpoint ships a chat template."""
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, no special token added."""
        return self._tok.encode(text, add_special_tokens=False)

    def encode_prompt(self, text: str, *, chat: bool, system: str | None = None,
                      tools: list[dict] | None = None) -> list[int]:
        """A prompt as the model sees it. ``chat``: the chat template over ``chat_messages(text,
        system)``, with ``tools`` (the function schemas a tool-using task shows the model) and the
        generation prompt (the template writes every special token); else ``text`` with the special
        tokens the tokenizer adds itself (Llama's ``<bos>``)."""
        if not chat:
            return self._tok.encode(text, add_special_tokens=True)
        if not self.chat_template:
            raise CheckpointError(f"{self.path.parent}: chat = true, but the tokenizer ships no chat template")
        rendered = self._tok.apply_chat_template(chat_messages(text, system), tools=tools,
                                                 add_generation_prompt=True, tokenize=False)
        return self._tok.encode(rendered, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def save(self, directory: Path) -> Path:
        """Write the tokenizer's files into ``directory`` (a checkpoint); returns ``tokenizer.json``'s path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save_pretrained(str(directory))
        return directory / "tokenizer.json"


def checkpoint_eos_ids(directory: Path) -> tuple[int, ...]:
    """Every end-of-sequence id a checkpoint's model files name: ``eos_token_id`` (an id or a list)
    of ``config.json`` and of ``generation_config.json``, once each, as SGLang's ``ModelConfig``
    gathers them. An unreadable or absent file names none (the model's loader reports it)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((Path(directory) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, int) and not isinstance(t, bool) and t not in ids:
                ids.append(t)
    return tuple(ids)


def chat_messages(text: str, system: str | None = None) -> list[dict[str, str]]:
    """The conversation a chat prompt is rendered from: ``system``'s turn (if any), then ``text`` as
    the user's. A trajectory's later renders (``agents.chat``) start from the same one."""
    system_turn = [{"role": "system", "content": system}] if system is not None else []
    return [*system_turn, {"role": "user", "content": text}]


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
