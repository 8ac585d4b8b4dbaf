"""Token counting with the tiktoken encodings shipped inside the package, so it works offline.

Upstream usage is the truth; these counts fill in what usage cannot tell (tokens per chunk, the
fallback when a server reports nothing). Every count carries its source, e.g. ``tiktoken:o200k_base``.
"""

from __future__ import annotations

import hashlib
import threading
from importlib import resources
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe

# sha256 of each shipped rank file; equal to tiktoken's own expected hashes for OpenAI's public files.
_SHA256 = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}
# Split patterns and special tokens of the two encodings (tiktoken_ext.openai_public).
_PATTERNS = {
    "cl100k_base": (
        r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|"""
        r"""\s*[\r\n]|\s+(?!\S)|\s"""
    ),
    "o200k_base": "|".join(
        [
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    ),
}
_SPECIAL = {
    "cl100k_base": {
        "<|endoftext|>": 100257,
        "<|fim_prefix|>": 100258,
        "<|fim_middle|>": 100259,
        "<|fim_suffix|>": 100260,
        "<|endofprompt|>": 100276,
    },
    "o200k_base": {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
}
DEFAULT_ENCODING = "o200k_base"
ENCODINGS = tuple(_SHA256)

_lock = threading.Lock()
_cache: dict[str, Any] = {}


class EncodingError(RuntimeError):
    """A shipped encoding file is missing or does not match its checksum."""


def get_encoding(name: str = DEFAULT_ENCODING) -> Any:
    """The named shipped encoding, loaded once and verified against its sha256."""
    enc = _cache.get(name)
    if enc is not None:
        return enc
    if name not in _SHA256:
        raise EncodingError(f"unknown encoding {name!r}; shipped: {', '.join(ENCODINGS)}")
    with _lock:
        enc = _cache.get(name)
        if enc is None:
            path = resources.files("proxy") / "data" / f"{name}.tiktoken"
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            if digest != _SHA256[name]:
                raise EncodingError(f"{name}.tiktoken: sha256 {digest} does not match {_SHA256[name]}")
            with resources.as_file(path) as real_path:
                ranks = load_tiktoken_bpe(str(real_path), expected_hash=_SHA256[name])
            enc = tiktoken.Encoding(
                name=name, pat_str=_PATTERNS[name], mergeable_ranks=ranks, special_tokens=_SPECIAL[name]
            )
            _cache[name] = enc
    return enc


def encoding_for_model(model: str | None) -> str:
    """The encoding name for a model: OpenAI's own mapping, else the default (o200k_base)."""
    if model:
        try:
            name = str(tiktoken.encoding_name_for_model(model))
        except KeyError:
            return DEFAULT_ENCODING
        if name in _SHA256:
            return name
    return DEFAULT_ENCODING


def count(text: str, encoding: str = DEFAULT_ENCODING) -> int:
    """Tokens in ``text``; special-token strings count as ordinary text, as they would in a prompt."""
    if not text:
        return 0
    return len(get_encoding(encoding).encode_ordinary(text))


def source(encoding: str) -> str:
    """The source label of a count made with ``encoding``."""
    return f"tiktoken:{encoding}"
