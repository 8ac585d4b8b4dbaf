"""The relay's malloc setting (``llmtap.serve.heap``): large blocks keep getting mappings of their own.

Each case runs in a fresh interpreter, since the setting is the process's. glibc raises its mapping bound when a
mapped block is freed, so a later block of the same size comes from the heap: the control shows that happens here
without the setting, so the check with it can fail.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmtap.serve import heap

pytestmark = pytest.mark.skipif(not heap._glibc(), reason="the setting is glibc's: elsewhere nothing is set")

#: Frees one mapped 256 KiB block (what raises glibc's bound), then says whether the next one is mapped too.
PROBE = """
import ctypes, sys
from llmtap.serve.heap import fix_mmap_threshold

class Info(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Info
fixed = fix_mmap_threshold() if sys.argv[1] == "fix" else None
size = 256 * 1024  # a TLS transport's read buffer
libc.free(libc.malloc(size))
before = libc.mallinfo2().hblks
block = libc.malloc(size)
print(fixed, libc.mallinfo2().hblks - before)
libc.free(block)
"""


def _run(mode: str, **env: str) -> tuple[str, int]:
    path = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, "PYTHONPATH": path, **env},
    )
    fixed, mapped = done.stdout.split()
    return fixed, int(mapped)


def test_with_the_setting_a_block_after_a_freed_one_is_still_a_mapping() -> None:
    assert _run("fix") == ("True", 1)


def test_without_it_glibc_moves_the_bound_and_the_block_comes_from_the_heap() -> None:
    assert _run("leave") == ("None", 0)


def test_a_malloc_tunable_in_the_environment_is_left_as_the_user_set_it() -> None:
    # The user's bound (1 MiB) holds: nothing is set, and a 256 KiB block comes from the heap.
    assert _run("fix", MALLOC_MMAP_THRESHOLD_="1048576") == ("False", 0)
