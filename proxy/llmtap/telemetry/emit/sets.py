"""A request's metric attribute sets, made once for the few values they are made of.

A finished request records ten to twenty values over ten to fifteen attribute sets: the conventions' set, the
same with ``error.type``, llmtap's own with the route, the stream flag and the prompt version, and those with
the shape, the outcome, a token source or a queue source on top. Short requests at a high rate repeat the same
few: the same route, model, outcome and shape from one request to the next. Built per request, each set is a
dict made and then found again by its content (``bulk.Kept``); kept here by the values it is made of, the same
dict object comes back (a ``bulk.Fixed``), which a batch and ``bulk.Kept`` find by its identity at once.

The dicts handed out are shared by every request with the same values: nothing may change them once made
(``bulk.Batch`` and the SDK read them and copy what they keep). Each is made by the same expression, in the
same order of keys, as it would be per request, so a set carries the same items wherever it is made.
"""

from __future__ import annotations

from typing import Any

from llmtap.telemetry.emit.bulk import Fixed

__all__ = ["NONE", "Sets", "SetsCache"]

#: The empty base: ``Sets.plus(NONE, k, v)`` is ``{k: v}``.
NONE: dict[str, Any] = Fixed()


class Sets:
    """One group of attribute sets: the three a request's values make, and those made from them on demand."""

    __slots__ = ("_more", "attrs", "limit", "outcome", "own")

    def __init__(self, attrs: dict[str, Any], outcome: dict[str, Any], own: dict[str, Any], limit: int) -> None:
        #: The conventions' set (every ``gen_ai.*`` metric).
        self.attrs = attrs
        #: ... with ``error.type`` when the request failed.
        self.outcome = outcome
        #: ... with the route, the stream flag and the prompt version: llmtap's own.
        self.own = own
        self.limit = limit
        # (id of the base set, keys, values and their types) -> the set made
        self._more: dict[tuple[Any, ...], dict[str, Any]] = {}

    def plus(self, base: dict[str, Any], *pairs: Any) -> dict[str, Any]:
        """``{**base, k1: v1, k2: v2, ...}`` for ``pairs`` ``k1, v1, k2, v2, ...``: made once per base and values.

        ``base`` is one of this group's sets (or ``NONE``, or one ``plus`` gave), so its identity stands for its
        content. Each value's type is in the key beside it: ``True``, ``1`` and ``1.0`` are equal in Python, not
        as attribute values. A value that cannot be hashed makes its set anew, unkept."""
        try:
            key = (id(base), *pairs, *[type(value) for value in pairs[1::2]])
            made = self._more.get(key)
        except TypeError:
            return _made(base, pairs)
        if made is None:
            if len(self._more) >= self.limit:
                self._more.clear()
            made = self._more[key] = _made(base, pairs)
        return made


def _made(base: dict[str, Any], pairs: tuple[Any, ...]) -> dict[str, Any]:
    made = Fixed(base)
    for i in range(0, len(pairs), 2):
        made[pairs[i]] = pairs[i + 1]
    return made


class SetsCache:
    """Groups of sets (``Sets``) by the values that make them; bounded: emptied when ``limit`` groups are held.

    A group is found by a tuple of those values and their types. ``limit`` 0 keeps none: each request's group is
    made anew, as each request's sets were before they were kept (what the tests compare the kept ones with)."""

    __slots__ = ("_groups", "limit")

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._groups: dict[tuple[Any, ...], Sets] = {}

    def get(self, values: tuple[Any, ...]) -> Sets | None:
        """The group made for ``values``, or None."""
        if not self.limit:
            return None
        try:
            return self._groups.get((*values, *map(type, values)))
        except TypeError:
            return None

    def keep(self, values: tuple[Any, ...], group: Sets) -> Sets:
        """``group`` kept for ``values`` (when they can be hashed); returns it."""
        if not self.limit:
            return group
        if len(self._groups) >= self.limit:
            self._groups.clear()
        try:
            self._groups[(*values, *map(type, values))] = group
        except TypeError:
            pass
        return group
