"""What the content event carries of a request: its system instructions, input and output messages, each under
the operator's rule (keep, hash or drop) and a bound in bytes.

The shapes are the GenAI conventions' (``gen_ai.system_instructions``, ``gen_ai.input.messages``,
``gen_ai.output.messages``: a list of parts, each ``{"type": "text", "content": ..}``; messages with a ``role``).
They are made from the prompt's regions the provider already parsed (``RequestInfo.regions``) and the output text
the stream kept, so nothing is parsed again. Pure: the emitter (``llmtap.telemetry.records.content``) sends the result.

A kept field longer than the bound is cut: its text parts are shortened, and the parts and messages past the bound
left out, so what leaves is valid JSON within the bound; ``cut`` names the fields that were, and the event says so.
A hashed field is the SHA-256 of its whole JSON (not cut): equal content, equal hash, and nothing to read back.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from llmtap.analysis.timeline import Timeline
from llmtap.providers.openai_common import collect_text

__all__ = ["INPUT", "OUTPUT", "SYSTEM", "Content", "bound", "content_of", "digest"]

#: The fields, by the names the rules give them.
SYSTEM, INPUT, OUTPUT = "system", "input", "output"
KEEP, HASH, DROP = "keep", "hash", "drop"

Parts = list[dict[str, Any]]


@dataclass(slots=True)
class Content:
    """The fields of one request's content event after their rules: a kept field's value, a hashed field's hash."""

    values: dict[str, Any] = field(default_factory=dict)
    #: The kept fields that were cut to the bound.
    cut: list[str] = field(default_factory=list)


def content_of(tl: Timeline, rules: tuple[tuple[str, str], ...], max_bytes: int) -> Content:
    """The content event's fields for ``tl``, each by its rule; a field with nothing in it is left out."""
    out = Content()
    for name, rule in rules:
        if rule == DROP:
            continue
        value = _field(tl, name)
        if not value:
            continue
        if rule == HASH:
            out.values[name] = digest(value)
            continue
        bounded, was_cut = bound(value, max_bytes)
        out.values[name] = bounded
        if was_cut:
            out.cut.append(name)
    return out


def digest(value: Any) -> str:
    """``sha256:<hex>`` of a value's canonical JSON."""
    text = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _field(tl: Timeline, name: str) -> list[dict[str, Any]]:
    if name == OUTPUT:
        if tl.output is None or not tl.output.text:
            return []
        message: dict[str, Any] = {"role": "assistant", "parts": _text_parts(tl.output.text)}
        if tl.finish_reasons:
            message["finish_reason"] = tl.finish_reasons[0]
        return [message]
    regions = tl.request.regions if tl.request is not None else []
    if name == SYSTEM:
        return [part for r in regions if r.kind == "system" and not _history(r.value) for part in _parts(r.value)]
    messages = []
    for r in regions:
        # A chat's leading system messages are its history's (the conventions keep them in the input messages).
        listed = r.value if r.kind == "system" and _history(r.value) else [r.value] if r.kind == "message" else []
        for m in listed:
            role = m.get("role") if isinstance(m, dict) else None
            messages.append({"role": role if isinstance(role, str) and role else "user", "parts": _parts(m)})
    return messages


def _history(value: Any) -> bool:
    """Whether a system region is messages of the chat (OpenAI's system and developer messages), not instructions
    sent apart from it (Anthropic's ``system``, the Responses API's ``instructions``)."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _parts(value: Any) -> Parts:
    """A message's or system prompt's text as parts (tool calls and results as their text, images left out)."""
    texts: list[str] = []
    collect_text(value.get("content", value) if isinstance(value, dict) else value, texts)
    return _text_parts("\n".join(texts))


def _text_parts(text: str) -> Parts:
    return [{"type": "text", "content": text}] if text else []


def _size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8"))


def bound(messages: list[dict[str, Any]], max_bytes: int) -> tuple[list[dict[str, Any]], bool]:
    """``messages`` (or parts) within ``max_bytes`` of JSON: whole while they fit, the first that does not with its
    text shortened to the room left, nothing after it; and whether anything was cut."""
    if _size(messages) <= max_bytes:
        return messages, False
    out: list[dict[str, Any]] = []
    for item in messages:
        trial = [*out, item]
        if _size(trial) <= max_bytes:
            out = trial
            continue
        shortened = _shorten(item, max_bytes - _size([*out, _emptied(item)]))
        if shortened is not None:
            out.append(shortened)
        break
    return out, True


def _emptied(item: dict[str, Any]) -> dict[str, Any]:
    if "parts" in item:
        return {**item, "parts": [{**p, "content": ""} for p in item["parts"]]}
    return {**item, "content": ""} if "content" in item else item


def _shorten(item: dict[str, Any], room: int) -> dict[str, Any] | None:
    """``item`` with its text cut to about ``room`` bytes of JSON (None: no room for it at all)."""
    if room <= 0:
        return None
    if "parts" in item:
        parts, left = [], room
        for p in item["parts"]:
            text = _cut(str(p.get("content", "")), left)
            parts.append({**p, "content": text})
            left -= _size(text) - 2
            if left <= 0:
                break
        return {**item, "parts": parts}
    if "content" in item:
        return {**item, "content": _cut(str(item["content"]), room)}
    return None


def _cut(text: str, room: int) -> str:
    """The longest start of ``text`` whose JSON string takes at most ``room`` more bytes than an empty one."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _size(text[:mid]) - 2 <= room:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]
