"""Request bodies in, one normalized generation request out, or a ``SimError`` in the server's words.

Prompt text, which the simulator counts and the proxy counts the same way:
  * chat (``/v1/chat/completions``): every text piece of every message, in order, joined with "\\n";
    a message's piece is its ``content`` when that is a string, else the ``text`` of each text part
    (``text``; Responses' ``input_text``, ``output_text``); roles, names and other parts are not counted;
  * messages (``/v1/messages``): the ``system`` text pieces first (a string, or text blocks), then the
    messages' pieces as for chat, all joined with "\\n";
  * completions (``/v1/completions``): ``prompt`` when a string; a list of one string is that string;
  * responses (``/v1/responses``): the ``instructions`` first, then ``input``: a string, or messages
    as for chat;
  * Ollama: ``/api/chat`` as chat; ``/api/generate`` the ``system`` text, then the ``prompt``;
  * Gemini: the ``systemInstruction`` parts' texts, then every part's ``text`` of every ``contents``
    entry.
A real server also counts its chat template's tokens; the simulator has no template, so its usage is
exactly ``tokens.count(prompt_text)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from llmtap.simulator.profiles import Profile

__all__ = ["AnswerParts", "GenRequest", "Route", "SimError", "output_tokens", "parse_json", "parse_request"]

Route = Literal[
    "chat", "completions", "messages", "responses", "ollama_chat", "ollama_generate", "gemini", "gemini_stream"
]


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
    #: What the answer holds beyond text (``answer_parts``): choices (chat ``n``), reasoning first, a tool call.
    parts: AnswerParts = field(default_factory=lambda: AnswerParts())


@dataclass(frozen=True, slots=True)
class AnswerParts:
    """The shapes an answer takes beyond plain text, as the request asks for them."""

    #: Chat ``n``: this many choices, each with the same tokens (the simulator draws one sequence).
    choices: int = 1
    #: Reasoning tokens come first: chat ``reasoning_effort``, Messages ``thinking``, Responses ``reasoning``.
    reasoning: bool = False
    #: The function the answer calls (its arguments are the answer's tokens), or None for text.
    tool: str | None = None


# Part types whose ``text`` is prompt text: chat and Messages say "text", Responses input_/output_text.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


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
            if part.get("type") in _TEXT_PARTS:
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


def _ollama_request(route: Route, payload: dict[str, Any], profile: Profile) -> GenRequest:
    # Ollama's own wording: a plain {"error": "..."} message, 404 for a model it does not have.
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise SimError(400, "model is required")
    if model.removesuffix(":latest") not in profile.served_models:
        raise SimError(404, f'model "{model}" not found, try pulling it first', param="model")
    if route == "ollama_chat":
        text = "\n".join(_message_pieces(payload.get("messages")))
    else:
        prompt = payload.get("prompt")
        if not isinstance(prompt, str):
            raise SimError(400, "prompt must be a string")
        text = "\n".join([*_pieces(payload.get("system"), "system"), prompt])
    options = payload.get("options")
    limit = options.get("num_predict") if isinstance(options, dict) else None
    # num_predict -1 (no limit) and -2 (fill the context) both mean the server's own default here.
    max_tokens = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
    # Ollama streams unless told not to; its metrics always come with the last line.
    return GenRequest(route, model, text, max_tokens, payload.get("stream") is not False, True, False)


def _gemini_request(route: Route, payload: dict[str, Any], profile: Profile, path_model: str | None) -> GenRequest:
    # The model and the stream flag are in the path (``models/{model}:streamGenerateContent``).
    if path_model is None or path_model not in profile.served_models:
        raise SimError(404, f"models/{path_model} is not found for API version v1beta", param="model")
    contents = payload.get("contents")
    if not isinstance(contents, list) or not contents:
        raise SimError(400, "* GenerateContentRequest.contents: contents is not specified\n", param="contents")
    system = payload.get("systemInstruction", payload.get("system_instruction"))
    pieces: list[str] = []
    for content in ([system] if isinstance(system, dict) else []) + contents:
        parts = content.get("parts") if isinstance(content, dict) else None
        if not isinstance(parts, list):
            raise SimError(400, "* GenerateContentRequest.contents: each content needs its parts", param="contents")
        pieces += [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
    config = payload.get("generationConfig", payload.get("generation_config"))
    config = config if isinstance(config, dict) else {}
    limit = config.get("maxOutputTokens", config.get("max_output_tokens"))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SimError(400, "* GenerateContentRequest.generation_config.max_output_tokens: must be positive")
    return GenRequest(route, path_model, "\n".join(pieces), limit, route == "gemini_stream", True, False)


_MAX_CHOICES = 16


def _tool_name(tools: Any, choice: Any, route: Route) -> str | None:
    """The function a request with ``tools`` is answered with: the named one, else the first; None when ``tool_choice``
    says none (or there are no tools)."""
    if not isinstance(tools, list) or not tools:
        return None
    if choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    if isinstance(choice, dict):  # chat {"type":"function","function":{"name":..}}; Messages and Responses {"name":..}
        named = choice.get("name") or (choice.get("function") or {}).get("name")
        if isinstance(named, str) and named:
            return named
    first = tools[0] if isinstance(tools[0], dict) else {}
    name = (first.get("function") or {}).get("name") if route == "chat" else first.get("name")
    if not isinstance(name, str) or not name:
        raise _invalid("tools", "each tool needs a function name")
    return name


def answer_parts(route: Route, payload: dict[str, Any]) -> AnswerParts:
    """What the answer holds beyond text: chat's ``n``, reasoning first, a tool call (chat, Messages, Responses)."""
    if route not in ("chat", "messages", "responses"):
        return AnswerParts()
    choices = 1
    if route == "chat" and payload.get("n") is not None:
        choices = _positive_int(payload, "n") or 1
        if choices > _MAX_CHOICES:
            raise _invalid("n", f"n must be at most {_MAX_CHOICES}")
    if route == "chat":
        effort = payload.get("reasoning_effort")
        reasoning = isinstance(effort, str) and effort not in ("none", "")
    elif route == "messages":
        thinking = payload.get("thinking")
        reasoning = isinstance(thinking, dict) and thinking.get("type") == "enabled"
    else:
        options = payload.get("reasoning")
        reasoning = isinstance(options, dict) and options.get("effort") not in (None, "none")
    return AnswerParts(choices, reasoning, _tool_name(payload.get("tools"), payload.get("tool_choice"), route))


def parse_request(
    route: Route, payload: dict[str, Any], profile: Profile, *, path_model: str | None = None
) -> GenRequest:
    """Validate a decoded body for ``route`` and normalize it; ``path_model`` is Gemini's model from the path."""
    if route in ("ollama_chat", "ollama_generate"):
        return _ollama_request(route, payload, profile)
    if route in ("gemini", "gemini_stream"):
        return _gemini_request(route, payload, profile, path_model)
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
    elif route == "responses":
        if payload.get("input") is None:
            raise _missing("input")
        pieces = _pieces(payload.get("instructions"), "instructions") + (
            _pieces(payload["input"], "input")
            if isinstance(payload["input"], str)
            else _message_pieces(payload["input"])
        )
        text = "\n".join(pieces)
        max_tokens = _positive_int(payload, "max_output_tokens")
        # The usage rides on response.completed whatever the request says.
        stream, include, continuous = payload.get("stream") is True, True, False
    else:
        pieces = _pieces(payload.get("system"), "system") + _message_pieces(payload.get("messages"))
        text = "\n".join(pieces)
        max_tokens = _positive_int(payload, "max_tokens")
        if max_tokens is None:
            raise _missing("max_tokens")  # required by the Messages API
        stream, include, continuous = payload.get("stream") is True, True, False
    return GenRequest(route, model, text, max_tokens, stream, include, continuous, answer_parts(route, payload))


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
