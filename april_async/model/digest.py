"""A checkpoint's content digest: what names the base of a LoRA adapter.

A LoRA version is a delta against one base: merged into other weights it computes something no one
trained. So a version names its base by the digest of the base checkpoint's weight files (BLAKE3,
16 bytes), and a generator compares it with the digest of the checkpoint it loaded
(``weights_announce.adapter.base_digest``, protocol 1.10). The digest covers the weight files
alone, by name, length and bytes, in the order of their names: a copy of the checkpoint on another
host, with another tokenizer file or ``config.json`` whitespace, is the same base; a re-saved or
converted one (another dtype, another sharding) is not, and is refused rather than merged.
Reading runs at disk speed (BLAKE3 hashes ~7 GB/s a core here), a second or so for a 0.5B model.
"""

from __future__ import annotations

from pathlib import Path

import blake3

from april_async.model.errors import CheckpointError

DIGEST_PREFIX = "blake3-128:"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
"""The files whose bytes are the weights (an index file only lists them)."""
_CHUNK = 8 << 20


def checkpoint_digest(directory: Path | str) -> str:
    """``blake3-128:<32 hex digits>`` of the weight files in ``directory`` (see the module docstring)."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {str(root)!r}: not a directory")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise CheckpointError(f"checkpoint {str(root)!r}: no weight file (*.safetensors, *.bin) to take a "
                              f"digest of")
    h = blake3.blake3()
    for path in files:
        h.update(path.name.encode() + b"\0" + path.stat().st_size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return DIGEST_PREFIX + h.hexdigest(16)
