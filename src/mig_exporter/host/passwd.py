"""User names from the host's passwd file (``--host.passwd``), for the
``user`` label of GPU processes (docs/hpc.md).

``parse_passwd`` is pure: the file's bytes in, uid → name out. ``PasswdFile``
reads the file again only when it changed, so a host with tens of thousands
of users costs a ``stat`` per scrape.
"""

from __future__ import annotations

import os
import re
import stat
import threading

from mig_exporter.host.procfs import read_fd

# An HPC site's passwd with 100,000 users is under 10 MiB; never buffer more than this.
MAX_PASSWD_BYTES = 16 << 20
_READ_CHUNK = 1 << 20
_UID = re.compile(r"[0-9]{1,10}")


def parse_passwd(data: bytes) -> dict[int, str]:
    """uid → name from ``name:password:uid:gid:gecos:home:shell`` lines. A
    malformed line (too few fields, a non-numeric uid, an empty name, NIS's
    ``+``/``-`` entries, a comment) is ignored. Where two names share a uid the
    first wins, as it does for ``getpwuid``."""
    names: dict[int, str] = {}
    for line in data.decode("utf-8", errors="replace").splitlines():
        fields = line.split(":")
        # ASCII digits only: str.isdigit() takes superscript and Arabic-Indic digits too.
        if len(fields) != 7 or not _UID.fullmatch(fields[2]):
            continue
        name = fields[0]
        if not name or name[0] in "+-#" or name != name.strip():
            continue
        names.setdefault(int(fields[2]), name)
    return names


class PasswdFile:
    """One passwd file, read when its size, time or inode changed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._key: tuple[int, int, int] | None = None
        self._names: dict[int, str] = {}

    def names(self) -> tuple[dict[int, str], str | None]:
        """uid → name, and a problem line when the file cannot be read (then
        no names: each user is its uid) or is cut at MAX_PASSWD_BYTES."""
        try:
            # Non-blocking: a FIFO put where the file should be must not hang the scrape.
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            return {}, f"cannot read the passwd file {self.path}: {e.strerror or e}; users are shown as uids"
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return {}, f"the passwd file {self.path} is not a regular file; users are shown as uids"
            key = (info.st_ino, info.st_size, info.st_mtime_ns)
            with self._lock:
                if key == self._key:
                    return self._names, _cut(self.path, info.st_size)
            data = read_fd(fd, MAX_PASSWD_BYTES, _READ_CHUNK)
        except OSError as e:
            return {}, f"cannot read the passwd file {self.path}: {e.strerror or e}; users are shown as uids"
        finally:
            os.close(fd)
        if len(data) >= MAX_PASSWD_BYTES:
            data = data[: data.rfind(b"\n") + 1]  # a cut line would give a wrong name
        names = parse_passwd(data)
        with self._lock:
            self._key, self._names = key, names
        return names, _cut(self.path, info.st_size)


def _cut(path: str, size: int) -> str | None:
    if size <= MAX_PASSWD_BYTES:
        return None
    return f"the passwd file {path} is larger than {MAX_PASSWD_BYTES >> 20} MiB: names from its start only"
