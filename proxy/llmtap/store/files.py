"""Which files a record path names: paths, globs and directories, deduplicated.

A path that is a file reads as that file and its rotated siblings (``PATH.1``, ``PATH.2`` .., as
``--record PATH`` wrote them before the dataset layout). A directory is searched recursively for
record files: ``*.jsonl``, ``*.jsonl.gz``, ``*.parquet`` and rotated ``*.jsonl.N``, never a ``.part``
being written. A path that does not exist and holds ``*``, ``?`` or ``[`` is a glob (``**`` crosses
directories). Of one file stem, one copy is read: ``X.parquet`` over ``X.jsonl.gz`` over ``X.jsonl``
(a closed file is compressed to ``.gz`` and the ``.jsonl`` removed after; a reader between the two
steps sees both).

Reading never stops at a damaged file: a file that cannot be opened, an empty or foreign one, compressed
data cut short or corrupt, a line that is not UTF-8, longer than ``MAX_LINE`` or not a record are passed over and
counted by cause with the file they were in (``llmtap.store.skips``), the rows before a damage read. What names a
record is its ``record_id``, or in a record of an older version its ``trace_id`` and ``span_id`` (``identity``): a
journal replays records at least once, so a reader counts each identity once, the first copy read.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import stat
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from llmtap.store.skips import MAX_LINE, Skips

__all__ = [
    "SCHEMA_KEY",
    "SCHEMA_VERSIONS",
    "Listing",
    "NoRecords",
    "ReadStats",
    "file_lines",
    "find",
    "identity",
    "inspect",
    "read_file",
    "read_records",
    "record_files",
    "record_files_at",
    "settle",
    "splits_at_cr",
]

#: The key that marks a line as a request record; its value is the schema version.
SCHEMA_KEY = "llmtap_record"
#: The record schema versions this reader understands (``docs/record.schema.json`` describes the newest).
SCHEMA_VERSIONS = (1, 2)
_OWN_PREFIX = b'{"' + SCHEMA_KEY.encode() + b'":'

_ROTATED = re.compile(r".+\.(\d+)")
_GLOB = re.compile(r"[*?\[]")
#: Suffixes of one stem in order of preference.
_KINDS = (".parquet", ".jsonl.gz", ".jsonl")


class NoRecords(ValueError):
    """No record file where the paths point."""


def _rotated(base: Path) -> list[Path]:
    """``base`` and its rotated siblings, oldest first."""
    pattern = re.compile(re.escape(base.name) + r"\.(\d+)")
    rotated: list[tuple[int, Path]] = []
    if base.parent.is_dir():
        for sibling in base.parent.iterdir():
            match = pattern.fullmatch(sibling.name)
            if match and sibling.is_file():
                rotated.append((int(match.group(1)), sibling))
    out = [p for _, p in sorted(rotated, reverse=True)]
    if base.is_file():
        out.append(base)
    return out


def _is_record_file(path: Path) -> bool:
    name = path.name
    if name.endswith(_KINDS):
        return True
    match = _ROTATED.fullmatch(name)
    return match is not None and name[: -len(match.group(1)) - 1].endswith(".jsonl")


def _stem(path: Path) -> tuple[Path, int] | None:
    """The stem a dataset file shares with its other forms, and its form's rank (lower wins)."""
    for rank, suffix in enumerate(_KINDS):
        if path.name.endswith(suffix):
            return path.with_name(path.name[: -len(suffix)]), rank
    return None


@dataclass(slots=True)
class Listing:
    """The record files some paths name, and what is named like one but is no regular file (a directory, a pipe,
    a broken link), with what it is."""

    files: list[Path]
    odd: dict[str, str] = field(default_factory=dict)


def _odd(path: Path) -> str:
    """What a path named like a record file is, when it is not a regular file."""
    if path.is_dir():
        return "a directory"
    if path.is_symlink() and not path.exists():
        return "a broken link"
    return "not a regular file"


def _walk(root: Path, odd: dict[str, str]) -> list[Path]:
    """The record files under ``root`` (links to folders not followed); what is named like one but is no file,
    and a folder that cannot be listed (whose files would be missed in silence), into ``odd``."""
    out = []

    def failed(exc: OSError) -> None:
        odd[str(exc.filename or root)] = f"a folder that cannot be listed: {exc.strerror or exc}"

    for folder, dirs, names in os.walk(root, onerror=failed):
        base = Path(folder)
        for name in dirs:
            if _is_record_file(base / name):
                odd[str(base / name)] = _odd(base / name)
        for name in names:
            path = base / name
            if not _is_record_file(path):
                continue
            if path.is_file():
                out.append(path)
            else:
                odd[str(path)] = _odd(path)
    return sorted(out)


def find(paths: Iterable[str | Path]) -> Listing:
    """Every record file the paths name, each once, and the odd entries named like one; ``NoRecords`` when
    there is neither."""
    found: list[Path] = []
    odd: dict[str, str] = {}
    given = [str(p) for p in paths]
    for text in given:
        path = Path(text)
        if path.is_dir():
            found += _walk(path, odd)
        elif path.exists() or path.is_symlink():
            found += _rotated(path)
            if not path.is_file():
                odd[str(path)] = _odd(path)
        elif _GLOB.search(text):
            for hit in sorted(glob.glob(text, recursive=True)):
                p = Path(hit)
                if p.is_dir():
                    found += _walk(p, odd)
                elif p.is_file():
                    found.append(p)
                else:
                    odd[str(p)] = _odd(p)
        else:
            found += _rotated(path)  # rotated siblings of a file being rotated right now
    unique = list(dict.fromkeys(p.resolve() for p in found))
    best: dict[Path, tuple[int, Path]] = {}
    for p in unique:
        stem = _stem(p)
        if stem is not None and (stem[0] not in best or stem[1] < best[stem[0]][0]):
            best[stem[0]] = (stem[1], p)
    out = [p for p in unique if (stem := _stem(p)) is None or best[stem[0]][1] == p]
    if not out and not odd:
        where = ", ".join(repr(t) for t in given) or "(no path)"
        raise NoRecords(f"no record file at {where}")
    return Listing(out, odd)


def record_files(paths: Iterable[str | Path]) -> list[Path]:
    """Every record file the paths name, each once; ``NoRecords`` when there is none."""
    given = [str(p) for p in paths]
    files = find(given).files
    if not files:
        where = ", ".join(repr(t) for t in given) or "(no path)"
        raise NoRecords(f"no record file at {where}")
    return files


def record_files_at(path: str | Path) -> list[Path]:
    """The record files at one ``path`` (a record folder, or a file of an earlier version and its rotated
    siblings), oldest first; none: an empty list (``record_files`` raises ``NoRecords`` instead)."""
    try:
        return record_files([path])
    except NoRecords:
        return []


#: Bytes read (and, compressed, decompressed) at a time.
CHUNK = 256 * 1024
_GZIP_MAGIC = b"\x1f\x8b"
_PARQUET_MAGIC = b"PAR1"


def inspect(file: Path) -> tuple[str, str] | None:
    """Why ``file`` cannot be read at all, before reading it, as (cause, what): ``unreadable`` (it cannot be
    opened, or is no regular file) or ``damaged`` (empty, or not the format its name says; a Parquet file cut
    short); None when it may be read. Cheap: a stat, an open, and the first and last bytes."""
    try:
        with file.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return "unreadable", "not a regular file"
            head = f.read(4)
            tail = b""
            if file.name.endswith(".parquet") and size >= 8:
                f.seek(size - 4)
                tail = f.read(4)
    except FileNotFoundError:
        return "unreadable", "removed before it was read"
    except PermissionError:
        return "unreadable", "permission denied"
    except IsADirectoryError:
        return "unreadable", "a directory"
    except OSError as exc:
        return "unreadable", exc.strerror or str(exc)
    if size == 0 and file.name.endswith((".gz", ".parquet")):
        return "damaged", "empty"
    if file.name.endswith(".gz") and head[:2] != _GZIP_MAGIC:
        return "damaged", "not gzip"
    if file.name.endswith(".parquet"):
        if head != _PARQUET_MAGIC:
            return "damaged", "not Parquet"
        if size < 12 or tail != _PARQUET_MAGIC:
            return "damaged", "Parquet cut short"
    return None


def _header_end(buf: bytes) -> int | None:
    """Where the header of the gzip member at the start of ``buf`` ends; None while ``buf`` holds only part of it;
    ``zlib.error`` when it is no gzip header (RFC 1952, 2.3)."""
    if buf[:2] != _GZIP_MAGIC[: len(buf[:2])] or (len(buf) > 2 and buf[2] != 8):
        raise zlib.error("data after the end of the compressed stream" if buf else "not gzip")
    if len(buf) < 10:
        return None
    flags, pos = buf[3], 10
    if flags & 4:  # FEXTRA
        if len(buf) < pos + 2:
            return None
        pos += 2 + int.from_bytes(buf[pos : pos + 2], "little")
    for bit in (8, 16):  # FNAME, FCOMMENT: zero-terminated
        if flags & bit:
            end = buf.find(b"\0", pos)
            if end < 0:
                return None
            pos = end + 1
    if flags & 2:  # FHCRC
        pos += 2
    return pos if pos <= len(buf) else None


class _Buffer:
    """Compressed bytes read ahead of the decompressor."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.data, self.eof = f, b"", False

    def more(self) -> None:
        piece = self.f.read(CHUNK)
        self.eof = not piece
        self.data += piece


def _gunzip(f: IO[bytes]) -> Iterator[bytes]:
    """The decompressed bytes of a gzip stream (one member or several), in pieces of at most ``CHUNK``;
    ``EOFError`` (cut short) or ``zlib.error`` (corrupt) after the last piece that could be decompressed.

    The members' checksums are not checked, as the engine does not check them: a damaged byte shows as a line that
    is not a record, the same whichever source reads the file."""
    buf = _Buffer(f)
    buf.more()
    while buf.data:
        while (start := _header_end(buf.data)) is None:
            if buf.eof:
                raise EOFError("compressed data cut short")
            buf.more()
        d = zlib.decompressobj(-zlib.MAX_WBITS)
        buf.data = buf.data[start:]
        while not d.eof:
            if not buf.data and not d.unconsumed_tail:
                buf.more()
                if buf.eof:
                    raise EOFError("compressed data cut short")
            data, buf.data = (d.unconsumed_tail, buf.data) if d.unconsumed_tail else (buf.data, b"")
            out = d.decompress(data, CHUNK)
            if out:
                yield out
        buf.data = d.unused_data + buf.data
        while len(buf.data) < 8 and not buf.eof:  # the member's CRC-32 and size
            buf.more()
        if len(buf.data) < 8:
            raise EOFError("compressed data cut short")
        buf.data = buf.data[8:]
        if not buf.data:
            buf.more()


def _pieces(file: Path) -> Iterator[bytes]:
    with file.open("rb") as f:
        if file.name.endswith(".gz"):
            yield from _gunzip(f)
            return
        while piece := f.read(CHUNK):
            yield piece


def _damage(exc: BaseException) -> str:
    """What an error while reading a file says of it."""
    if isinstance(exc, EOFError):
        return "compressed data cut short"
    if isinstance(exc, zlib.error):
        return f"compressed data corrupt: {exc}"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return getattr(exc, "strerror", None) or str(exc)


def _blank(line: bytes) -> bool:
    # As the engine reads a line: a short one of spaces, tabs and carriage returns is no line at all.
    return len(line) < 64 and not line.strip(b" \t\r")


def file_lines(file: Path, skips: Skips) -> Iterator[bytes]:
    """The lines of a JSON-lines file (plain or gzip), each without its newline; blank lines left out; a line of
    ``MAX_LINE`` bytes or more counted (``too_long``) and passed over without being held. A file that cannot be
    read to its end is counted (``damaged`` for compressed data cut short or corrupt, else ``unreadable``) after
    the lines before the damage, the last of them as far as it got."""
    name = str(file)
    tail = b""  # the line being gathered
    dropping = False  # the line being gathered passed MAX_LINE: counted, and dropped up to its newline
    try:
        for piece in _pieces(file):
            parts = piece.split(b"\n")
            last = parts.pop()
            if parts:
                if dropping:
                    dropping = False
                    del parts[0]
                else:
                    parts[0] = tail + parts[0]
                for line in parts:
                    if len(line) >= MAX_LINE:
                        skips.add("too_long", name)
                    elif not _blank(line):
                        yield line
                tail = b""
            if not dropping:
                tail += last
                if len(tail) >= MAX_LINE:
                    skips.add("too_long", name)
                    dropping, tail = True, b""
    except FileNotFoundError:
        skips.add("unreadable", name, why="removed while it was read")
    except (OSError, EOFError, zlib.error) as exc:
        cause = "damaged" if isinstance(exc, EOFError | zlib.error | gzip.BadGzipFile) else "unreadable"
        skips.add(cause, name, why=_damage(exc))
    if tail and not _blank(tail):
        yield tail


#: The whitespace JSON allows around a value that a line may hold (a newline ends the line), and that the engine's
#: CSV reader may take for a line's end when a carriage return is in it: the kind of a line is that of its JSON.
_JSON_SPACE = b" \t\r"


def _is_own(raw: bytes) -> bool:
    """A line llmtap began to write: its JSON starts with the record key, or is cut short within it. The
    whitespace around it is no part of it (a stray carriage return may make the engine read it without)."""
    text = raw.strip(_JSON_SPACE)
    return text.startswith(_OWN_PREFIX) or (text != b"" and _OWN_PREFIX.startswith(text))


def splits_at_cr(file: Path) -> bool:
    """Whether the engine's CSV reader would end lines at a carriage return where this module reads one line: a
    file with a carriage return and no newline in its first ``MAX_LINE`` bytes (the reader then takes the
    carriage return for the file's line end). Cheap: the first line only; a file that fails to read says no
    (its damage is counted when it is read)."""
    seen = b""
    try:
        for piece in _pieces(file):
            seen += piece
            if b"\n" in seen or len(seen) >= MAX_LINE:
                break
    except (OSError, EOFError, zlib.error):
        return False
    return b"\r" in seen[:MAX_LINE] and b"\n" not in seen[:MAX_LINE]


def readable(obj: Any, skips: Skips, file: str | None = None) -> bool:
    """Whether a parsed line is a record of a known schema version; if not, counted in ``skips``."""
    if not isinstance(obj, dict) or SCHEMA_KEY not in obj:
        skips.add("foreign", file)
        return False
    version = obj[SCHEMA_KEY]
    if isinstance(version, bool) or not isinstance(version, int) or version not in SCHEMA_VERSIONS:
        skips.add("other_schema", file)
        return False
    return True


def read_file(file: Path, skips: Skips) -> Iterator[dict[str, Any]]:
    """The records of one file (JSON lines, plain or gzip; Parquet through ``pyarrow``); whatever is not a record
    counted in ``skips`` by cause (``llmtap.store.skips.CAUSES``), and never a reason to stop.

    A line that does not parse is ``truncated`` when it is one of ours (its JSON, without the whitespace
    around it, starts with the record key, or is cut short within it: the proxy was killed, or is writing it
    now), else ``foreign``.
    """
    if file.name.endswith(".parquet"):
        yield from _read_parquet(file, skips)
        return
    name = str(file)
    for raw in file_lines(file, skips):
        obj = settle(raw, skips, name)
        if obj is not None:
            yield obj


def settle(raw: bytes, skips: Skips, file: str | None = None) -> dict[str, Any] | None:
    """One line as a record, or None with the reason counted in ``skips``: not UTF-8, not JSON (``truncated``
    when it is one of ours, else ``foreign``), not a record, or a record of another schema version."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        skips.add("not_utf8", file)
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        skips.add("truncated" if _is_own(raw) else "foreign", file)
        return None
    return obj if readable(obj, skips, file) else None


def _read_parquet(file: Path, skips: Skips) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise OSError(f"{file}: reading Parquet needs pyarrow (pip install 'llmtap[parquet]')") from None
    try:
        rows = pq.read_table(file).to_pylist()
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        skips.add("damaged", str(file), why=f"Parquet unreadable: {str(exc).splitlines()[0][:200]}")
        return
    for obj in rows:
        if readable(obj, skips, str(file)):
            yield _without_absent(obj)


def _without_absent(obj: dict[str, Any]) -> dict[str, Any]:
    """A Parquet row as its JSON line was: a struct field absent from some lines (``gaps.p50`` when ``n`` is 0)
    reads back as null in every row; the line had no such key."""
    gaps = obj.get("gaps")
    if isinstance(gaps, dict) and not gaps.get("n"):
        obj["gaps"] = {"n": gaps.get("n", 0)}
    objective = obj.get("objective")
    if isinstance(objective, dict):
        obj["objective"] = {k: v for k, v in objective.items() if v is not None or k == "shape"}
    return obj


@dataclass(slots=True)
class ReadStats:
    """What reading record files found: the files, the records read, and what was skipped by cause."""

    files: list[str] = field(default_factory=list)
    records: int = 0
    skips: Skips = field(default_factory=Skips)

    @property
    def truncated(self) -> int:
        """Lines cut short."""
        return self.skips.counts.get("truncated", 0)

    @property
    def foreign(self) -> int:
        """Lines that are not records."""
        return self.skips.counts.get("foreign", 0)

    @property
    def other_schema(self) -> int:
        """Records of a schema version this reader does not know."""
        return self.skips.counts.get("other_schema", 0)

    @property
    def skipped(self) -> int:
        """Lines, records and files passed over (a record read twice included)."""
        return self.skips.skipped()


def identity(record: dict[str, Any]) -> str | None:
    """What identifies a record, as one key: its ``record_id`` (made with the request, traced or not) when it has
    one, a string; else (a record of an older version) its ``trace_id`` and ``span_id``. None when that is not an
    identity: an empty or all-zero id (W3C's invalid id, what a record holds when no span was made). A ``record_id``
    string decides alone, as the engine reads it (``llmtap.store.engine_sql``)."""
    rid = record.get("record_id")
    if isinstance(rid, str):
        return rid if rid.strip("0") else None
    trace, span = record.get("trace_id"), record.get("span_id")
    if isinstance(trace, str) and isinstance(span, str) and trace.strip("0") and span.strip("0"):
        return f"{len(trace)}:{trace}{span}"
    return None


def read_records(path: str | Path, stats: ReadStats) -> Iterator[dict[str, Any]]:
    """Every record at ``path``, oldest file first (``read_file``), each identity once (the first read: a journal
    replays at least once); what was skipped counted in ``stats``. A file removed between the listing and the
    read (retention, or its compressed copy replaced it) is named and counted, as is one that cannot be read."""
    seen: set[str] = set()
    try:
        listing = find([path])
    except NoRecords:
        return
    for name, what in listing.odd.items():
        stats.skips.add("unreadable", name, why=what)
    for file in listing.files:
        stats.files.append(str(file))
        bad = inspect(file)
        if bad is not None:
            stats.skips.add(bad[0], str(file), why=bad[1])
            continue
        for record in read_file(file, stats.skips):
            key = identity(record)
            if key is not None:
                if key in seen:
                    stats.skips.add("duplicate", str(file))
                    continue
                seen.add(key)
            stats.records += 1
            yield record
