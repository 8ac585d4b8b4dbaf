"""``bench.probes.compiled``: what it leaves interpreted, and why, without running mypyc."""

from __future__ import annotations

from pathlib import Path

from bench.probes.compiled import module_of, refusals, source, subclassed


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_refusal_names_the_module_and_mypycs_words() -> None:
    output = (
        "llmtap/telemetry/intake/inbox.py:44: error: Inheriting from most builtin types is unimplemented\n"
        "llmtap/relay/frame.py:65: error: async generators are unimplemented\n"
        "llmtap/other.py:1: error: not asked for\n"
    )
    got = refusals(output, ["llmtap.telemetry.intake.inbox", "llmtap.relay.frame", "llmtap.relay.pipe"])
    assert got == {
        "llmtap.telemetry.intake.inbox": "line 44: Inheriting from most builtin types is unimplemented",
        "llmtap.relay.frame": "line 65: async generators are unimplemented",
    }


def test_a_package_is_its_init(tmp_path: Path) -> None:
    proxy = _tree(tmp_path / "proxy", {"pkg/__init__.py": "", "pkg/mod.py": ""})
    assert source(proxy, "pkg") == proxy / "pkg" / "__init__.py"
    assert source(proxy, "pkg.mod") == proxy / "pkg" / "mod.py"
    assert module_of("pkg/__init__.py") == "pkg"
    assert module_of("pkg/mod.py") == "pkg.mod"


def test_a_class_interpreted_code_subclasses_keeps_its_module_interpreted(tmp_path: Path) -> None:
    proxy = _tree(
        tmp_path / "proxy",
        {
            "pkg/__init__.py": "",
            "pkg/base.py": "class Base:\n    pass\n\nclass Alone:\n    pass\n",
            "pkg/both.py": "from pkg.base import Alone\n\nclass Inside(Alone):\n    pass\n",
            "pkg/user.py": "from pkg import base\n\nclass Mine(base.Base):\n    pass\n",
        },
    )
    (tmp_path / "tests").mkdir()
    got = subclassed(tmp_path, proxy, ["pkg.base", "pkg.both"])
    assert got == {"pkg.base": "class Base is subclassed by interpreted pkg.user"}
    assert subclassed(tmp_path, proxy, ["pkg.base", "pkg.both", "pkg.user"]) == {}
