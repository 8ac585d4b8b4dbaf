"""Print a pip constraints file that pins every dependency of pyproject.toml to its declared floor.

pip resolves to the newest versions it may; the floors a project declares are only true if something
installs and tests them. ``.ci/run`` feeds this file to a second virtual environment (``pip install -c``)
and runs a fast subset of the tests there. A requirement without a ``>=`` floor is left to pip.

    python3 .ci/floors.py > floors.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")


def floors(project: dict[str, object]) -> dict[str, str]:
    """Each requirement's name and its ``>=`` version, over the dependencies and every extra."""
    requirements = list(project.get("dependencies", []))  # type: ignore[call-overload]
    for extra in dict(project.get("optional-dependencies", {})).values():  # type: ignore[call-overload]
        requirements += extra
    out: dict[str, str] = {}
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement)
        if match is None:
            raise SystemExit(f"pyproject.toml: cannot read the requirement {requirement!r}")
        name, specifiers = match.group(1).lower(), match.group(2)
        for specifier in specifiers.split(","):
            if specifier.strip().startswith(">="):
                version = specifier.strip()[2:].strip()
                if out.get(name, version) != version:
                    raise SystemExit(f"pyproject.toml: {name} has two floors, {out[name]} and {version}")
                out[name] = version
    return out


def main() -> int:
    """Write the constraints to stdout."""
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    for name, version in sorted(floors(project).items()):
        sys.stdout.write(f"{name}=={version}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
