"""Which files a record path names: paths, globs and directories, deduplicated.

A path that is a file reads as that file and its rotated siblings (``PATH.1``, ``PATH.2`` .., as
``--record PATH`` wrote them before the dataset layout). A directory is searched recursively for
record files: ``*.jsonl``, ``*.jsonl.gz``, ``*.parquet`` and rotated ``*.jsonl.N``, never a ``.part``
being written. A path that does not exist and holds ``*``, ``?`` or ``[`` is a glob (``**`` crosses
directories). Of one file stem, one copy is read: ``X.parquet`` over ``X.jsonl.gz`` over ``X.jsonl``
(a closed file is compressed to ``.gz`` and the ``.jsonl`` removed after; a reader between the two
steps sees both).
"""

from __future__ import annotations

import glob
import gzip
import json
import re
import zlib
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "SCHEMA_KEY",
    "SCHEMA_VERSIONS",
    "SKIPPED",
    "NoRecords",
    "ReadStats",
    "read_file",
    "read_records",
    "record_files",
    "record_files_at",
]

#: The key that marks a line as a request record; its value is the schema version.
SCHEMA_KEY = "llmtap_record"
#: The record schema versions this reader understands (``docs/record.schema.json`` describes the newest).
SCHEMA_VERSIONS = (1, 2)
#: Why a line was not read as a record: cut short, not a record, or a schema version this reader does not know.
SKIPPED = ("truncated", "foreign", "other_schema")
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


def record_files(paths: Iterable[str | Path]) -> list[Path]:
    """Every record file the paths name, each once; ``NoRecords`` when there is none."""
    found: list[Path] = []
    given = [str(p) for p in paths]
    for text in given:
        path = Path(text)
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and _is_record_file(p))
        elif path.exists():
            found += _rotated(path)
        elif _GLOB.search(text):
            for hit in sorted(glob.glob(text, recursive=True)):
                p = Path(hit)
                if p.is_dir():
                    found += sorted(q for q in p.rglob("*") if q.is_file() and _is_record_file(q))
                elif p.is_file():
                    found.append(p)
        else:
            found += _rotated(path)  # rotated siblings of a file being rotated right now
    unique = list(dict.fromkeys(p.resolve() for p in found))
    best: dict[Path, tuple[int, Path]] = {}
    for p in unique:
        stem = _stem(p)
        if stem is not None and (stem[0] not in best or stem[1] < best[stem[0]][0]):
            best[stem[0]] = (stem[1], p)
    out = [p for p in unique if (stem := _stem(p)) is None or best[stem[0]][1] == p]
    if not out:
        where = ", ".join(repr(t) for t in given) or "(no path)"
        raise NoRecords(f"no record file at {where}")
    return out


def record_files_at(path: str | Path) -> list[Path]:
    """The record files at one ``path`` (a record folder, or a file of an earlier version and its rotated
    siblings), oldest first; none: an empty list (``record_files`` raises ``NoRecords`` instead)."""
    try:
        return record_files([path])
    except NoRecords:
        return []


def _open(path: Path) -> IO[bytes]:
    if path.name.endswith(".gz"):
        return gzip.GzipFile(path, "rb")  # type: ignore[return-value]  # a binary file object
    return path.open("rb")


def readable(obj: Any, skipped: MutableMapping[str, int]) -> bool:
    """Whether a parsed line is a record of a known schema version; if not, counted in ``skipped``."""
    if not isinstance(obj, dict) or SCHEMA_KEY not in obj:
        skipped["foreign"] += 1
        return False
    version = obj[SCHEMA_KEY]
    if isinstance(version, bool) or not isinstance(version, int) or version not in SCHEMA_VERSIONS:
        skipped["other_schema"] += 1
        return False
    return True


def read_file(file: Path, skipped: MutableMapping[str, int]) -> Iterator[dict[str, Any]]:
    """The records of one file (JSON lines, plain or gzip; Parquet through ``pyarrow``); other lines counted in
    ``skipped`` by reason (``SKIPPED``).

    A line cut short (the proxy was killed, or is writing it now) is ``truncated``: the last line without its
    newline, or one of ours that does not parse. None of them stops the reading.
    """
    if file.name.endswith(".parquet"):
        yield from _read_parquet(file, skipped)
        return
    with _open(file) as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                own = not raw.endswith(b"\n") or raw.startswith(_OWN_PREFIX)
                skipped["truncated" if own else "foreign"] += 1
                continue
            if readable(obj, skipped):
                yield obj


def _read_parquet(file: Path, skipped: MutableMapping[str, int]) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise OSError(f"{file}: reading Parquet needs pyarrow (pip install 'llmtap[parquet]')") from None
    for obj in pq.read_table(file).to_pylist():
        if readable(obj, skipped):
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
    """What reading record files found: records read and lines skipped, by reason."""

    files: list[str] = field(default_factory=list)
    records: int = 0
    truncated: int = 0
    foreign: int = 0
    other_schema: int = 0

    @property
    def skipped(self) -> int:
        """Lines that were not read as records."""
        return self.truncated + self.foreign + self.other_schema


def read_records(path: str | Path, stats: ReadStats) -> Iterator[dict[str, Any]]:
    """Every record at ``path``, oldest file first (``read_file``); bad lines counted in ``stats``.

    A file removed between the listing and the read (retention, or its compressed copy replaced it) is passed
    over; a compressed file cut short, or unreadable, counts as one ``truncated`` line.
    """
    for file in record_files_at(path):
        stats.files.append(str(file))
        skipped = dict.fromkeys(SKIPPED, 0)
        try:
            for record in read_file(file, skipped):
                stats.records += 1
                yield record
        except FileNotFoundError:
            pass
        except (OSError, EOFError, zlib.error):
            stats.truncated += 1
        finally:
            stats.truncated += skipped["truncated"]
            stats.foreign += skipped["foreign"]
            stats.other_schema += skipped["other_schema"]
