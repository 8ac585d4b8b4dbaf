"""What a reader could not read, or read twice: counted by cause and named by file.

Records are the product's data, so a reader never stops at a damaged file and never drops a line in silence.
Whatever it passes over it counts here under one of ``CAUSES``, with the files it was found in; ``compare`` and
``slo`` print one line per cause on standard error (``lines``) and answer from the rest. The same input gives
the same ``Skips`` whichever source read it (plain Python, the embedded engine), so the tests can hold the two
to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CAUSES", "FILE_CAUSES", "MAX_LINE", "Skips"]

#: Lines longer than this (bytes, its newline left out) are not records: the longest llmtap writes is a few KB.
MAX_LINE = 1024 * 1024

#: Every cause: what it counts, and what the summary says of them. Lines, records without a time and files are
#: skipped; a record with a field of the wrong type is read, that field as null (which can leave it out of a
#: figure, so it is said); a duplicate is a record counted once.
CAUSES: dict[str, tuple[str, str, str]] = {
    "truncated": ("line", "skipped {n} line cut short", "skipped {n} lines cut short"),
    "foreign": ("line", "skipped {n} line that is not a record", "skipped {n} lines that are not records"),
    "other_schema": (
        "line",
        "skipped {n} line of a record schema version this llmtap does not read",
        "skipped {n} lines of a record schema version this llmtap does not read",
    ),
    "not_utf8": ("line", "skipped {n} line that is not UTF-8", "skipped {n} lines that are not UTF-8"),
    "too_long": (
        "line",
        f"skipped {{n}} line longer than {MAX_LINE} bytes",
        f"skipped {{n}} lines longer than {MAX_LINE} bytes",
    ),
    "no_time": (
        "record",
        "skipped {n} record without a readable time (in no window)",
        "skipped {n} records without a readable time (in no window)",
    ),
    "wrong_type": (
        "record",
        "read {n} record with a field of the wrong type (that field as null)",
        "read {n} records with a field of the wrong type (each such field as null)",
    ),
    "duplicate": (
        "record",
        "counted once {n} record read more than once (the same record id)",
        "counted once {n} records read more than once (the same record id)",
    ),
    "damaged": ("file", "read {n} damaged file up to the damage", "read {n} damaged files up to the damage"),
    "wrong_schema": ("file", "skipped {n} file holding no records", "skipped {n} files holding no records"),
    "unreadable": ("file", "skipped {n} unreadable file", "skipped {n} unreadable files"),
}
#: The causes that pass over a whole file (or its rest): each file is named with what was wrong with it.
FILE_CAUSES = tuple(cause for cause, (unit, _, _) in CAUSES.items() if unit == "file")
#: Files named on a summary line at most (the rest are counted).
NAMED = 5


@dataclass(slots=True)
class Skips:
    """Counts by cause, and per cause the files (with a count, or for a whole file what was wrong with it)."""

    counts: dict[str, int] = field(default_factory=dict)
    files: dict[str, dict[str, int]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)  # a skipped file's path -> what was wrong with it

    def add(self, cause: str, file: str | None, n: int = 1, why: str | None = None) -> None:
        """``n`` more of ``cause`` (one of ``CAUSES``), found in ``file`` (None: no file to name)."""
        if cause not in CAUSES:
            raise ValueError(f"unknown skip cause {cause!r}")
        if n <= 0:
            return
        self.counts[cause] = self.counts.get(cause, 0) + n
        if file is not None:
            per = self.files.setdefault(cause, {})
            per[file] = per.get(file, 0) + n
        if why is not None and file is not None:
            self.why[file] = why

    def merge(self, other: Skips) -> None:
        """Add what ``other`` counted."""
        for cause, n in other.counts.items():
            self.counts[cause] = self.counts.get(cause, 0) + n
        for cause, per in other.files.items():
            mine = self.files.setdefault(cause, {})
            for file, n in per.items():
                mine[file] = mine.get(file, 0) + n
        self.why.update(other.why)

    def __bool__(self) -> bool:
        return any(self.counts.values())

    def skipped(self) -> int:
        """Lines, records and files passed over (duplicates included)."""
        return sum(self.counts.values())

    def lines(self) -> list[str]:
        """One line per cause, in ``CAUSES``' order: how many, what, and in which files."""
        out = []
        for cause, (unit, one, many) in CAUSES.items():
            n = self.counts.get(cause, 0)
            if not n:
                continue
            head = (one if n == 1 else many).format(n=n)
            per = self.files.get(cause, {})
            if per:
                named = [self._name(cause, f, k) for f, k in sorted(per.items())[:NAMED]]
                more = f" and {len(per) - NAMED} more" if len(per) > NAMED else ""
                where = "" if unit == "file" else f" in {len(per)} file{'s' if len(per) != 1 else ''}"
                head += f"{where}: {', '.join(named)}{more}"
            out.append(head)
        return out

    def _name(self, cause: str, file: str, n: int) -> str:
        if cause in FILE_CAUSES:
            return f"{file} ({self.why[file]})" if file in self.why else file
        return f"{file} ({n})"
