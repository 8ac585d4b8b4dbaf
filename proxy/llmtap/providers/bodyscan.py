"""What the usage splice needs from a large request body, read piece by piece as the body arrives.

``splice.prepare_usage`` parses the whole body with ``json.loads`` and then splices. On the relay that is one
call of tens of milliseconds for a body of megabytes, and every other stream waits for it (a flood of 8 MiB chat
bodies took other clients from about 96 ms to a median of 352 ms); a thread does not help, as json's C scanner
keeps the GIL. ``BodyScan`` is fed each piece of the body as the listener hands it over (``feed``): a pure object
that reads the JSON grammar as it goes and keeps only what the splice needs, so each piece costs time in
proportion to its size, and little is left to do once the last one came (``prepared``).

What it keeps: whether the body is one JSON object, its top-level ``stream`` (the last one, as ``json.loads`` keeps it),
its top-level ``stream_options`` (the last one: whether it is an object, where that object closes, whether it is empty,
its ``include_usage`` and ``continuous_usage_stats``), and where the body's object closes. From that, ``prepared`` gives
exactly what ``prepare_usage(body, inject_usage=True)`` gives (``tests/providers/test_bodyscan.py`` holds the two to
each other on generated bodies cut at every byte). What ``json.loads`` refuses is refused, by json's own pieces where it
matters: each piece is decoded as UTF-8 (with or without a BOM; no other encoding is spliced), strings with escapes are
read by json's C ``scanstring`` (controls and escapes as it checks them), plain text up to a quote at memchr speed;
numbers follow JSON's grammar with Python's digit limit, literals are those ``json.loads`` takes (``NaN`` and
``Infinity`` too), and only whitespace may follow the value.

Where it is cheaper than exact, it errs towards forwarding the body unchanged, which is always safe: a body
nested deeper than ``MAX_DEPTH`` (``json.loads`` stops near a thousand), a number or literal longer than
``MAX_TOKEN`` characters, or one needing more than ``MAX_STEPS`` steps of the reader (each container, key, string
and scalar is one; runs of scalars, short strings and flat containers inside a container are read in one step by a
regular expression), which bounds what one body can cost the relay.
"""

from __future__ import annotations

import codecs
import json
import re
import sys
from collections.abc import Callable
from json import decoder

from llmtap.types import UNCHANGED, Prepared

__all__ = ["MAX_DEPTH", "MAX_STEPS", "MAX_TOKEN", "BodyScan"]

#: json's own string reader (C): from just past an opening quote to past the closing one, with the text it read.
scanstring: Callable[[str, int], tuple[str, int]] = decoder.scanstring  # type: ignore[attr-defined]
#: Containers nested deeper than this: the body is forwarded unchanged.
MAX_DEPTH = 500
#: A number or literal longer than this many characters: forwarded unchanged.
MAX_TOKEN = 1 << 16
#: Steps of the reader past which it stops and the body is forwarded unchanged (well under a second of CPU).
MAX_STEPS = 200_000
#: Characters of a string with escapes read in a first look (most end within it; a long one is read to the end of
#: the piece in one more).
_WINDOW = 4096
#: Characters of a key kept to compare (the longest name of interest has 22).
_NAME_CHARS = 64

_WS = re.compile(r"[ \t\n\r]*")
_TOKEN = re.compile(r'[^ \t\n\r,:\[\]{}"]*')
# RFC 8259 section 6, ASCII digits only (as json's C scanner reads them).
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
#: The literals json.loads takes, and whether each is truthy.
_LITERALS = {"true": True, "false": False, "null": False, "NaN": True, "Infinity": True, "-Infinity": True}
# Runs of whole values inside a container, each followed by a comma, read in one step: scalars (numbers of at most
# 639 digits to a part, under any digit limit Python allows), strings of up to 128 characters, flat containers.
_S = r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})){0,128}+"'
_N = r"-?(?:0|[1-9][0-9]{0,638})(?:\.[0-9]{1,639})?(?:[eE][-+]?[0-9]{1,639})?"
_SCALAR = r"(?:" + _S + r"|" + _N + r"|true|false|null|NaN|-?Infinity)"
_W = r"[ \t\n\r]*+"
_MEMBER = _S + _W + r":" + _W + _SCALAR
_FLAT = (
    r"(?:" + _SCALAR
    + r"|\[" + _W + r"(?:" + _SCALAR + _W + r"(?:," + _W + _SCALAR + _W + r")*+)?\]"
    + r"|\{" + _W + r"(?:" + _MEMBER + _W + r"(?:," + _W + _MEMBER + _W + r")*+)?\})"
)  # fmt: skip
_ARRAY_RUN = re.compile(r"(?:" + _W + _FLAT + _W + r",)*+")
_OBJECT_RUN = re.compile(r"(?:" + _W + _S + _W + r":" + _W + _FLAT + _W + r",)*+")
#: Never valid anywhere in a JSON text: control characters but the three whitespace ones (in a string, none is).
_CONTROLS = tuple(chr(c) for c in range(32) if chr(c) not in "\t\n\r")

# Where the reader stands.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _AFTER, _DONE = range(7)
# What a value is to the splice: nothing, the top-level object, the top-level "stream", "stream_options", and in
# that object "include_usage" and "continuous_usage_stats".
_OTHER, _TOP, _STREAM, _OPTIONS, _INCLUDE, _CONTINUOUS = range(6)
_TOP_KEYS = {"stream": _STREAM, "stream_options": _OPTIONS}
_OPTION_KEYS = {"include_usage": _INCLUDE, "continuous_usage_stats": _CONTINUOUS}
_BOM = b"\xef\xbb\xbf"


class _Frame:
    """An open container: ``{`` or ``[``, what it is to the splice, whether it has a member yet."""

    __slots__ = ("full", "object", "role")

    def __init__(self, is_object: bool, role: int) -> None:
        self.object = is_object
        self.role = role
        self.full = False


class BodyScan:
    """Feed it the body's pieces in order (``feed``); then ``prepared(body)`` is ``prepare_usage``'s answer."""

    def __init__(self) -> None:
        self.failed = False
        self._finished = False
        self.steps = 0
        #: Bytes fed so far.
        self.fed = 0
        self._start = b""  # the first bytes, until the encoding is known
        self._started = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")("surrogatepass")
        self._at = 0  # the body's bytes decoded so far
        self._carry = ""  # an unfinished token or escape at the end of the last piece
        self._stack: list[_Frame] = []
        self._state = _VALUE
        self._slot = _TOP  # what the next value is to the splice
        # The string being read: what it is to the splice (None: no string), whether a key, its name's parts
        # when the name matters, whether it has any character.
        self._string: int | None = None
        self._is_key = False
        self._name: list[str] | None = None
        self._string_full = False
        # Where the piece being read starts in the body, and whether its characters are its bytes (ASCII).
        self._base = 0
        self._ascii = True
        # What the splice needs.
        self.top_close = -1
        self.stream = False
        self.has_options = False
        self.options_object = False
        self.options_close = -1
        self.options_empty = True
        self.include = False
        self.continuous = False

    # -- feeding ------------------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """The next piece of the body."""
        if self.failed or not data:
            return
        self.fed += len(data)
        if not self._started:
            self._start += data
            if len(self._start) < 4:
                return  # json.detect_encoding reads four bytes
            data = self._first()
            if self.failed:
                return
        held = len(self._utf8.getstate()[0])
        try:
            text = self._utf8.decode(data)
        except UnicodeDecodeError:
            self._fail()
            return
        taken = held + len(data) - len(self._utf8.getstate()[0])  # the bytes ``text`` holds
        if any(c in text for c in _CONTROLS):
            self._fail()
            return
        carry, self._carry = self._carry, ""
        self._base = self._at - len(carry)  # the carry is ASCII: a token or an escape
        self._at += taken
        self._ascii = len(text) == taken
        self._read(carry + text if carry else text, final=False)

    def _first(self) -> bytes:
        self._started = True
        data, self._start = self._start, b""
        if json.detect_encoding(data) not in ("utf-8", "utf-8-sig"):
            self._fail()  # json.loads reads UTF-16 and UTF-32 too, but bytes spliced into those would corrupt them
            return b""
        if data.startswith(_BOM):
            self._at = len(_BOM)
            data = data[len(_BOM) :]
        return data

    def prepared(self, body: bytes) -> Prepared:
        """After the last piece: the body with ``include_usage: true`` spliced in, as ``prepare_usage`` would
        splice it, or ``UNCHANGED``."""
        found = self.insertion()
        if found is None:
            return UNCHANGED
        at, added = found
        return Prepared(b"".join((memoryview(body)[:at], added, memoryview(body)[at:])), True)

    def _finish(self) -> None:
        """The body ended: what was held back for more (the first bytes, an unfinished token) is read now."""
        if self._finished:
            return
        self._finished = True
        if not self._started and not self.failed:
            self.feed(self._first())
        if not self.failed:
            try:
                self._utf8.decode(b"", final=True)
            except UnicodeDecodeError:
                self._fail()
        if not self.failed and self._carry:
            carry, self._carry = self._carry, ""
            self._base, self._ascii = self._at - len(carry), True
            self._read(carry, final=True)

    def insertion(self) -> tuple[int, bytes] | None:
        """After the last piece: where in the body ``include_usage: true`` goes and the bytes that say it, or None
        when the body goes unchanged (``prepared``'s answer, without building the new body)."""
        self._finish()
        if self.failed or self._state != _DONE or not self.stream:
            return None
        if not self.has_options:
            return self.top_close, b',"stream_options":{"include_usage":true}'
        if not self.options_object or self.include:
            return None
        members = b'"include_usage":true' + (b',"continuous_usage_stats":false' if self.continuous else b"")
        return self.options_close, members if self.options_empty else b"," + members

    def _fail(self) -> None:
        self.failed = True
        self._carry = ""

    def _offset(self, buf: str, i: int) -> int:
        """The body's byte offset of ``buf[i]``."""
        return self._base + (i if self._ascii else len(buf[:i].encode("utf-8", "surrogatepass")))

    # -- the grammar --------------------------------------------------------------------------------

    def _read(self, buf: str, *, final: bool) -> None:
        """Read ``buf`` as far as it goes; an unfinished token or escape stays for the next piece."""
        i, n = 0, len(buf)
        while i < n and not self.failed:
            self.steps += 1
            if self.steps > MAX_STEPS:
                self._fail()
                return
            if self._string is not None:
                i = self._in_string(buf, i)
                continue
            i = _WS.match(buf, i).end()  # type: ignore[union-attr]
            if i == n:
                return
            c = buf[i]
            state = self._state
            if state == _DONE:
                self._fail()  # json.loads: "Extra data"
            elif c == '"':
                i = self._open_string(i)
            elif state == _VALUE or state == _VALUE_OR_CLOSE:
                i = self._value(buf, i, final)
            elif c == "}" or c == "]":
                self._close(c == "}", buf, i)
                i += 1
            elif c == ":" and state == _COLON:
                self._state = _VALUE
                i += 1
            elif c == "," and state == _AFTER:
                i = self._comma(buf, i + 1)
            else:
                self._fail()

    def _value(self, buf: str, i: int, final: bool) -> int:
        c = buf[i]
        if c == "]" and self._state == _VALUE_OR_CLOSE:  # an empty array
            self._close(False, buf, i)
            return i + 1
        if c == "{" or c == "[":
            return self._open(c == "{", i)
        end = _TOKEN.match(buf, i).end()  # type: ignore[union-attr]
        if end - i > MAX_TOKEN:
            self._fail()
            return end
        if end == len(buf) and not final:
            self._carry = buf[i:]  # the next piece may go on with it
            return end
        token = buf[i:end]
        truthy = _LITERALS.get(token)
        if truthy is None:
            truthy = self._number(token)
            if self.failed:
                return end
        if self._stack:
            self._stack[-1].full = True
        self._took(token == "true", truthy)
        return end

    def _number(self, token: str) -> bool:
        """Whether a number is not zero (only ``continuous_usage_stats`` asks); fails what json.loads refuses."""
        match = _NUMBER.fullmatch(token)
        if match is None:
            self._fail()
            return False
        if match.group(1) is None and match.group(2) is None:
            limit = sys.get_int_max_str_digits()
            if limit and len(token) - token.startswith("-") > limit:
                self._fail()  # json.loads: "Exceeds the limit ... for integer string conversion"
                return False
        return self._slot != _CONTINUOUS or float(token) != 0.0

    def _took(self, is_true: bool, truthy: bool) -> None:
        """A scalar or a string ended: what it was to the splice."""
        slot = self._slot
        if slot == _STREAM:
            self.stream = is_true
        elif slot == _OPTIONS:
            self.has_options, self.options_object = True, False
        elif slot == _INCLUDE:
            self.include = is_true
        elif slot == _CONTINUOUS:
            self.continuous = truthy
        elif slot == _TOP:
            self._fail()  # not an object: never spliced
            return
        self._slot = _OTHER
        self._state = _AFTER if self._stack else _DONE

    def _open(self, is_object: bool, i: int) -> int:
        slot = self._slot
        if len(self._stack) >= MAX_DEPTH or (slot == _TOP and not is_object):
            self._fail()
            return i
        if self._stack:
            self._stack[-1].full = True
        role = slot
        if slot == _OPTIONS:
            self.has_options, self.options_object = True, is_object
            self.include = self.continuous = False
            role = _OPTIONS if is_object else _OTHER
        elif slot == _STREAM:
            self.stream, role = False, _OTHER  # a container is not ``true``
        elif slot == _INCLUDE:
            self.include, role = False, _OTHER
        self._stack.append(_Frame(is_object, role))
        self._slot = _OTHER
        self._state = _KEY_OR_CLOSE if is_object else _VALUE_OR_CLOSE
        return i + 1

    def _close(self, is_object: bool, buf: str, i: int) -> None:
        frame = self._stack[-1] if self._stack else None
        allowed = (_KEY_OR_CLOSE, _AFTER) if is_object else (_VALUE_OR_CLOSE, _AFTER)
        if frame is None or frame.object != is_object or self._state not in allowed:
            self._fail()
            return
        self._stack.pop()
        if frame.role == _TOP:
            self.top_close = self._offset(buf, i)
        elif frame.role == _OPTIONS:
            self.options_close, self.options_empty = self._offset(buf, i), not frame.full
        elif frame.role == _CONTINUOUS:
            self.continuous = frame.full
        self._state = _AFTER if self._stack else _DONE

    def _comma(self, buf: str, i: int) -> int:
        """After a comma: a run of whole members read in one step, where nothing in them matters to the splice."""
        frame = self._stack[-1]
        self._state = _KEY if frame.object else _VALUE
        if frame.role == _TOP or frame.role == _OPTIONS:
            return i
        return (_OBJECT_RUN if frame.object else _ARRAY_RUN).match(buf, i).end()  # type: ignore[union-attr]

    # -- strings ------------------------------------------------------------------------------------

    def _open_string(self, i: int) -> int:
        state = self._state
        frame = self._stack[-1] if self._stack else None
        if frame is None or state in (_COLON, _AFTER):
            self._fail()  # a string at the top (never spliced), or where none may be
            return i
        frame.full = True
        self._is_key = state == _KEY or state == _KEY_OR_CLOSE
        self._name = [] if self._is_key and frame.role in (_TOP, _OPTIONS) else None
        self._string = self._slot
        self._string_full = False
        return i + 1

    def _in_string(self, buf: str, i: int) -> int:
        """Read a string's characters from ``i``: to its closing quote, or to the end of ``buf``.

        Plain text up to the next quote is looked at with ``str.find`` (memchr); a string with escapes before it
        is read by json's C ``scanstring``."""
        n = len(buf)
        quote = buf.find('"', i)
        end = n if quote < 0 else quote
        if buf.find("\\", i, end) < 0:
            if buf.find("\n", i, end) >= 0 or buf.find("\r", i, end) >= 0 or buf.find("\t", i, end) >= 0:
                self._fail()  # a raw control character (the others were refused with the piece)
                return n
            self._took_chars(buf[i:end] if self._name is not None else "", end > i)
            if quote < 0:
                return n
            self._end_string()
            return quote + 1
        return self._escaped(buf, i, n)

    def _escaped(self, buf: str, i: int, n: int) -> int:
        """A string with escapes, from ``i``: json's ``scanstring`` reads it, a first window of it, then the rest of
        the piece, each cut before an unfinished escape and closed with a quote of ours. Its own closing quote may
        come first (the string ends there); else it goes on in the next piece, with the unfinished escape."""
        window = min(n, i + _WINDOW)
        while True:
            cut = window - _unfinished_escape(buf, i, window)
            try:
                value, stop = scanstring(buf[i:cut] + '"', 0)
            except ValueError:
                self._fail()  # a raw control character or a bad escape
                return n
            self._took_chars(value, bool(value))
            if stop <= cut - i:  # its own closing quote
                self._end_string()
                return i + stop
            if window == n:
                self._carry = buf[cut:]
                return n
            i, window = cut, n

    def _took_chars(self, chars: str, any_char: bool) -> None:
        self._string_full = self._string_full or any_char
        name = self._name
        if name is not None:
            name.append(chars)
            if sum(map(len, name)) > _NAME_CHARS:
                self._name = None  # too long to be a name that matters

    def _end_string(self) -> None:
        slot, name = self._string, self._name
        self._string, self._name = None, None
        if self._is_key:
            role = self._stack[-1].role
            names = _TOP_KEYS if role == _TOP else _OPTION_KEYS if role == _OPTIONS else {}
            self._slot = names.get("".join(name), _OTHER) if name is not None else _OTHER
            self._state = _COLON
            return
        assert slot is not None
        self._slot = slot
        self._took(False, self._string_full)


def _unfinished_escape(buf: str, start: int, n: int) -> int:
    """How many characters at the end of ``buf[start:n]`` begin an escape the next piece finishes (0 if none)."""
    j = buf.rfind("\\", max(start, n - 5), n)
    if j < 0:
        return 0
    run = buf[start : j + 1]
    if (len(run) - len(run.rstrip("\\"))) % 2 == 0:
        return 0  # the last backslash is escaped itself
    tail = buf[j:n]
    return len(tail) if tail == "\\" or (tail[1] == "u" and len(tail) < 6) else 0
