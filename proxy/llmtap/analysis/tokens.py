"""Token counting with the tiktoken encodings shipped inside the package, so it works offline.

Upstream usage is the truth; these counts fill in what usage cannot tell (tokens per chunk, the
fallback when a server reports nothing). Every count carries its source, e.g. ``tiktoken:o200k_base``.

tiktoken's byte-pair merge is super-linear in the length of one pre-token (a 32 MiB run of one letter took
42 s as one string), so no string longer than ``PIECE_CHARS`` ever reaches it: text is cut where a space
follows a non-space, which is where the encodings' split patterns begin a pre-token anyway, so the cut
changes no count; a run with no such place in it is cut at the bound (at most a token per cut differs).
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
from collections.abc import Iterator
from importlib import resources
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe

__all__ = [
    "DEFAULT_ENCODING",
    "ENCODINGS",
    "MODEL_KEPT_CHARS",
    "PIECE_CHARS",
    "SHORT_CHARS",
    "SHORT_KEPT",
    "Counter",
    "count",
    "encode",
    "encoding_for_model",
    "get_encoding",
    "source",
]

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
            path = resources.files("llmtap") / "data" / f"{name}.tiktoken"
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
    if not model:
        return DEFAULT_ENCODING
    if len(model) > MODEL_KEPT_CHARS:
        return _encoding_for(model)
    return _remembered(model)


#: Model names up to this long have their encoding remembered (``_remembered``); longer ones are looked up each time.
MODEL_KEPT_CHARS = 256


def _encoding_for(model: str) -> str:
    try:
        name = str(tiktoken.encoding_name_for_model(model))
    except KeyError:
        return DEFAULT_ENCODING
    return name if name in _SHA256 else DEFAULT_ENCODING


#: tiktoken's lookup tries every prefix it knows and raises for a model it does not (any open model): 1 to 2
#: microseconds a call, and a request asks up to three times. A deployment serves a handful of models; the bound
#: holds whatever names clients send.
_remembered = functools.lru_cache(maxsize=256)(_encoding_for)


#: The longest string tiktoken is given at once; a cut is looked for in its second half.
PIECE_CHARS = 4096
# A space after a non-space: both encodings' split patterns start a pre-token at such a space, so a piece
# cut there encodes exactly as it would inside the whole text.
_CUT = re.compile(r"(?<=\S) ")


def pieces(text: str, start: int = 0) -> Iterator[str]:
    """``text[start:]`` in pieces of at most ``PIECE_CHARS``, cut where a cut changes no count when there is one."""
    end = len(text)
    while end - start > PIECE_CHARS:
        limit = start + PIECE_CHARS
        found = _CUT.search(text, start + PIECE_CHARS // 2, limit)
        cut = found.start() if found is not None else limit
        yield text[start:cut]
        start = cut
    if start < end:
        yield text[start:]


def encode(text: str, encoding: str = DEFAULT_ENCODING) -> list[int]:
    """Token ids of ``text``, encoded in the pieces ``count`` counts: ``len(encode(t)) == count(t)``."""
    ordinary = get_encoding(encoding).encode_ordinary
    return [token for piece in pieces(text) for token in ordinary(piece)]


#: Texts up to this long are counted once per encoding and remembered: a streamed chunk is most often the text
#: of one or a few tokens, and those repeat (a tiktoken call costs microseconds, a dictionary lookup a tenth).
SHORT_CHARS = 32
#: Short texts remembered per encoding at most; past it the memory starts again (bounded whatever the traffic).
SHORT_KEPT = 1 << 16
_short: dict[str, dict[str, int]] = {name: {} for name in ENCODINGS}


def count(text: str, encoding: str = DEFAULT_ENCODING) -> int:
    """Tokens in ``text``; special-token strings count as ordinary text, as they would in a prompt."""
    if not text:
        return 0
    if len(text) <= SHORT_CHARS:
        known = _short.get(encoding)
        if known is not None:
            n = known.get(text)
            if n is None:
                n = len(get_encoding(encoding).encode_ordinary(text))
                if len(known) >= SHORT_KEPT:
                    known.clear()
                known[text] = n
            return n
    encode = get_encoding(encoding).encode_ordinary
    if len(text) <= PIECE_CHARS:
        return len(encode(text))
    return sum(len(encode(piece)) for piece in pieces(text))


class Counter:
    """The tokens of a text that arrives in parts, counted as the whole string would be, in bounded memory and time.

    At most ``limit`` characters are taken (``feed`` says how many of each part); between parts at most one
    piece is held, so a cut never falls inside a word that continues in the next part.
    """

    __slots__ = ("_encode", "_held", "_held_chars", "counted", "limit", "tokens")

    def __init__(self, encoding: str = DEFAULT_ENCODING, *, limit: int) -> None:
        self._encode = get_encoding(encoding).encode_ordinary
        self.limit = limit
        self.tokens = 0  # of the pieces counted so far
        self.counted = 0  # characters taken: counted, or held to be
        self._held: list[str] = []
        self._held_chars = 0

    def feed(self, text: str) -> int:
        """Take the next part of the text; how many of its characters were taken (the rest is past the limit)."""
        n = len(text)
        room = self.limit - self.counted
        if n > room:
            if room <= 0:
                return 0
            text, n = text[:room], room
        if not n:
            return 0
        self.counted += n
        self._held.append(text)
        self._held_chars += n
        if self.counted == self.limit:
            self._settle(hold=False)  # nothing more comes in: the tail is counted now
        elif self._held_chars > PIECE_CHARS:
            self._settle(hold=True)
        return n

    def count(self) -> int:
        """Tokens of every character taken; call it once the text is complete."""
        self._settle(hold=False)
        return self.tokens

    def _settle(self, *, hold: bool) -> None:
        if not self._held:
            return
        last = ""
        for piece in pieces("".join(self._held)):
            if last:
                self.tokens += len(self._encode(last))
            last = piece
        if hold:
            self._held, self._held_chars = [last], len(last)
        else:
            self.tokens += len(self._encode(last)) if last else 0
            self._held, self._held_chars = [], 0


def source(encoding: str) -> str:
    """The source label of a count made with ``encoding``."""
    return f"tiktoken:{encoding}"
