"""What several protocol classes do alike, written once: forwarding a request unchanged, the ``choices`` shape.

Each protocol module keeps what is its own (the path it matches, how it reads a request, its decoders); a class
here holds only what two or more protocols do the same way and for the same reason.

Kept apart from ``base.py`` and ``openai_common.py``: those are compiled with mypyc in the side-by-side probes
(``bench/probes/compiled.py``), and a class the interpreter defines may not inherit from a compiled one, whereas
a compiled class may inherit from one defined here.
"""

from __future__ import annotations

from collections.abc import Callable

from llmtap.providers.base import Framing, StreamParser
from llmtap.providers.openai_common import ChoicesStreamParser, JSONObject, inspect_openai, parse_choices_body
from llmtap.providers.splice import prepare_usage
from llmtap.types import UNCHANGED, Facts, Prepared, PromptRegion, RequestInfo

__all__ = ["ChoicesProtocol", "ForwardsUnchanged"]


class ForwardsUnchanged:
    """A protocol whose answers carry their usage unasked, so its requests go upstream as the client sent them.

    Each subclass says in a comment why its protocol needs no asking.
    """

    #: No usage splice: ``prepare`` changes nothing, so the relay keeps the body as it reads it.
    splices_usage: bool = False

    def prepare(self, body: bytes, *, inject_usage: bool, path: str = "") -> Prepared:
        """Never changed: there is nothing to ask for."""
        return UNCHANGED


class ChoicesProtocol:
    """OpenAI's ``choices``-shaped protocols, Chat Completions and legacy Completions (standards D.1, D.2).

    They ask a stream for usage by the same splice, read a request's model, stream flag and parameters alike,
    and answer in chunks and bodies of one shape. What differs is given to ``__init__``: the operation, the
    request's max-tokens keys, where the prompt and a choice's text are, and whether a choice can be reasoning.
    Each subclass matches its own path.
    """

    family: str = "openai"
    framing: Framing = "sse"
    #: ``prepare`` is ``splice.prepare_usage``: a relay may parse a large body its own way, then splice.
    splices_usage: bool = True

    def __init__(
        self,
        *,
        name: str,
        operation: str,
        max_tokens_keys: tuple[str, ...],
        prompt: Callable[[JSONObject], str],
        regions: Callable[[JSONObject], list[PromptRegion]],
        choice_text: Callable[[JSONObject], str],
        choice_reasoning: Callable[[JSONObject], bool] | None = None,
    ) -> None:
        self.name = name
        self._operation = operation
        self._max_tokens_keys = max_tokens_keys
        self._prompt = prompt
        self._regions = regions
        self._choice_text = choice_text
        self._choice_reasoning = choice_reasoning

    def prepare(self, body: bytes, *, inject_usage: bool, path: str = "") -> Prepared:
        """On a stream that did not ask for usage, the client's bytes with ``include_usage: true`` spliced in."""
        return prepare_usage(body, inject_usage=inject_usage)

    def inspect(self, body: bytes, *, inject_usage: bool, path: str = "") -> RequestInfo:
        """Model, stream flag, params and prompt text; ask for usage on streams that did not."""
        return inspect_openai(
            body,
            inject_usage=inject_usage,
            operation=self._operation,
            max_tokens_keys=self._max_tokens_keys,
            prompt=self._prompt,
            regions=self._regions,
        )

    def stream_parser(self) -> StreamParser:
        """A parser for one stream of chunks (``chat.completion.chunk`` or ``text_completion``)."""
        return ChoicesStreamParser(self._choice_text, self._choice_reasoning)

    def parse_body(self, body: bytes) -> Facts:
        """Facts of a whole body (``chat.completion`` or ``text_completion``) or of a JSON error body."""
        return parse_choices_body(body, self._choice_text)
