"""Who sent a request: its attribution dimensions, from the caller's headers and the request body, bounded.

The dimensions:

* ``tenant``: the ``x-llmtap-tenant`` header;
* ``user``: the ``x-llmtap-user`` header, else what the protocol carries in the body (OpenAI's
  ``safety_identifier`` or ``user``, Anthropic's ``metadata.user_id``);
* ``api_key``: a fingerprint of the credential the request carried (``llmtap.relay.fingerprint``: made in
  the relay, the key itself never leaves it);
* ``property.<name>``: each ``x-llmtap-property-<name>`` header.

Everything here is bounded whatever the caller sends: a value is cleaned (valid UTF-8, no control
characters, not even on a span) and cut at ``VALUE_CAP`` characters, a property's name is folded to
``[a-z0-9_]`` and cut at ``NAME_CAP``, and a request keeps ``MAX_PROPERTIES`` properties at most (the
others are counted as dropped). Spans and records carry every dimension; metrics only those the operator
allows, each through a ``LabelGuard`` (``llmtap.telemetry.emit.metrics``).
"""

from __future__ import annotations

import re

from llmtap.labels import clean

__all__ = ["MAX_PROPERTIES", "VALUE_CAP", "dimensions", "record_part"]

TENANT, USER, API_KEY = "tenant", "user", "api_key"
PROPERTY = "property."
#: Characters of a dimension's value at most (on spans and records; a metric label is shorter still).
VALUE_CAP = 256
#: Characters of a property's name at most.
NAME_CAP = 64
#: Properties one request keeps at most.
MAX_PROPERTIES = 16

_HEADER = b"x-llmtap-"
_PROPERTY_HEADER = b"x-llmtap-property-"
_NAME_JUNK = re.compile(r"[^a-z0-9_]")


def property_name(raw: str) -> str:
    """A property's name as a dimension knows it: lower case letters, digits and ``_`` (``-`` and the rest)."""
    return _NAME_JUNK.sub("_", raw.lower())[:NAME_CAP]


def _value(raw: bytes | str) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return clean(text.strip(), VALUE_CAP, label=True)


def dimensions(
    headers: tuple[tuple[bytes, bytes], ...] | list[tuple[bytes, bytes]],
    *,
    body_user: str | None = None,
    key_fingerprint: str | None = None,
) -> tuple[dict[str, str], int]:
    """A request's dimensions by name, and how many properties were dropped past ``MAX_PROPERTIES``.

    ``headers`` are the caller's ``x-llmtap-*`` headers (lower-case names) other than the prompt version;
    a header given twice keeps its first value. Empty values are no value."""
    out: dict[str, str] = {}
    properties = dropped = 0
    for name, raw in headers:
        if name.startswith(_PROPERTY_HEADER):
            key = property_name(name[len(_PROPERTY_HEADER) :].decode("latin-1"))
            if not key:
                continue
            dimension = PROPERTY + key
            if dimension in out:
                continue
            if properties >= MAX_PROPERTIES:
                dropped += 1
                continue
            value = _value(raw)
            if value:
                out[dimension] = value
                properties += 1
        elif name == _HEADER + b"tenant" or name == _HEADER + b"user":
            dimension = name[len(_HEADER) :].decode()
            value = _value(raw)
            if value and dimension not in out:
                out[dimension] = value
    if USER not in out and body_user:
        value = _value(body_user)
        if value:
            out[USER] = value
    if key_fingerprint:
        out[API_KEY] = clean(key_fingerprint, 32)
    return out, dropped


def record_part(dims: dict[str, str]) -> dict[str, object] | None:
    """The dimensions as a record keeps them: ``tenant``, ``user``, ``api_key``, ``properties``; None when none."""
    if not dims:
        return None
    out: dict[str, object] = {k: dims[k] for k in (TENANT, USER, API_KEY) if k in dims}
    properties = {k[len(PROPERTY) :]: v for k, v in dims.items() if k.startswith(PROPERTY)}
    if properties:
        out["properties"] = properties
    return out
