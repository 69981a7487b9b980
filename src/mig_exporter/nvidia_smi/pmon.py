"""Parse ``nvidia-smi pmon -s u`` and join it onto a snapshot's whole cards.

Pure: no I/O. pmon prints, per card, a row for each process with a context on it, and the
activity the driver sampled of it on each engine, in percent::

    # gpu         pid   type     sm    mem    enc    dec    jpg    ofa    command
    # Idx           #    C/G      %      %      %      %      %      %    name
        0      11327     C      -      -      -      -      -      -    memhog
        0      11345     C     99     10      -      -      -      -    gpu_burn

Columns are found by the names of the ``# gpu pid ...`` header, never by position: older
drivers print eight (no ``jpg`` and ``ofa``), and ``-s m`` adds ``fb`` (newer drivers ``ccpm``
too) in the order of the ``-s`` letters. The header comes again every so many rows (44 in a
610 capture), mid-sample too, each time with its line of units. ``-`` is no value; a card with
no process prints one row of ``-``. The type is ``C``, ``G``, ``C+G`` or ``M``. The command
name is cut at 15 characters and may hold spaces (``NVIDIA Overlay.``): it is never used, a
process is matched by its pid. Real outputs, with their sources: ``tests/fixtures/nvidia-smi-pmon/``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from mig_exporter.model.snapshot import (
    PlacedProcessActivity,
    ProcessActivity,
    Snapshot,
    is_process_id,
)

NO_VALUE = "-"
# The media engines pmon prints beside sm and mem (jpg and ofa from about driver 525 on): work
# there (a transcoder on NVENC/NVDEC) may leave sm and mem at `-`, and is not idle.
MEDIA_COLUMNS = ("enc", "dec", "jpg", "ofa")


@dataclass(frozen=True, slots=True)
class Pmon:
    """``nvidia-smi pmon``: each card's processes by card index, with what pmon says of each as
    it would read on a whole card: ``-`` is no sample, so 0.0 (idle); a value that is no percent
    (``105``, ``N/A``) is unknown (``None``), and so are sm and mem at ``-`` or 0 beside a busy
    media engine (enc, dec, jpg, ofa above 0: not idle). A card pmon
    printed without a process has an empty tuple. ``partial_cards``: cards with a line that named
    the card but could not be read as a process's row, so a process not printed may have been in
    it; ``stray_lines``: lines that named no card (the same doubt for every card).
    ``problems``: what could not be read, as lines for the log; ``error`` says why nothing could
    (no header to find the columns by)."""

    cards: Mapping[int, tuple[ProcessActivity, ...]] = field(default_factory=dict)
    partial_cards: frozenset[int] = frozenset()
    stray_lines: int = 0
    problems: tuple[str, ...] = ()
    error: str | None = None

    def printed_every_process(self, card: int) -> bool:
        """Whether every line pmon printed for ``card`` was read: then a listed process it did not
        print had no sample, and was idle."""
        return card in self.cards and card not in self.partial_cards and not self.stray_lines


def parse_pmon(data: str | bytes) -> Pmon:
    """Parse ``nvidia-smi pmon -s u``. Never raises: a line that is not a row under a header
    (nvidia-smi's own warnings, garbage) is skipped and counted in one problem line, so it
    cannot cost the other rows their values; a row whose card and pid read but whose values do
    not gives that process an unknown activity (and counts in the same line). A process printed
    twice on a card (``-c`` above 1) keeps its last row, the newest sample."""
    text = bytes(data).decode("utf-8", errors="replace") if isinstance(data, bytes | bytearray) else data
    columns: dict[str, int] | None = None
    width = 0
    cards: dict[int, dict[int, ProcessActivity]] = {}
    partial: set[int] = set()
    stray = 0
    skipped: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            names = [name.lower() for name in stripped.lstrip("#").split()]
            if "gpu" in names and "pid" in names:
                columns = {}
                for position, name in enumerate(names):
                    columns.setdefault(name, position)
                width = len(names)
            continue  # the units line under it, and any other comment
        fields = stripped.split()
        whose = _read_row(fields, columns, width, cards) if columns is not None else _number(fields[0])
        if whose is True:
            continue
        skipped.append((number, stripped))
        if whose is None:
            stray += 1  # names no card: every card's unprinted processes are in doubt
        elif whose is not False:
            partial.add(whose)  # names its card, not its process
    if columns is None:
        why = "printed nothing" if not text.strip() else "printed no column header (# gpu pid ...)"
        return Pmon(error=f"nvidia-smi pmon {why}")
    if "sm" not in columns or "mem" not in columns:
        return Pmon(error="nvidia-smi pmon's header has no sm and mem columns")
    problems: tuple[str, ...] = ()
    if skipped:
        number, first = skipped[0]
        problems = (f"nvidia-smi pmon: {len(skipped)} line(s) not understood, their processes' activity "
                    f"unknown; the first, line {number}: {first[:80]!r}",)
    return Pmon({card: tuple(rows.values()) for card, rows in cards.items()}, frozenset(partial), stray, problems)


def _read_row(fields: list[str], columns: dict[str, int], width: int,
              cards: dict[int, dict[int, ProcessActivity]]) -> bool | int | None:
    """Add one row to ``cards``. ``True``: a row, read. ``False``: a process's row whose values
    could not be read, added as that process's unknown activity. Otherwise the line could not
    be read as any process's: its card, or ``None`` where it names none. The command, when it is
    the last column, may be split in several fields (a name with spaces) or none (an empty name)."""
    card = _number(fields[columns["gpu"]]) if columns["gpu"] < len(fields) else None
    if card is None:
        return None
    if columns["pid"] >= len(fields):
        return card
    if fields[columns["pid"]] == NO_VALUE:  # the row of a card with no process
        cards.setdefault(card, {})
        return True
    pid = _number(fields[columns["pid"]])
    if pid is None or not is_process_id(pid):
        return card
    command_last = columns.get("command") == width - 1
    try:
        if len(fields) < width - command_last or (not command_last and len(fields) != width):
            raise ValueError("cut short, or a column more")
        sm, memory = _ratio(fields[columns["sm"]]), _ratio(fields[columns["mem"]])
    except (KeyError, ValueError):
        # Its card and pid read, its values not (105, N/A): unknown, never idle.
        cards.setdefault(card, {})[pid] = ProcessActivity(pid, None, None)
        return False
    if not sm and not memory and any(_media_busy(fields[columns[name]]) for name in MEDIA_COLUMNS if name in columns):
        # Busy on a media engine only (a transcoder on NVENC: sm and mem at `-`): not idle, and
        # its share of SMs and memory not measured apart from that work: unknown.
        cards.setdefault(card, {})[pid] = ProcessActivity(pid, None, None)
        return True
    # A later sample of the same process replaces its row, where the first one was.
    cards.setdefault(card, {})[pid] = ProcessActivity(pid, sm, memory)
    return True


def _number(text: str) -> int | None:
    """A field of at most 10 ASCII digits (a 32-bit pid's most) as an int: ``str.isdigit`` alone
    takes ``²``, and ``int`` refuses it, as it does a string of over 4300 digits."""
    return int(text) if len(text) <= 10 and text.isascii() and text.isdigit() else None


def _ratio(value: str) -> float:
    """A percent field as a ratio: ``-`` (the driver holds no sample of it) is 0.0. Raises
    ``ValueError`` for what is no percent (0 to 100)."""
    if value == NO_VALUE:
        return 0.0
    percent = _number(value)
    if percent is None or percent > 100:
        raise ValueError(value)
    return percent / 100


def _media_busy(value: str) -> bool:
    """Whether a media engine's field says it worked: above 0, or unreadable (it may have)."""
    try:
        return _ratio(value) > 0
    except ValueError:
        return True


def whole_card_processes(snapshot: Snapshot) -> dict[int, tuple[int, ...]]:
    """The pids listed on each whole card (not in MIG mode, read), by card index: the cards
    pmon is run for. A card in MIG mode has none: the driver does not sample its processes."""
    # A whole card is one device, under the card's own index (model/placement.py).
    whole = {card.index for card in snapshot.cards if card.mig_current is not True and card.error is None}
    if not whole:
        return {}
    listed: dict[int, dict[int, None]] = {}
    for process in snapshot.processes:
        if process.device_index in whole:
            listed.setdefault(process.device_index, {})[process.pid] = None
    return {card: tuple(pids) for card, pids in sorted(listed.items())}


def with_process_activity(snapshot: Snapshot, pmon: Pmon | str, cards: Sequence[int] | None = None) -> Snapshot:
    """The snapshot with the activity of each process listed on a whole card, from pmon's rows
    (``pmon``), or with a problem line saying why it is unknown (a ``str``: the failed run).
    ``cards``: the whole cards this pmon run was asked for (``-i``); every one by default. Run
    once per group of cards, each run adds its cards' processes.

    On a whole card a listed process that pmon printed with ``-``, or not at all, was idle in
    that sample: 0.0. pmon prints ``-`` where the driver holds no sample, and the driver
    samples only processes with some activity (NVML's nvmlDeviceGetProcessUtilization: "one
    utilization sample ... per process running, that had some non-zero utilization during the
    last sample period"). A real whole H100 shows it: two idle memhogs at ``-`` beside a
    gpu_burn at 99 % (nvidia_gpu_exporter internal/captures/linux-x86_64__nvidia-h100-80gb-hbm3
    __590.48.01.txt @ c58c3331, in tests/fixtures/nvidia-smi-pmon/). Not printed is idle only
    where every line pmon printed for the card was read; a process whose row could not be read
    (a value that is no percent), or that was busy on a media engine only, is left out: unknown,
    never idle. On a card in MIG mode pmon prints ``-`` for every process, the busy too (the same
    repository's h100-mig capture): no value is taken from it. A whole card pmon printed no row
    for (it shows only the cards it was asked for) has its processes' activity unknown, and a
    problem line."""
    listed = whole_card_processes(snapshot)
    if cards is not None:
        listed = {card: pids for card, pids in listed.items() if card in cards}
    if not listed:
        return snapshot
    problems = list(snapshot.problems)
    if isinstance(pmon, str):
        problems.append(f"nvidia-smi pmon failed, process activity unknown: {pmon}")
        return replace(snapshot, problems=tuple(problems))
    if pmon.error is not None:
        problems.append(f"{pmon.error}; process activity unknown")
        return replace(snapshot, problems=tuple(problems))
    problems.extend(pmon.problems)
    placed = list(snapshot.process_activity)
    for card, pids in listed.items():
        rows = pmon.cards.get(card)
        if rows is None:
            problems.append(f"card {card}: not in nvidia-smi pmon's output; its processes' activity unknown")
            continue
        by_pid = {row.pid: row for row in rows}
        every = pmon.printed_every_process(card)
        for pid in pids:
            row = by_pid.get(pid)
            if row is None and every:
                placed.append(PlacedProcessActivity(pid, card, 0.0, 0.0))  # no sample: idle
            elif row is not None and (row.sm_ratio is not None or row.memory_ratio is not None):
                placed.append(PlacedProcessActivity(pid, card, row.sm_ratio, row.memory_ratio))
    return replace(snapshot, problems=tuple(problems), process_activity=tuple(placed))
