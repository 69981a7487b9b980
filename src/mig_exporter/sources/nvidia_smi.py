"""The nvidia-smi read path: run ``nvidia-smi -q -x`` and ``nvidia-smi -L``, and
``nvidia-smi pmon -c 1 -s u -i ...`` where a whole card has processes.

The full ``-q -x`` query is used rather than ``--query-compute-apps``, which
lists compute processes only: a Vulkan llama.cpp is a graphics process and
would read as on no GPU at all. ``-L`` runs beside it, in parallel, because
only it names MIG profiles and MIG UUIDs. pmon gives each process's SM and
memory activity on a whole card (the driver gives none on a card in MIG mode,
so it is not run for those); the read goes without it when it fails or hangs.
It is asked for those cards only (``-i``), at most four a run, the runs side by
side: pmon monitors a limited number of devices (4 by a third party's account,
16 by NVIDIA's current documentation), and without ``-i`` only the first ones.

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
from mig_exporter.nvidia_smi.pmon import parse_pmon, whole_card_processes, with_process_activity
from mig_exporter.sources.command import (
    DEFAULT_MAX_OUTPUT_BYTES,
    CommandResult,
    OutputBudget,
    run_commands,
)

DEFAULT_BINARY = "nvidia-smi"
DEFAULT_TIMEOUT_S = 10.0
# One sample of each process's utilisation (sm, mem, the media engines), then exit; -s u is pmon's
# default, named so that a driver with another default still prints those columns. `-i` and the
# cards follow.
PMON_ARGS = ("pmon", "-c", "1", "-s", "u")
# The most cards one pmon run is asked for. kylrth/gpublame's README: pmon "monitoring is limited
# to a maximum of 4 devices"; NVIDIA's current nvidia-smi documentation (docs.nvidia.com/deploy/
# nvidia-smi, "nvidia-smi pmon"): "one or more GPUs (up to 16 devices)". 4 fits both. pmon's `gpu`
# column is taken to be the card's own index under -i too, as without it (to be seen on a lent
# node with several cards: scripts/device-check).
PMON_MAX_CARDS = 4
# The share of the time the read has left that pmon may take: one that hangs is killed then, so
# the memory read, and the scrape's other readers after it, still answer in time.
PMON_SHARE_OF_TIME = 0.5


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
    prefix whose first element is one: the read appends ``-q -x``, ``-L`` and
    ``pmon -c 1 -s u -i CARDS``. ``max_output_bytes`` is the read's cap: what its
    commands may write to stdout, together.
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
        # The whole cards with processes the last read found: pmon runs for them beside -q -x and
        # -L, so its sampling (it waits for the driver's sample) overlaps theirs. Cards this read
        # finds that the last did not foresee are asked after them.
        self._pmon_cards: tuple[int, ...] = ()

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
        source's own timeout, whichever comes first (pmon at half the time left); ``started``
        is called once -q -x and -L are running. Concurrent scrapes share one
        (``metrics/exporter.py``): this runs the commands each time it is called."""
        deadline = Deadline.after(self.timeout_s) if deadline is None else deadline.within(self.timeout_s)
        prefix = self.resolve_command()

        # -L runs in parallel with -q -x so a read costs the slower of the two; both in this thread.
        # The cap is the read's: its commands together hold at most max_output_bytes. -L prints a
        # line per device (a few KiB on the largest node), pmon a line per process (a 64th of the
        # cap for all its runs, taken from -L's share); -q -x gets the rest.
        cap = self.max_output_bytes
        foreseen = _groups(self._pmon_cards)
        pmon_budget = OutputBudget(cap // 64, read_cap=cap)
        commands = [
            ([*prefix, "-q", "-x"], OutputBudget(cap - cap // 16, read_cap=cap)),
            # -L and pmon are killed at once if -q -x fails.
            ([*prefix, "-L"], OutputBudget(cap // 16 - (cap // 64 if foreseen else 0), read_cap=cap)),
        ]
        sooner: list[Deadline | None] = [None, None]
        if foreseen:
            # Each run may take the same share of the time left: they run side by side.
            pmon_deadline = Deadline.after(deadline.left_s() * PMON_SHARE_OF_TIME)
            for group in foreseen:
                commands.append((_pmon_argv(prefix, group), pmon_budget))
                sooner.append(pmon_deadline)
        query, listing, *answers = run_commands(commands, deadline, started=started, sooner=sooner)
        if isinstance(query, CommandError):
            raise query
        if isinstance(listing, CommandError):
            snapshot = snapshot_from_smi(query.stdout, None,
                                         f"nvidia-smi -L failed, MIG profiles and UUIDs unknown: {listing}",
                                         self._memo)
        else:
            snapshot = snapshot_from_smi(query.stdout, listing.stdout, None, self._memo)

        self._pmon_cards = tuple(whole_card_processes(snapshot))
        runs = list(zip(foreseen, answers, strict=True))
        asked = {card for group in foreseen for card in group}
        unforeseen = _groups(tuple(card for card in self._pmon_cards if card not in asked))
        if unforeseen:
            # Not foreseen: run now, in what the read has left, within what -q -x and -L left of its cap.
            spent = len(query.stdout) + (0 if isinstance(listing, CommandError) else len(listing.stdout))
            budget = OutputBudget(max(min(cap // 64, cap - spent), 0), read_cap=cap)
            # (run_commands ends the others when its first fails: rare, and only for this read.)
            try:
                late = run_commands([(_pmon_argv(prefix, group), budget) for group in unforeseen],
                                    Deadline.after(deadline.left_s() * PMON_SHARE_OF_TIME))
            except CommandError as e:  # could not be started: the binary went since -q -x
                late = [e] * len(unforeseen)
            runs.extend(zip(unforeseen, late, strict=True))
        for group, answer in runs:
            snapshot = _joined(snapshot, group, answer)
        return snapshot


def _groups(cards: Sequence[int]) -> list[tuple[int, ...]]:
    """``cards`` in runs of at most PMON_MAX_CARDS, in order."""
    return [tuple(cards[i:i + PMON_MAX_CARDS]) for i in range(0, len(cards), PMON_MAX_CARDS)]


def _pmon_argv(prefix: Sequence[str], cards: Sequence[int]) -> list[str]:
    """pmon for these cards only: ``-i`` takes a comma-separated list of indexes."""
    return [*prefix, *PMON_ARGS, "-i", ",".join(str(card) for card in cards)]


def _joined(snapshot: Snapshot, cards: Sequence[int], pmon: CommandResult | CommandError) -> Snapshot:
    """The snapshot with the rows of the pmon run for ``cards`` on those of its whole cards that
    still have processes, or with why they are unknown. A card the run printed but was not asked
    for is not taken from it."""
    if isinstance(pmon, CommandError):
        return with_process_activity(snapshot, str(pmon), cards)
    return with_process_activity(snapshot, parse_pmon(pmon.stdout), cards)
