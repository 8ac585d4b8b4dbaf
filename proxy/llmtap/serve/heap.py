"""The relay process's malloc setting (glibc): large blocks always get mappings of their own.

glibc serves a request of 128 KiB or more with a mapping of its own, until such a block is freed: it then raises
that bound to the freed block's size, and later blocks of that size come from the heap. The event loop's TLS
transport (uvloop's, asyncio's) keeps a 256 KiB read buffer per connection, of which a read touches only its first
pages; once the bound rose, every new upstream TLS connection's buffer is carved from the heap among other objects,
and pages a freed neighbour touched stay resident under it. With the bound fixed at glibc's own starting value
(``M_MMAP_THRESHOLD``, which also stops it moving), each such buffer stays a mapping: only the pages its reads
touched are resident, and they go back to the system when the connection closes.

The relay's upstream connections read into one shared buffer (``llmtap.relay.upstream.connection.ReadBuffer``),
so no per-read block of that size is made and unmade. A ``MALLOC_*_`` tunable in the environment is the user's
choice: then nothing is set here.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MMAP_THRESHOLD", "fix_mmap_threshold"]

#: Bytes from which a block gets a mapping of its own: glibc's starting value, fixed.
MMAP_THRESHOLD = 128 * 1024
#: ``mallopt``'s parameter number for it (glibc's ``malloc.h``).
_M_MMAP_THRESHOLD = -3
#: glibc's environment tunables that fix the bound (or stop it moving) themselves.
_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


def fix_mmap_threshold() -> bool:
    """Fix glibc's mapping bound at ``MMAP_THRESHOLD`` for this process; False where nothing was set (not glibc,
    or a ``MALLOC_*_`` tunable in the environment)."""
    if any(name in os.environ for name in _TUNABLES) or not _glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
