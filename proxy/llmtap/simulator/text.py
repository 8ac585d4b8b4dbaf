"""Text in and out: prompt tokens and block hashes, and generated text whose usage is exact.

Generated text is a sequence of common English words, each with a leading space. The vocabulary is
checked at start-up: every word is one token in the served encoding, and words joined together
re-tokenize to one token each (the split pattern cuts before every space-led word), so the usage the
simulator reports equals ``tokens.count(joined_text)`` and every chunk holds a whole number of tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from array import array
from collections.abc import Sequence

from llmtap.analysis import tokens

__all__ = ["Vocabulary", "block_hashes", "block_hashes_async", "tokenize"]

# Prompts longer than this many characters are tokenized on a worker thread: tiktoken releases the
# GIL, and a 25 kB prompt takes about a millisecond, which would delay every other stream's chunks.
THREAD_THRESHOLD_CHARS = 4096
# Hashing runs in Python (one blake2b call per block); past this many tokens it also leaves the loop.
THREAD_THRESHOLD_TOKENS = 2048

_WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at which but have an they
you were her she there been one all we their has would when if so no will more can out said who about up
what some time into them could other than only its then two may these first any new like our over such after
most also made many before must through back years where much your way well down should because each just
those people how too little state good very make world still own see men work long here get both between
life being under never day same another know while last might us great old year off come since against go
came right used take three states himself few house use during without again place around however home small
found thought went say part once general high upon school every does got left number course war until always
away something fact though water less public put think almost hand enough far took head yet government system
better set told nothing night end why called find going look asked later knew point next program city business
give group toward young days let room president side social present given several order national possible
rather second face per among form important often things looked early white case large need big become within
felt along children saw best church ever least power development light thing family seemed interest want
members mind country area others done turned although open problem sense service certain kind began thus help
means
""".split()


class VocabularyError(RuntimeError):
    """The word list does not tokenize one word to one token in the served encoding."""


class Vocabulary:
    """Single-token words of one encoding, and a deterministic writer of text made of them."""

    def __init__(self, encoding: str) -> None:
        enc = tokens.get_encoding(encoding)
        words = [" " + w for w in _WORDS if len(enc.encode_ordinary(" " + w)) == 1]
        if len(words) < 64:
            raise VocabularyError(f"only {len(words)} single-token words in {encoding}")
        # Joined in two orders, the count must stay one token per word (no merges across words).
        for sample in (words, words[::-1]):
            if tokens.count("".join(sample), encoding) != len(sample):
                raise VocabularyError(f"joined words re-tokenize to a different count in {encoding}")
        self.encoding = encoding
        self.words: tuple[str, ...] = tuple(words)

    def generate(self, prompt_text: str, n: int) -> list[str]:
        """``n`` one-token pieces, a pure function of the prompt so identical requests get identical text."""
        seed = int.from_bytes(hashlib.blake2b(prompt_text.encode(), digest_size=8).digest(), "big")
        return random.Random(seed).choices(self.words, k=n)


async def tokenize(text: str, encoding: str) -> list[int]:
    """Token ids of a prompt (as many as ``tokens.count`` says); long prompts are encoded on a worker thread,
    off the event loop."""
    if len(text) > THREAD_THRESHOLD_CHARS:
        return await asyncio.to_thread(tokens.encode, text, encoding)
    return tokens.encode(text, encoding)


def block_hashes(ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hash chain of the prompt's full blocks: block i's hash covers every token before its end.

    Chaining is what makes the cache a *prefix* cache: a block matches only when all earlier blocks do.
    """
    out: list[bytes] = []
    prev = b""
    for start in range(0, len(ids) - block_size + 1, block_size):
        block = array("I", ids[start : start + block_size]).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        out.append(prev)
    return out


async def block_hashes_async(ids: Sequence[int], block_size: int) -> list[bytes]:
    """``block_hashes`` on a worker thread for long prompts."""
    if len(ids) > THREAD_THRESHOLD_TOKENS:
        return await asyncio.to_thread(block_hashes, ids, block_size)
    return block_hashes(ids, block_size)
