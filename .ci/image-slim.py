"""The image's virtual environment made no larger than it needs to be; run by its build stage (Containerfile).

    python image-slim.py VENV VERSION   check the version, strip, compile, check every module still imports
    python image-slim.py --sizes        what each installed distribution costs, largest first (MB on disk)

What goes: the test suites inside packages (their `tests` folders), and the debug symbols of compiled modules
(`strip --strip-unneeded`, when binutils is there: uvloop's 13.6 MB are 1.6 MB without them). What stays:
bytecode, compiled once here, so that no process of a read-only container compiles its imports at each start.
pip and setuptools are removed by the Containerfile before this runs.
"""

from __future__ import annotations

import compileall
import importlib
import py_compile
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path


def sizes() -> list[tuple[int, str]]:
    """Bytes on disk of each installed distribution (its RECORD's files, bytecode included)."""
    out = []
    for dist in metadata.distributions():
        folder = Path(str(dist.locate_file("")))
        files = {folder / str(f) for f in dist.files or ()}
        # bytecode written after install is not in RECORD: count each listed module's __pycache__ files
        files |= {c for f in list(files) if f.suffix == ".py" for c in f.parent.glob(f"__pycache__/{f.stem}.*.pyc")}
        out.append((sum(f.stat().st_size for f in files if f.is_file()), f"{dist.metadata['Name']} {dist.version}"))
    return sorted(out, reverse=True)


def slim(site: Path) -> None:
    """Remove the test suites and the debug symbols; compile the bytecode."""
    for folder in list(site.glob("*/**/tests")):
        if folder.is_dir():
            shutil.rmtree(folder)
    strip = shutil.which("strip")
    if strip is not None:
        # Not the libraries auditwheel bundled (``*.libs``): patchelf rewrote them, and strip leaves them unloadable
        # ("ELF load command address/offset not page-aligned", numpy's OpenBLAS).
        for lib in site.rglob("*.so"):
            if lib.is_file() and not any(part.endswith(".libs") for part in lib.parts):
                subprocess.run([strip, "--strip-unneeded", str(lib)], check=True)
    # Unchecked hashes: bytecode that a copy's timestamps cannot invalidate (nothing edits the image's sources).
    mode = py_compile.PycInvalidationMode.UNCHECKED_HASH
    if not compileall.compile_dir(site, quiet=2, workers=0, invalidation_mode=mode):
        sys.exit(f"compiling {site} failed")


def check_imports(site: Path) -> None:
    """Import every compiled module (the libraries beside them load with them): a strip that broke one fails the
    build, not the first request."""
    for lib in sorted(site.rglob("*.so")):
        parts = lib.relative_to(site).parts
        if not (".cpython-" in lib.name or ".abi3." in lib.name):
            continue  # a library the modules load (pyarrow's libarrow_python.so), not a module
        importlib.import_module(".".join([*parts[:-1], parts[-1].split(".", 1)[0]]))
    importlib.import_module("llmtap.cli")


def main() -> None:
    if sys.argv[1:] == ["--sizes"]:
        for size, name in sizes():
            print(f"{size / 1e6:7.1f} MB  {name}")
        return
    venv, version = Path(sys.argv[1]), sys.argv[2]
    installed = metadata.version("llmtap")
    if version and version != installed:
        sys.exit(f"the VERSION build argument says {version}, the package installed is {installed}")
    (site,) = venv.glob("lib/python3*/site-packages")
    slim(site)
    check_imports(site)


main()
