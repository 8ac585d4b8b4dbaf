"""Run in the image's build stage: checks the installed version and reports what each distribution costs."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path


def main() -> None:
    venv, version = Path(sys.argv[1]), sys.argv[2]
    installed = metadata.version("llmtap")
    if version and version != installed:
        sys.exit(f"the VERSION build argument says {version}, the package installed is {installed}")
    sizes = []
    for dist in metadata.distributions():
        total = sum((Path(str(dist.locate_file(f)))).stat().st_size for f in dist.files or () if Path(str(dist.locate_file(f))).is_file())
        sizes.append((total, dist.metadata["Name"], dist.version))
    for total, name, ver in sorted(sizes, reverse=True):
        print(f"{total / 1e6:8.1f} MB  {name} {ver}")


main()
