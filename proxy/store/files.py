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
import re
from collections.abc import Iterable
from pathlib import Path

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
