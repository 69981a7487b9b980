"""Slurm job maps: which job each device is allocated to, read from the
directory that Slurm prolog and epilog scripts keep for dcgm-exporter's
``--hpc-job-mapping-dir`` (docs/metrics.md, "Slurm job-map directory").

One file per device, named by a card's nvidia-smi index (dcgm-exporter's only
form: a card in MIG mode stands for all of its instances) or by a ``GPU-…`` or
``MIG-…`` UUID (Princeton's jobstats names MIG instances so). It holds job ids
one per line; a line may carry more fields (jobstats writes ``jobid uid``),
and the first is the job id.

``job_map_reading`` is pure: the snapshot and the files' names and texts in
(with the names of those not read, and whether the listing was whole), a
``SlurmJobMapReading`` out. ``SlurmJobMap`` reads the directory for the
scraper, right after the GPUs, never following a link out of it and never
reading more than ``MAX_FILES`` files of ``MAX_FILE_BYTES`` each.

A read is *complete* when every file that names a device was read: a file of a
device that could not be read (no permission, too large, the scrape's budget
spent before it) or a listing cut at ``MAX_FILES`` may hide an allocation, so
its devices' allocations are unknown (model/capacity.py: no empty device is
then free). A file whose name names no device hides none; nor does one removed
between the listing and its read (an epilog's: its job has ended).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from mig_exporter.core.deadline import Deadline
from mig_exporter.core.logs import shown
from mig_exporter.host.procfs import read_fd
from mig_exporter.model.placement import card_device_indexes, uuid_device_indexes
from mig_exporter.model.readings import SlurmAllocation, SlurmJobMapReading
from mig_exporter.model.snapshot import Snapshot

MAX_FILE_BYTES = 64 * 1024  # a job id per line: far beyond any real node's jobs
MAX_FILES = 4096  # a node has at most a few hundred devices
# $SLURM_JOB_ID: digits. An array task (1234_7) or a heterogeneous component (1234+1) has a
# numeric id of its own too, and cgroups name jobs by it: any other form could match no process.
# Slurm's ids are 32-bit; past 64 digits a line is refused, not made a label value a page long.
MAX_JOB_ID = 64
_JOB_ID = re.compile(rf"[0-9]{{1,{MAX_JOB_ID}}}")
_CARD_INDEX = re.compile(r"[0-9]+")


@dataclass(frozen=True, slots=True)
class JobMapFile:
    """One file of the directory: its name and its text."""

    name: str
    text: str


class BadFile(Exception):
    """A directory entry that is not a job-map file to read (the message says why)."""


class Gone(BadFile):
    """The entry was removed after the listing (an epilog's ``rm``): no file, no allocation."""


def parse_job_ids(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The job ids of a file's text, in order and once each, and the numbers
    (from 1) of the lines that are not job ids: never their text, which a link
    to another file could make anything. Blank lines are skipped."""
    jobs: dict[str, None] = {}
    bad: list[int] = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if _JOB_ID.fullmatch(fields[0]):
            jobs[fields[0]] = None
        else:
            bad.append(number)
    return tuple(jobs), tuple(bad)


def file_devices(snapshot: Snapshot, name: str) -> tuple[int, ...]:
    """The placement indexes a file name stands for; () when it names no device read."""
    if _CARD_INDEX.fullmatch(name):
        return card_device_indexes(snapshot, int(name))
    return uuid_device_indexes(snapshot, name)


def job_map_reading(
    snapshot: Snapshot, files: Iterable[JobMapFile], problems: Iterable[str] = (), *,
    unread: Iterable[str] = (), listed_all: bool = True,
) -> SlurmJobMapReading:
    """Join the files read with the snapshot: one allocation per (device, job).
    A file that names no device, and lines that are not job ids, are problems;
    the file's good lines are kept. ``unread``: the names of the files listed and
    not read; ``listed_all``: False when the listing stopped early. The reading is
    complete unless it stopped early or a file not read names a device."""
    found: set[SlurmAllocation] = set()
    out = list(problems)
    # One problem of each kind per read, with a count and the first file: a directory of
    # 4096 stray files is one line in the log each scrape, not 4096.
    no_device: list[str] = []
    bad_lines: list[tuple[str, int, int]] = []  # (file, lines not job ids, the first)
    for f in files:
        indexes = file_devices(snapshot, f.name)
        if not indexes:
            no_device.append(f.name)
            continue
        jobs, bad = parse_job_ids(f.text)
        if bad:
            bad_lines.append((f.name, len(bad), bad[0]))
        found.update(SlurmAllocation(index, job) for index in indexes for job in jobs)
    if no_device:
        out.append(f"slurm job map: {len(no_device)} file(s) name no device read (a card's index or a GPU-/MIG- "
                   f"UUID expected), first {shown(sorted(no_device)[0])}")
    if bad_lines:
        name, count, first = min(bad_lines)
        out.append(f"slurm job map: {len(bad_lines)} file(s) with {sum(n for _, n, _ in bad_lines)} line(s) not "
                   f"starting with a numeric Slurm job id ($SLURM_JOB_ID) of at most {MAX_JOB_ID} digits, first "
                   f"{shown(name)} ({count} line(s), first line {first})")
    ordered = sorted(found, key=lambda a: (a.device_index, a.job))
    complete = listed_all and not any(file_devices(snapshot, name) for name in unread)
    return SlurmJobMapReading(tuple(ordered), True, tuple(out), complete)


class SlurmJobMap:
    """The job-map directory, read afresh at each scrape (prologs and epilogs
    rewrite it as jobs come and go)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def describe(self) -> str:
        return f"slurm job map in {self.directory}"

    def read(self, snapshot: Snapshot, deadline: Deadline | None = None) -> SlurmJobMapReading:
        """Read the directory for ``snapshot``'s devices by ``deadline`` (the
        scrape's); files not reached in time are a problem."""
        try:
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            return SlurmJobMapReading((), False, (f"slurm job map: cannot read the directory {self.directory}: "
                                                  f"{e.strerror or e}",))
        try:
            files, problems, unread, listed_all = self._read_files(dir_fd, deadline)
        except OSError as e:  # listing failed after the open (permission on read, I/O error)
            return SlurmJobMapReading((), False, (f"slurm job map: cannot list the directory {self.directory}: "
                                                  f"{e.strerror or e}",))
        finally:
            os.close(dir_fd)
        return job_map_reading(snapshot, files, problems, unread=unread, listed_all=listed_all)

    def _read_files(self, dir_fd: int,
                    deadline: Deadline | None) -> tuple[list[JobMapFile], list[str], list[str], bool]:
        """The files read, the problems, the names listed and not read, and whether the
        listing was whole."""
        problems: list[str] = []
        names: list[str] = []
        listed_all = True
        with os.scandir(dir_fd) as entries:
            for entry in entries:
                # Hidden files are the scripts' own (a file written before its rename): not a device's.
                if entry.name.startswith("."):
                    continue
                if len(names) == MAX_FILES:
                    problems.append(f"slurm job map: more than {MAX_FILES} files in {self.directory}: "
                                    "the rest are left out")
                    listed_all = False
                    break
                names.append(entry.name)
        files: list[JobMapFile] = []
        unread: list[str] = []
        ordered = sorted(names)
        for n, name in enumerate(ordered):
            if deadline is not None and deadline.expired:
                problems.append(f"slurm job map: the scrape's budget ran out after {n} of {len(names)} files "
                                f"in {self.directory}")
                unread.extend(ordered[n:])
                break
            try:
                files.append(JobMapFile(name, read_entry(dir_fd, name)))
            except Gone:
                continue
            except BadFile as e:
                problems.append(f"slurm job map file {shown(name)}: {e}")
                unread.append(name)
        return files, problems, unread, listed_all


def read_entry(dir_fd: int, name: str) -> str:
    """The text of regular file ``name`` in the directory ``dir_fd``, at most
    ``MAX_FILE_BYTES``. Links are never followed (one could point anywhere on
    the host), and only regular files are opened (a FIFO would block, a
    device could act on open). ``Gone`` when it was removed since the listing."""
    try:
        kind = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        raise Gone("removed since the listing") from None
    except OSError as e:
        raise BadFile(f"cannot stat: {e.strerror or e}") from None
    _check_kind(kind)
    try:
        # O_NOFOLLOW and O_NONBLOCK again: the entry may have been swapped since the stat.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise Gone("removed since the listing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadFile("a symbolic link, not followed") from None
        raise BadFile(f"cannot open: {e.strerror or e}") from None
    try:
        _check_kind(os.fstat(fd).st_mode)
        data = read_fd(fd, MAX_FILE_BYTES + 1)  # one byte over tells a file too large
    except OSError as e:
        raise BadFile(f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise BadFile(f"larger than {MAX_FILE_BYTES} bytes, skipped")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadFile(f"not UTF-8 text (byte {e.start})") from None


def _check_kind(mode: int) -> None:
    if stat.S_ISLNK(mode):
        raise BadFile("a symbolic link, not followed")
    if stat.S_ISDIR(mode):
        raise BadFile("a directory, not a file")
    if not stat.S_ISREG(mode):
        raise BadFile("not a regular file")
