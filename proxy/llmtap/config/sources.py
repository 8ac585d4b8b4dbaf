"""Where settings come from, in order: flags, ``LLMTAP_*`` variables, the YAML file, the table's defaults.

Reading the file and checking one value from any of them; a value that does not parse is a ``ConfigError``
naming where it came from (``--port abc``, ``LLMTAP_PORT=abc``, ``FILE: listen.port``), in one line.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmtap.config import options
from llmtap.config.options import OPTIONS, Invalid, Option
from llmtap.config.types import ConfigError

__all__ = ["Sources", "boolean", "check_url", "checked", "load_file", "parse", "quote", "unknown"]

_FILE_KEYS = options.file_keys()
_FILE_PATHS = options.file_paths()


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``; did you mean 'x'?`` for the closest of ``known``, or the list of them when none is close."""
    known = list(known)
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; known: {', '.join(sorted(known))}"


def unknown(where: str, key: Any, known: Iterable[str]) -> ConfigError:
    """The error for a key the table does not know: removed (and why), or unknown (and the closest known)."""
    if str(key) in options.REMOVED:
        return ConfigError(f"{where}{str(key)!r} was removed: {options.REMOVED[str(key)]}")
    return ConfigError(f"{where}unknown key {str(key)!r}{did_you_mean(str(key), known)}")


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file and check its keys against the table (each value is checked where it is used)."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {name!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {name!r}: not UTF-8 text") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None)
        reason = f": {problem}" if problem else ""
        raise ConfigError(f"config file {name!r}: invalid YAML{where}{reason}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {name!r}: expected a mapping at the top level")
    for key, value in data.items():
        if key not in _FILE_KEYS:
            raise unknown(f"{name}: ", key, [*_FILE_KEYS, *(p for p in _FILE_PATHS if "." in p)])
        allowed = _FILE_KEYS[key]
        if allowed is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{name}: {key!r} must be a mapping")
            for sub in value:
                if sub not in allowed:
                    raise unknown(f"{name}: ", f"{key}.{sub}", [f"{key}.{k}" for k in allowed])
    if "routes" in data and not isinstance(data["routes"], list | type(None)):
        raise ConfigError(f"{name}: 'routes' must be a list")
    return data


def quote(value: Any) -> str:
    """A value as a message quotes it: cut short, and in quotes when it is empty or has spaces."""
    text = str(value)
    if len(text) > 60:
        text = text[:59] + "…"
    return repr(text) if not text or any(c.isspace() for c in text) else text


@dataclass(frozen=True, slots=True)
class Sources:
    """Where settings come from, in order: flags (by option name; None: not given), variables, the file."""

    flags: Mapping[str, Any]
    env: Mapping[str, str]
    data: Mapping[str, Any] = field(default_factory=dict)
    #: The file's name as the user gave it, to name it in messages.
    file: str = "config file"

    def given(self, option: Option) -> tuple[Any, str, bool] | None:
        """The raw value, where it came from (``--port abc``, ``LLMTAP_PORT=abc``, ``FILE: listen.port``) and
        whether that is the file; None when not given anywhere."""
        value = self.flags.get(option.name)
        if value is not None and option.flag is not None:
            shown = (
                option.flag if option.switch is not None and value == option.switch else f"{option.flag} {quote(value)}"
            )
            return value, shown, False
        if option.env is not None and self.env.get(option.env, "") != "":
            raw = self.env[option.env]
            return raw, f"{option.env}={quote(raw)}", False
        if option.key is not None:
            section: Any = self.data
            for part in option.key.split("."):
                section = section.get(part) if isinstance(section, Mapping) else None
            if section is not None:
                return section, f"{self.file}: {option.key}", True
        return None

    def get(self, name: str) -> Any:
        """The option's value from the first source that gives it, checked; else its default."""
        option = OPTIONS[name]
        found = self.given(option)
        if found is None:
            return option.default
        return parse(option, *found)


def parse(option: Option, raw: Any, label: str, in_file: bool) -> Any:
    """``option``'s value from ``raw``, or ``ConfigError`` naming ``label``: what was expected (and, in a file, got)."""
    try:
        return option.parse(raw)
    except Invalid as exc:
        problem = str(exc)
        got = f", got {raw!r}" if in_file and problem.startswith("expected") else ""
        raise ConfigError(f"{label}: {problem}{got}") from None


def checked(kind: options.Kind, value: Any, what: str) -> Any:
    """``value`` parsed as ``kind``, else ``ConfigError`` naming ``what`` and the value."""
    try:
        return kind.parse(value)
    except Invalid as exc:
        raise ConfigError(f"{what}: {exc}, got {value!r}") from None


def boolean(value: Any, what: str) -> bool:
    """``value`` as true or false, else ``ConfigError`` naming ``what``."""
    try:
        return bool(options.boolean().parse(value))
    except Invalid:
        raise ConfigError(f"{what}: expected true or false, got {value!r}") from None


def check_url(url: Any, what: str) -> str:
    """A normalized upstream base URL (http or https, a host, no query), else ``ConfigError`` naming ``what``."""
    try:
        return options.check_url(url)
    except Invalid as exc:
        raise ConfigError(f"{what}={quote(url)}: {exc}") from None
