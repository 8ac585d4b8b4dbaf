"""What the usage splice needs from a large request body, read piece by piece as the body arrives (issue 44).

``splice.prepare_usage`` parses the whole body with ``json.loads`` and then splices. On the relay that is one
call of tens of milliseconds for a body of megabytes, and every other stream waits for it (a flood of 8 MiB chat
bodies took other clients from about 96 ms to a median of 352 ms); a thread does not help, as json's C scanner
keeps the GIL. ``BodyScan`` is fed each piece of the body as the listener hands it over (``feed``): a pure object
that reads the JSON grammar as it goes and keeps only what the splice needs, so each piece costs time in
proportion to its size, and nothing is left to do once the last one came (``prepared``).

What it keeps: whether the body is one JSON object, its top-level ``stream`` (the last one, as ``json.loads`` keeps
it), its top-level ``stream_options`` (the last one: whether it is an object, where that object closes, whether
it is empty, its ``include_usage`` and ``continuous_usage_stats``), and where the body's object closes. From that,
``prepared`` gives exactly what ``prepare_usage(body, inject_usage=True)`` gives (``tests/test_bodyscan.py`` holds
the two to each other on generated bodies cut at every byte). What ``json.loads`` refuses is refused: UTF-8 (with
or without a BOM; any other encoding is never spliced), strings (no raw control character, only JSON's escapes),
numbers (JSON's grammar, ASCII digits, integers within Python's digit limit), the literals ``json.loads`` takes
(``NaN`` and ``Infinity`` too), the structure, and nothing but whitespace after the value.

Where it is cheaper than exact, it errs towards forwarding the body unchanged, which is always safe: a body
nested deeper than ``MAX_DEPTH`` (``json.loads`` stops near a thousand), a number or literal longer than
``MAX_TOKEN`` bytes, or one needing more than ``MAX_STEPS`` steps of the reader (each container, key and
long string is one; runs of scalars, short strings and flat containers inside arrays and objects are read
in one step by a regular expression), which bounds what one body can cost the relay.
"""

from __future__ import annotations

import codecs
import json
import re
import sys

from llmtap.types import UNCHANGED, Prepared

__all__ = ["MAX_DEPTH", "MAX_STEPS", "MAX_TOKEN", "BodyScan"]

#: Containers nested deeper than this: the body is forwarded unchanged.
MAX_DEPTH = 500
#: A number or literal longer than this many bytes: forwarded unchanged.
MAX_TOKEN = 1 << 16
#: Steps of the reader past which it stops and the body is forwarded unchanged (a few hundred ms of CPU at most).
MAX_STEPS = 500_000
#: Keys kept to compare (the longest name of interest, every character escaped, is 84 bytes).
_KEY_BYTES = 256

# The grammar's pieces, on bytes. Whitespace; a number (RFC 8259 section 6, ASCII digits); a literal json.loads
# takes; one escape of a string; a string's plain run (no quote, backslash or control character).
_WS = re.compile(rb"[ \t\n\r]*")
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_LITERALS = {b"true": True, b"false": False, b"null": False, b"NaN": True, b"Infinity": True, b"-Infinity": True}
_TOKEN = re.compile(rb'[^ \t\n\r,:\[\]{}"]*')
_ESCAPE_START = re.compile(rb"\\(?:u[0-9a-fA-F]{0,3})?")
# A run of complete values inside a container, each followed by a comma, read in one step: scalars (numbers
# with at most 639 digits to a part, below any digit limit Python allows), strings, and flat containers of those.
_S = rb'"(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+"'
_N = rb"-?(?:0|[1-9][0-9]{0,638})(?:\.[0-9]{1,639})?(?:[eE][-+]?[0-9]{1,639})?"
_SCALAR = rb"(?:" + _S + rb"|" + _N + rb"|true|false|null|NaN|-?Infinity)"
_W = rb"[ \t\n\r]*+"
_MEMBER = _S + _W + rb":" + _W + _SCALAR
_FLAT = (
    rb"(?:" + _SCALAR
    + rb"|\[" + _W + rb"(?:" + _SCALAR + _W + rb"(?:," + _W + _SCALAR + _W + rb")*+)?\]"
    + rb"|\{" + _W + rb"(?:" + _MEMBER + _W + rb"(?:," + _W + _MEMBER + _W + rb")*+)?\})"
)  # fmt: skip
_STRING = re.compile(rb'(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+')
_ARRAY_RUN = re.compile(rb"(?:" + _W + _FLAT + _W + rb",)*+")
_OBJECT_RUN = re.compile(rb"(?:" + _W + _S + _W + rb":" + _W + _FLAT + _W + rb",)*+")
# Always invalid anywhere in a JSON text: control characters other than the three whitespace ones.
_CONTROLS = bytes(c for c in range(32) if c not in b"\t\n\r")

# Where the reader stands.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _AFTER, _DONE = range(7)
# What a value is to the splice: nothing, the top-level object, the top-level "stream", "stream_options", and
# inside that object "include_usage" and "continuous_usage_stats".
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
        self.steps = 0
        self._start = b""  # the first bytes, until the encoding is known
        self._started = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")("surrogatepass")
        self._carry = b""  # an unfinished token or escape at the end of the last piece
        self._at = 0  # offset in the body of the next byte fed
        self._stack: list[_Frame] = []
        self._state = _VALUE
        self._slot = _TOP  # what the next value is to the splice
        # The string being read: its role (what it is to the splice), its bytes when they matter, whether any.
        self._string: int | None = None
        self._is_key = False
        self._kept: bytearray | None = None
        self._string_full = False
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
        if not self._started:
            data = self._begin(data)
            if not data:
                return
        if len(data.translate(None, _CONTROLS)) != len(data):
            self._fail()  # a control character JSON never allows, in a string or out of one
            return
        try:
            if not data.isascii() or self._utf8.getstate()[0]:
                self._utf8.decode(data)
        except UnicodeDecodeError:
            self._fail()
            return
        base = self._at - len(self._carry)
        buf = self._carry + data if self._carry else data
        self._at += len(data)
        self._carry = b""
        self._read(buf, base, final=False)

    def _begin(self, data: bytes) -> bytes:
        """Hold the first bytes until the encoding is known (``json.detect_encoding`` reads four); skip a BOM."""
        self._start += data
        if len(self._start) < 4:
            return b""
        return self._first()

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
        if not self._started and not self.failed:
            rest = self._first()
            if rest:
                self.feed(rest)
        if not self.failed:
            try:
                self._utf8.decode(b"", final=True)
            except UnicodeDecodeError:
                self._fail()
        if not self.failed and self._carry:
            buf, self._carry = self._carry, b""
            self._read(buf, self._at - len(buf), final=True)
        if self.failed or self._state != _DONE or self._string is not None or self.top_close < 0 or not self.stream:
            return UNCHANGED
        if not self.has_options:
            return _insert(body, self.top_close, b',"stream_options":{"include_usage":true}')
        if not self.options_object or self.include:
            return UNCHANGED
        members = b'"include_usage":true' + (b',"continuous_usage_stats":false' if self.continuous else b"")
        return _insert(body, self.options_close, members if self.options_empty else b"," + members)

    def _fail(self) -> None:
        self.failed = True
        self._carry = b""

    # -- the grammar --------------------------------------------------------------------------------

    def _read(self, buf: bytes, base: int, *, final: bool) -> None:
        """Read ``buf`` (its first byte at ``base`` in the body) as far as it goes; an unfinished token stays."""
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
            elif c == 0x22:  # "
                i = self._open_string(i)
            elif state == _VALUE or state == _VALUE_OR_CLOSE:
                i = self._value(buf, i, base, final)
            elif c == 0x7D or c == 0x5D:  # } ]
                self._close(c == 0x7D, base + i)
                i += 1
            elif c == 0x3A and state == _COLON:  # :
                self._state = _VALUE
                i += 1
            elif c == 0x2C and state == _AFTER:  # ,
                i = self._comma(buf, i + 1)
            else:
                self._fail()

    def _value(self, buf: bytes, i: int, base: int, final: bool) -> int:
        c = buf[i]
        if c == 0x5D and self._state == _VALUE_OR_CLOSE:  # ] of an empty array
            self._close(False, base + i)
            return i + 1
        if c == 0x7B or c == 0x5B:  # { [
            return self._open(c == 0x7B, i)
        end = _TOKEN.match(buf, i).end()  # type: ignore[union-attr]
        if end - i > MAX_TOKEN:
            self._fail()
            return end
        if end == len(buf) and not final:
            self._carry = buf[i:]
            return end
        token = buf[i:end]
        truthy = _LITERALS.get(token)
        if truthy is None:
            truthy = self._number(token)
            if self.failed:
                return end
        if self._stack:
            self._stack[-1].full = True
        self._took(token == b"true", truthy)
        return end

    def _number(self, token: bytes) -> bool:
        """Whether a number token is not zero (only ``continuous_usage_stats`` asks); fails what json.loads refuses."""
        match = _NUMBER.fullmatch(token)
        if match is None:
            self._fail()
            return False
        if match.group(1) is None and match.group(2) is None:
            limit = sys.get_int_max_str_digits()
            if limit and len(token) - token.startswith(b"-") > limit:
                self._fail()  # json.loads: "Exceeds the limit ... for integer string conversion"
                return False
        return self._slot != _CONTINUOUS or float(token) != 0.0

    def _took(self, is_true: bool, truthy: bool) -> None:
        """A scalar value (or a string) ended: what it was to the splice."""
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
            self.has_options = True
            self.options_object = is_object
            if is_object:
                self.include = self.continuous = False
            else:
                role = _OTHER
        elif slot == _STREAM:
            self.stream = False
            role = _OTHER
        elif slot == _INCLUDE:
            self.include = False
            role = _OTHER
        self._stack.append(_Frame(is_object, role))
        self._slot = _OTHER
        self._state = _KEY_OR_CLOSE if is_object else _VALUE_OR_CLOSE
        return i + 1

    def _close(self, is_object: bool, at: int) -> None:
        state = self._state
        frame = self._stack[-1] if self._stack else None
        allowed = (_KEY_OR_CLOSE, _AFTER) if is_object else (_VALUE_OR_CLOSE, _AFTER)
        if frame is None or frame.object != is_object or state not in allowed:
            self._fail()
            return
        self._stack.pop()
        role = frame.role
        if role == _TOP:
            self.top_close = at
        elif role == _OPTIONS:
            self.options_close, self.options_empty = at, not frame.full
        elif role == _CONTINUOUS:
            self.continuous = frame.full
        self._state = _AFTER if self._stack else _DONE

    def _comma(self, buf: bytes, i: int) -> int:
        """After a comma: a run of whole members read in one step where nothing in them matters to the splice."""
        frame = self._stack[-1]
        if frame.role in (_TOP, _OPTIONS):
            self._state = _KEY if frame.object else _VALUE
            return i
        end = (_OBJECT_RUN if frame.object else _ARRAY_RUN).match(buf, i).end()  # type: ignore[union-attr]
        self._state = _KEY if frame.object else _VALUE
        return end

    # -- strings ------------------------------------------------------------------------------------

    def _open_string(self, i: int) -> int:
        state = self._state
        frame = self._stack[-1] if self._stack else None
        if state in (_KEY, _KEY_OR_CLOSE):
            assert frame is not None
            frame.full = True
            self._is_key = True
            self._kept = bytearray() if frame.role in (_TOP, _OPTIONS) else None
        elif state in (_VALUE, _VALUE_OR_CLOSE):
            if self._slot == _TOP:
                self._fail()
                return i
            if frame is not None:
                frame.full = True
            self._is_key = False
            self._kept = None
        else:
            self._fail()
            return i
        self._string = self._slot
        self._string_full = False
        return i + 1

    def _in_string(self, buf: bytes, i: int) -> int:
        """Read a string's bytes from ``i``: to its closing quote, or to the end of ``buf``.

        Plain text runs to the next quote at memchr speed; a string with escapes before it is read by one regular
        expression (in C), which takes escaped quotes in its stride."""
        n = len(buf)
        quote = buf.find(b'"', i)
        end = n if quote < 0 else quote
        if buf.find(b"\\", i, end) < 0:
            if buf.find(b"\n", i, end) >= 0 or buf.find(b"\r", i, end) >= 0 or buf.find(b"\t", i, end) >= 0:
                self._fail()  # a raw control character in a string (the others were refused with the piece)
                return n
            self._keep(buf, i, end)
            if quote < 0:
                return n
            self._end_string()
            return quote + 1
        stop = _STRING.match(buf, i).end()  # type: ignore[union-attr]
        self._keep(buf, i, stop)
        if stop == n:
            return n
        if buf[stop] == 0x22:  # "
            self._end_string()
            return stop + 1
        if _ESCAPE_START.fullmatch(buf, stop):
            self._carry = buf[stop:]  # an escape the next piece finishes
            return n
        self._fail()  # a bad escape, or a raw control character
        return n

    def _keep(self, buf: bytes, start: int, end: int) -> None:
        if end == start:
            return
        self._string_full = True
        kept = self._kept
        if kept is not None:
            if len(kept) + end - start > _KEY_BYTES:
                self._kept = None  # too long to be a name that matters
            else:
                kept += buf[start:end]

    def _end_string(self) -> None:
        slot, kept = self._string, self._kept
        self._string, self._kept = None, None
        if self._is_key:
            frame = self._stack[-1]
            name = _decode(kept) if kept is not None else None
            names = _TOP_KEYS if frame.role == _TOP else _OPTION_KEYS if frame.role == _OPTIONS else {}
            self._slot = names.get(name, _OTHER) if name is not None else _OTHER
            self._state = _COLON
            return
        assert slot is not None
        self._slot = slot
        self._took(False, self._string_full)


def _decode(kept: bytearray) -> str | None:
    """A string's bytes as ``json.loads`` decodes them."""
    try:
        value = json.loads(b'"' + bytes(kept) + b'"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _insert(body: bytes, at: int, inserted: bytes) -> Prepared:
    return Prepared(b"".join((memoryview(body)[:at], inserted, memoryview(body)[at:])), True)
