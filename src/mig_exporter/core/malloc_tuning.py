"""glibc's malloc, set for a threaded server: one arena.

glibc gives each new thread a heap (an arena) of its own, up to eight per
core. Each connection is served by its own thread, so over a long run the
largest scrape of a big node (its XML, lxml's tree, the families, the encoded
answer: a few MB) comes to sit, freed but kept, in each of those heaps: RSS
grew about 11% over 10 000 scrapes before it levelled off
(docs/reliability.md). The interpreter lets one thread run at a time, so
threads gain next to nothing from heaps of their own; with one, RSS stays
within 3% over 20 000 scrapes at no measured cost per scrape.

Set with ``mallopt`` before the server starts its threads. Not glibc (musl,
in an Alpine image): nothing is changed. A limit the user set with
``MALLOC_ARENA_MAX`` or ``GLIBC_TUNABLES=glibc.malloc.arena_max=N`` is left as it is.

glibc gives memory back to the system only from the top of its heap. Connections that
come and go in a crowd (600 slow TLS handshakes, each with OpenSSL's buffers) leave
their freed memory spread through it, kept: RSS stayed 25 MiB up once they were gone.
``release_free_memory`` (``malloc_trim``) gives back the free pages wherever they are;
the connection loop calls it when a crowd of connections has gone.
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # from glibc's malloc.h


def _glibc() -> ctypes.CDLL | None:
    """The C library this process runs on, if it is glibc. The process's own
    symbols, not ``find_library``, which needs ldconfig's cache to find it."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    # gnu_get_libc_version is glibc's own: musl has a mallopt that does nothing.
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def limit_arenas(arenas: int = 1) -> str:
    """Limit glibc to ``arenas`` heaps; what was done, for the log."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return f"malloc: arenas left as MALLOC_ARENA_MAX={os.environ['MALLOC_ARENA_MAX']} sets them"
    if "glibc.malloc.arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return "malloc: arenas left as GLIBC_TUNABLES sets them"
    libc = _glibc()
    if libc is None:
        return "malloc: not glibc, left as it is"
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    if libc.mallopt(M_ARENA_MAX, arenas) != 1:
        return "malloc: glibc refused to limit its arenas; left as it is"
    return f"malloc: at most {arenas} arena{'s' if arenas != 1 else ''}"


def release_free_memory() -> bool:
    """Give glibc's free pages back to the system (``malloc_trim(0)``); whether any were.
    Not glibc: nothing to do, False."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return bool(libc.malloc_trim(0))
