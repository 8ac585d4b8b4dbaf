"""OpenAI legacy Completions (``POST …/completions``, not ``…/chat/completions``).

Wire format: standards D.2. Streamed and whole responses share the ``text_completion`` shape, with the
generated text in ``choices[].text``; ``stream_options.include_usage`` adds a final ``choices: []`` chunk.
"""

from __future__ import annotations

from llmtap.providers.base import Framing, StreamParser
from llmtap.providers.openai_common import (
    ChoicesStreamParser,
    JSONObject,
    as_str,
    inspect_openai,
    matches_suffix,
    parse_choices_body,
    prompt_regions,
    prompt_text,
)
from llmtap.providers.splice import prepare_usage
from llmtap.types import Facts, Prepared, PromptRegion, RequestInfo

__all__ = ["OpenAICompletions"]


def completion_choice_text(choice: JSONObject) -> str:
    """The generated text of one ``text_completion`` choice."""
    return as_str(choice.get("text")) or ""


def _prompt(obj: JSONObject) -> str:
    # ``prompt`` is a string or a list of strings; token-id arrays carry no text to count and are skipped.
    prompt, suffix = obj.get("prompt"), obj.get("suffix")
    texts = prompt if isinstance(prompt, list) else [prompt]
    return prompt_text(messages=[t for t in [*texts, suffix] if isinstance(t, str)])


def _regions(obj: JSONObject) -> list[PromptRegion]:
    # One text prompt is one region; of a batch of prompts, the first stands for the request.
    prompt = obj.get("prompt")
    first = prompt[0] if isinstance(prompt, list) and prompt else prompt
    return prompt_regions(messages=first if isinstance(first, str) else None)


class OpenAICompletions:
    """The legacy Completions protocol."""

    name: str = "openai_completions"
    family: str = "openai"
    framing: Framing = "sse"
    #: ``prepare`` is ``splice.prepare_usage``: a relay may parse a large body its own way, then splice.
    splices_usage: bool = True

    def matches(self, method: str, path: str) -> bool:
        """True for ``POST …/completions`` that is not ``…/chat/completions``."""
        return matches_suffix(method, path, "/completions") and not matches_suffix(method, path, "/chat/completions")

    def prepare(self, body: bytes, *, inject_usage: bool, path: str = "") -> Prepared:
        """On a stream that did not ask for usage, the client's bytes with ``include_usage: true`` spliced in."""
        return prepare_usage(body, inject_usage=inject_usage)

    def inspect(self, body: bytes, *, inject_usage: bool, path: str = "") -> RequestInfo:
        """Model, stream flag, params and prompt text; ask for usage on streams that did not."""
        return inspect_openai(
            body,
            inject_usage=inject_usage,
            operation="text_completion",
            max_tokens_keys=("max_tokens",),
            prompt=_prompt,
            regions=_regions,
        )

    def stream_parser(self) -> StreamParser:
        """A parser for one ``text_completion`` stream."""
        return ChoicesStreamParser(completion_choice_text)

    def parse_body(self, body: bytes) -> Facts:
        """Facts of a ``text_completion`` body or a JSON error body."""
        return parse_choices_body(body, completion_choice_text)
