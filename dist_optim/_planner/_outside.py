"""What this process holds outside torch's allocator, read from the C allocator and the kernel (Linux with glibc):
the meter behind the plan's ``outside torch's allocator`` line.

Kernels keep memory after they return that no tensor owns: oneDNN's JIT-compiled kernels and its primitive cache (one
entry per distinct shape), MKL's buffers. Some of it is ``malloc``'d (glibc's bytes in use grow), some mapped
directly (the process's anonymous resident memory grows beyond what glibc holds). ``outside_bytes`` reads both:
anonymous resident bytes, less what glibc holds (its arenas and mapped chunks, in use or free), plus what glibc has
in use. Read before and after a kernel runs, with every tensor it made freed again, the difference is what the kernel
kept.

Memory glibc holds *free* (``free_held_bytes``) is another thing: after large blocks are freed, glibc raises its
threshold for returning them to the system and keeps them in its arenas (94 MiB measured on a small bf16 Mixtral after
a few steps, against 6 MiB with ``MALLOC_MMAP_THRESHOLD_=131072`` set in the environment). It is no kernel's and
depends on the order of allocations: not planned, said in the plan and in docs/planning.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

__all__: list[str] = []


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _mallinfo2() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2  # glibc 2.33 and later; musl and older glibc have no such reading
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    return fn


def _anonymous_resident() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("no RssAnon in /proc/self/status")


def available() -> bool:
    """Whether this process can read the meter (Linux, glibc with ``mallinfo2``)."""
    return _mallinfo2() is not None


def outside_bytes() -> int:
    """Bytes of this process that are neither torch's allocator's free-able blocks nor glibc's free ones: anonymous
    resident memory less what glibc holds, plus what glibc has in use (torch's CPU tensors included: read it where
    they are the same before and after). Only where :func:`available`."""
    fn = _mallinfo2()
    assert fn is not None
    m = fn()
    return _anonymous_resident() - (m.arena + m.hblkhd) + (m.uordblks + m.hblkhd)


def free_held_bytes() -> int:
    """Bytes glibc holds free in its arenas (not returned to the system)."""
    fn = _mallinfo2()
    assert fn is not None
    m = fn()
    return m.arena - m.uordblks
