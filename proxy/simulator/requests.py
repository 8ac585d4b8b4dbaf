"""Request bodies in, one normalized generation request out, or a ``SimError`` in the server's words.

Prompt text, which the simulator counts and the proxy counts the same way:
  * chat (``/v1/chat/completions``): every text piece of every message, in order, joined with "\\n";
    a message's piece is its ``content`` when that is a string, else the ``text`` of each
    ``{"type": "text"}`` part; roles, names and non-text parts are not counted;
  * messages (``/v1/messages``): the ``system`` text pieces first (a string, or text blocks), then the
    messages' pieces as for chat, all joined with "\\n";
  * completions (``/v1/completions``): ``prompt`` when a string; a list of one string is that string.
A real server also counts its chat template's tokens; the simulator has no template, so its usage is
exactly ``tokens.count(prompt_text)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from proxy.simulator.profiles import Profile

Route = Literal["chat", "completions", "messages"]


class SimError(Exception):
    """A request the server refuses: HTTP status, message and the OpenAI-style ``type`` and ``param``."""

    def __init__(self, status: int, message: str, *, kind: str = "Bad Request", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param


@dataclass(frozen=True, slots=True)
class GenRequest:
    """What to generate, whatever the protocol."""

    route: Route
    model: str
    prompt_text: str
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool


def _missing(field: str) -> SimError:
    # Pydantic's wording, as vLLM returns it for a body that fails validation.
    return SimError(
        400,
        f"1 validation error:\n  {{'type': 'missing', 'loc': ('body', '{field}'), 'msg': 'Field required'}}",
        param=f"body.{field}",
    )


def _invalid(field: str, why: str) -> SimError:
    return SimError(
        400,
        f"1 validation error:\n  {{'type': 'value_error', 'loc': ('body', '{field}'), 'msg': '{why}'}}",
        param=f"body.{field}",
    )


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or the 400 vLLM sends for malformed JSON."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = exc.pos if isinstance(exc, json.JSONDecodeError) else exc.start
        why = exc.msg if isinstance(exc, json.JSONDecodeError) else "invalid utf-8"
        detail = (
            f"{{'type': 'json_invalid', 'loc': 'body.{pos}', 'msg': 'JSON decode error', "
            f"'input': '<dict of 0 items>', 'ctx': {{'error': '{why}'}}}}"
        )
        raise SimError(400, f"1 validation error:\n  {detail}", param=f"body.{pos}") from None
    if not isinstance(payload, dict):
        raise SimError(
            400,
            "1 validation error:\n  {'type': 'model_attributes_type', 'loc': ('body',), "
            "'msg': 'Input should be a valid dictionary or object to extract fields from'}",
            param="body",
        )
    return payload


def _pieces(content: Any, field: str) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict):
                raise _invalid(field, "content parts must be objects")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise _invalid(field, "a text part needs a string 'text'")
                out.append(text)
        return out
    raise _invalid(field, "content must be a string or a list of parts")


def _message_pieces(messages: Any) -> list[str]:
    if messages is None:
        raise _missing("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "messages must be a non-empty list")
    out: list[str] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _invalid("messages", "each message must be an object with a 'role'")
        out.extend(_pieces(message.get("content"), "messages"))
    return out


def _positive_int(payload: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = payload.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _invalid(name, f"{name} must be a positive integer")
        return value
    return None


def _model(payload: dict[str, Any], profile: Profile) -> str:
    model = payload.get("model")
    if model is None:
        return profile.model  # vLLM serves its only model when the request names none
    if not isinstance(model, str) or model not in profile.served_models:
        aliases = ", ".join(profile.served_models)
        raise SimError(
            404, f"The model `{model}` does not exist. Valid aliases: {aliases}.", kind="NotFoundError", param="model"
        )
    return model


def _stream_flags(payload: dict[str, Any]) -> tuple[bool, bool, bool]:
    stream = payload.get("stream") is True
    options = payload.get("stream_options")
    if options is None:
        return stream, False, False
    if not isinstance(options, dict):
        raise _invalid("stream_options", "stream_options must be an object")
    if not stream:
        raise _invalid("stream_options", "Stream options can only be defined when `stream=True`.")
    include = options.get("include_usage") is True
    # vLLM: continuous usage only counts when usage is included at all (serving_chat).
    return stream, include, include and options.get("continuous_usage_stats") is True


def parse_request(route: Route, payload: dict[str, Any], profile: Profile) -> GenRequest:
    """Validate a decoded body for ``route`` and normalize it."""
    model = _model(payload, profile)
    if route == "chat":
        text = "\n".join(_message_pieces(payload.get("messages")))
        max_tokens = _positive_int(payload, "max_completion_tokens", "max_tokens")
        stream, include, continuous = _stream_flags(payload)
    elif route == "completions":
        prompt = payload.get("prompt")
        if prompt is None:
            raise _missing("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise _invalid("prompt", "the simulator takes one prompt string")
        text = prompt
        max_tokens = _positive_int(payload, "max_tokens")
        stream, include, continuous = _stream_flags(payload)
    else:
        pieces = _pieces(payload.get("system"), "system") + _message_pieces(payload.get("messages"))
        text = "\n".join(pieces)
        max_tokens = _positive_int(payload, "max_tokens")
        if max_tokens is None:
            raise _missing("max_tokens")  # required by the Messages API
        stream, include, continuous = payload.get("stream") is True, True, False
    return GenRequest(route, model, text, max_tokens, stream, include, continuous)


def output_tokens(req: GenRequest, prompt_tokens: int, profile: Profile) -> int:
    """How many tokens to write, or the 400 vLLM sends when the prompt leaves no room."""
    limit = profile.max_model_len
    if prompt_tokens >= limit:
        raise SimError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt contains at least "
            f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. Please "
            f"reduce the length of the input prompt. (parameter=input_tokens, value={prompt_tokens})",
            kind="BadRequestError",
            param="input_tokens",
        )
    if req.max_tokens is None:
        return min(profile.default_max_tokens, limit - prompt_tokens)
    if prompt_tokens + req.max_tokens > limit:
        raise SimError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + req.max_tokens} tokens ({prompt_tokens} in the input, {req.max_tokens} in the "
            f"output). Please reduce the length of the input or the output. (parameter=max_tokens, "
            f"value={req.max_tokens})",
            kind="BadRequestError",
            param="max_tokens",
        )
    return req.max_tokens
