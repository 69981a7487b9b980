"""The nvidia-smi read path: run ``nvidia-smi -q -x`` and ``nvidia-smi -L``.

The full ``-q -x`` query is used rather than ``--query-compute-apps``, which
lists compute processes only: a Vulkan llama.cpp is a graphics process and
would read as on no GPU at all. ``-L`` runs beside it, in parallel, because
only it names MIG profiles and MIG UUIDs.

The binary may also be an argv prefix, for an nvidia-smi reached through a
wrapper: ``["chroot", "/host", "nvidia-smi"]`` runs
``chroot /host nvidia-smi -q -x`` (the probe targets of ``config.py``).
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Callable, Sequence

from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import CommandError, CommandNotFound
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.nvidia_smi.build import ReadMemo, snapshot_from_smi
from mig_exporter.sources.command import DEFAULT_MAX_OUTPUT_BYTES, OutputBudget, run_commands

DEFAULT_BINARY = "nvidia-smi"
DEFAULT_TIMEOUT_S = 10.0


def _why_not_executable(path: str) -> str:
    """Why ``path`` cannot be run, as a user needs to hear it."""
    if os.path.isdir(path):
        return "is a directory, not an executable file"
    if os.path.exists(path):
        return "not executable (no permission to run it)"
    if os.path.lexists(path):
        return "a broken symbolic link"
    return "no such file"


class NvidiaSmiSource:
    """Reads through an nvidia-smi binary, at each call.

    ``binary`` is the binary (a path, or a name looked up on PATH), or an argv
    prefix whose first element is one: the read appends ``-q -x`` and ``-L``.
    ``max_output_bytes`` is the read's cap: what its two commands may write to
    stdout, together.
    """

    name = "nvidia-smi"

    def __init__(
        self,
        binary: str | Sequence[str] = DEFAULT_BINARY,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> None:
        self.command: tuple[str, ...] = (binary,) if isinstance(binary, str) else tuple(binary)
        if not self.command or not all(isinstance(arg, str) for arg in self.command):
            raise ValueError(f"not an argv prefix: {self.command!r}")
        self.binary = self.command[0]
        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes
        # What the last read made of the outputs' parts that rarely change (nvidia_smi/build.py).
        self._memo = ReadMemo()

    def resolve(self) -> str:
        """The binary's path (the first element of an argv prefix). Looked up
        at each read, so a driver installed after start-up is picked up
        without a restart."""
        if os.sep in self.binary:
            if os.path.isfile(self.binary) and os.access(self.binary, os.X_OK):
                return self.binary
            raise CommandNotFound(f"{self.binary}: {_why_not_executable(self.binary)}")
        found = shutil.which(self.binary)
        if found is None:
            raise CommandNotFound(f"{self.binary}: not found on PATH")
        return found

    def resolve_command(self) -> tuple[str, ...]:
        """The argv prefix with its binary resolved."""
        return (self.resolve(), *self.command[1:])

    def ready(self) -> tuple[bool, str]:
        try:
            return True, f"{self.resolve()} found"
        except CommandError as e:
            return False, str(e)

    def describe(self) -> str:
        return f"nvidia-smi ({shlex.join(self.command)}, timeout {self.timeout_s:g}s)"

    tells_start = True  # sources/base.py's read_telling_start

    def read(self, deadline: Deadline | None = None, started: Callable[[], None] | None = None) -> Snapshot:
        """One read in the calling thread, its commands killed at ``deadline`` or at the
        source's own timeout, whichever comes first; ``started`` is called once both are
        running. Concurrent scrapes share one (``metrics/exporter.py``): this runs the
        commands each time it is called."""
        deadline = Deadline.after(self.timeout_s) if deadline is None else deadline.within(self.timeout_s)
        prefix = self.resolve_command()

        # -L runs in parallel with -q -x so a read costs the slower of the two; both in this thread.
        # The cap is the read's: both commands together hold at most max_output_bytes. -L prints a
        # line per device (a few KiB on the largest node); -q -x gets the rest.
        cap = self.max_output_bytes
        query, listing = run_commands([
            ([*prefix, "-q", "-x"], OutputBudget(cap - cap // 16, read_cap=cap)),
            ([*prefix, "-L"], OutputBudget(cap // 16, read_cap=cap)),  # killed at once if -q -x fails
        ], deadline, started=started)
        if isinstance(query, CommandError):
            raise query
        if isinstance(listing, CommandError):
            return snapshot_from_smi(query.stdout, None,
                                     f"nvidia-smi -L failed, MIG profiles and UUIDs unknown: {listing}", self._memo)
        return snapshot_from_smi(query.stdout, listing.stdout, None, self._memo)
