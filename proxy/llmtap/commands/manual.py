"""``llmtap docs``: the documentation, from an installed package as from a checkout.

The wheel carries ``docs/`` as ``llmtap/_docs`` (pyproject.toml); a checkout reads the repository's ``docs/``
two folders above the package (``proxy/llmtap/``). ``llmtap docs`` lists the pages with their titles,
``llmtap docs NAME`` prints one.
"""

from __future__ import annotations

from pathlib import Path

from llmtap.config.types import ConfigError

__all__ = ["folder", "pages", "read"]

#: Page files the command shows: the guides and references, and the JSON Schemas.
SUFFIXES = (".md", ".json")


def folder() -> Path | None:
    """Where the docs are: packaged with the wheel, else the checkout's ``docs/``; None when neither is there."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_docs", package.parent.parent / "docs"):
        if candidate.is_dir() and any(candidate.glob("*.md")):
            return candidate
    return None


def pages(where: Path) -> dict[str, Path]:
    """Each page by its name without the suffix (``settings``, ``record.schema``)."""
    return {p.name.rsplit(".", 1)[0]: p for p in sorted(where.iterdir()) if p.suffix in SUFFIXES}


def title(page: Path) -> str:
    """A page's first heading (Markdown) or its schema title (JSON)."""
    with page.open(encoding="utf-8") as f:
        for line in f:
            stripped = line.strip()
            if stripped.startswith("#"):
                return stripped.lstrip("#").strip()
            if stripped.startswith('"title"'):
                return stripped.split(":", 1)[1].strip().strip('",')
    return ""


def read(name: str | None) -> str:
    """The text ``llmtap docs [NAME]`` prints: the list of pages, or the page named."""
    where = folder()
    if where is None:
        raise ConfigError("no documentation found beside this installation (the wheel carries it as llmtap/_docs)")
    found = pages(where)
    if name is None:
        width = max(len(n) for n in found)
        lines = [f"  {n:<{width}}  {title(p)}" for n, p in found.items()]
        return f"llmtap's documentation ({where}); llmtap docs NAME prints one page:\n" + "\n".join(lines) + "\n"
    key = name.removesuffix(".md").removesuffix(".json")
    page = found.get(key)
    if page is None:
        raise ConfigError(f"no page {name!r}; pages: {', '.join(found)}")
    return page.read_text(encoding="utf-8")
