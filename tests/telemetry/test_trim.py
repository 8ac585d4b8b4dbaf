"""Giving the C allocator's free memory back while the telemetry process is idle."""

from __future__ import annotations

import ctypes

from llmtap.telemetry.trim import Trimmer, malloc_trim


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_worker_trims_at_most_once_per_interval() -> None:
    calls: list[int] = []
    clock = _Clock()

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    trimmer = Trimmer(30.0, trim=trim, clock=clock)
    trimmer.idle()
    assert calls == []  # not within the first interval either: start-up freed nothing worth a walk of the heaps
    clock.now += 30.0
    trimmer.idle()
    trimmer.idle()
    assert calls == [0] and trimmer.trims == 1
    clock.now += 29.0
    trimmer.idle()
    clock.now += 1.0
    trimmer.idle()
    assert calls == [0, 0] and trimmer.trims == 2


def test_a_trim_that_fails_is_not_tried_again() -> None:
    clock = _Clock()
    calls = 0

    def broken(pad: int) -> int:
        nonlocal calls
        calls += 1
        raise OSError("no")

    trimmer = Trimmer(1.0, trim=broken, clock=clock)
    for _ in range(3):
        clock.now += 2.0
        trimmer.idle()
    assert calls == 1 and trimmer.trims == 0


def test_glibc_trim_gives_free_memory_back() -> None:
    trim = malloc_trim()
    if trim is None:  # musl: nothing to call, and the trimmer does nothing
        assert Trimmer(0.0).trims == 0
        return
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(2048)]  # 128 MiB below glibc's mmap threshold, then freed
    for block in blocks[:-1]:
        libc.free(block)
    assert trim(0) == 1  # memory went back to the system
    libc.free(blocks[-1])
