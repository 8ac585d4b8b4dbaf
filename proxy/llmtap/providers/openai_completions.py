"""OpenAI legacy Completions (``POST …/completions``, not ``…/chat/completions``).

Wire format: standards D.2. Streamed and whole responses share the ``text_completion`` shape, with the
generated text in ``choices[].text``; ``stream_options.include_usage`` adds a final ``choices: []`` chunk.
"""

from __future__ import annotations

from llmtap.providers.openai_common import JSONObject, as_str, matches_suffix, prompt_regions, prompt_text
from llmtap.providers.protocol import ChoicesProtocol
from llmtap.types import PromptRegion

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


class OpenAICompletions(ChoicesProtocol):
    """The legacy Completions protocol."""

    def __init__(self) -> None:
        super().__init__(
            name="openai_completions",
            operation="text_completion",
            max_tokens_keys=("max_tokens",),
            prompt=_prompt,
            regions=_regions,
            choice_text=completion_choice_text,
        )

    def matches(self, method: str, path: str) -> bool:
        """True for ``POST …/completions`` that is not ``…/chat/completions``."""
        return matches_suffix(method, path, "/completions") and not matches_suffix(method, path, "/chat/completions")
