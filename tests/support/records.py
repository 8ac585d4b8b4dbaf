"""Records a running ``llmtap serve`` has written so far, read as ``llmtap`` reads them.

A test that polls a record folder meets every state the writer leaves a file in: the hour's open ``.jsonl`` with a
line half written, its compressed copy being made (``.jsonl.gz.part``), both the copy and the original for a moment,
the copy alone. ``llmtap.store.files.read_records`` reads each of these once (the open file's whole lines, a
compressed one decompressed, one identity once), so a test never reads them by hand: an hour that closes during
a test (its file compressed under the reader) is then no failure.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

from llmtap.store.files import ReadStats, read_records, record_files_at


def written(folder: Path) -> list[dict[str, Any]]:
    """Every record in ``folder`` so far, oldest file first, each once; none yet: an empty list."""
    return list(read_records(folder, ReadStats()))


def plain(folder: Path) -> bytes:
    """The bytes of every record file in ``folder`` as written before compression (a closed hour's ``.jsonl.gz``
    decompressed), oldest first: what a check for bytes that must, or must never, reach the records reads."""
    out = []
    for path in record_files_at(folder):
        raw = path.read_bytes()
        out.append(gzip.decompress(raw) if path.name.endswith(".gz") else raw)
    return b"".join(out)
