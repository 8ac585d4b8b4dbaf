"""The docs name what is there: every ``python -m`` module and repository path they write in backticks, every link.

Files move (the benchmark's probes to ``bench/probes/``, the tests into folders that mirror the source); a guide
that still names the old place sends its reader to nothing. This reads the README, the guides in ``docs/``, the
chart's README and the collectors' README, and looks each name up as a file: no module is imported, so the
benchmark is not imported into the tests.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: What a reader is sent to. The changelog and bench/RESULTS.md are left out: they say what was, under the names
#: of their day.
DOCS = (
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "helm" / "llmtap" / "README.md",
    ROOT / "collectors" / "README.md",
)

#: The repository's top-level folders a doc names paths under, from the repository's root.
TOPS = ("proxy", "tests", "bench", "docs", "helm", "collectors", "dashboards", ".ci")
#: The top-level packages ``python -m`` runs from a checkout, and where each one's files are.
PACKAGES = {"llmtap": ROOT / "proxy", "bench": ROOT, "tests": ROOT, "dashboards": ROOT, "docs": ROOT}

#: Paths in other repositories that the docs quote, with the repository.
ELSEWHERE = {"docs/gen-ai/gen-ai-spans.md": "open-telemetry/semantic-conventions"}

_BACKTICKED = re.compile(r"`([^`\n]+)`")
_RUN = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
_LINK = re.compile(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)")
_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOPS) + r")/[\w./-]*)")


def runnable(module: str) -> bool:
    """Whether ``python -m module`` finds a file: ``a/b.py``, or a package ``a/b/`` with a ``__main__.py``."""
    base = PACKAGES[module.split(".")[0]] / Path(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()


def placeholder(name: str) -> bool:
    """A name that stands for others (``bench.probes.NAME``, ``bench/probes/<name>``, ``bench/archive/*``)."""
    return (
        name.endswith(".")
        or any(part.isupper() or part == "X" for part in re.split(r"[./]", name))
        or any(c in name for c in "<>*{}")
    )


def stale(text: str, folder: Path = ROOT) -> list[str]:
    """The modules run and repository paths written in backticks in ``text``, and the files it links to (relative to
    ``folder``, the doc's), that are not in the repository."""
    missing = [link for link in _LINK.findall(text) if not (folder / link).exists()]
    for span in _BACKTICKED.findall(text):
        for module in _RUN.findall(span):
            if module.split(".")[0] in PACKAGES and not placeholder(module) and not runnable(module):
                missing.append(f"python -m {module}")
        for path in _PATH.findall(span):
            path = path.rstrip(".")
            if not placeholder(path) and path not in ELSEWHERE and not (ROOT / path).exists():
                missing.append(path)
    return missing


def named(text: str) -> int:
    """How many names ``stale`` looked up in ``text``: zero would mean it read nothing."""
    return sum(len(_RUN.findall(span)) + len(_PATH.findall(span)) for span in _BACKTICKED.findall(text))


def test_every_module_and_path_the_docs_name_is_there() -> None:
    missing = {doc.relative_to(ROOT).as_posix(): stale(doc.read_text(encoding="utf-8"), doc.parent) for doc in DOCS}
    assert {doc: names for doc, names in missing.items() if names} == {}
    # The docs do name modules and paths: a pattern that matched nothing would pass any docs.
    assert named((ROOT / "README.md").read_text(encoding="utf-8")) > 10
    assert named((ROOT / "docs" / "development.md").read_text(encoding="utf-8")) > 10


def test_every_module_the_code_says_to_run_is_there() -> None:
    # Docstrings and comments say how a figure was measured (``python -m bench.probes.journal``), often across a
    # line break; ``.ci/`` runs modules too.
    sources = [*(ROOT / "proxy").rglob("*.py"), *(ROOT / ".ci").rglob("*")]
    sources += [path for path in (ROOT / "bench").rglob("*.py") if "archive" not in path.parts]
    seen, missing = 0, []
    for path in sources:
        if path.is_file():
            text = re.sub(r"(python3? -m)\s+", r"\1 ", path.read_text(encoding="utf-8", errors="replace"))
            for module in _RUN.findall(text):
                seen += 1
                if module.split(".")[0] in PACKAGES and not placeholder(module) and not runnable(module):
                    missing.append(f"{path.relative_to(ROOT)}: python -m {module}")
    assert missing == []
    assert seen > 10


def test_a_moved_module_or_path_is_named_stale() -> None:
    text = (
        "Run `python -m bench.yield_cpu --staggered` and `python -m bench.probes.yield_cpu`; "
        "see `tests/test_wire.py`, `tests/wire/test_wire.py` and `proxy/llmtap/relay/upstream_http.py`; "
        "`python -m bench.probes.NAME` and `bench/probes/<name>.py` stand for others; `python -m llmtap` runs. "
        "[The layout](docs/development.md#layout), [the old results](bench/RESULTS-old.md)."
    )
    assert stale(text) == [
        "bench/RESULTS-old.md",
        "python -m bench.yield_cpu",
        "tests/test_wire.py",
        "proxy/llmtap/relay/upstream_http.py",
    ]
