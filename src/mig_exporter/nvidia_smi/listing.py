"""Parse ``nvidia-smi -L`` and join it onto the ``-q -x`` report.

Pure: no I/O. ``-L`` is the only nvidia-smi output that names a MIG
instance's profile (``3g.40gb``, ``1c.3g.71gb``) and gives its ``MIG-`` UUID;
``-q -x`` gives its memory, ids and processes. The two are joined by card and
MIG device index::

    GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5c0d...)
      MIG 3g.40gb     Device  0: (UUID: MIG-0a3f...)

Drivers before R470 wrote the MIG UUID as ``MIG-GPU-<card uuid>/<gi>/<ci>``;
it is read the same way.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from mig_exporter.core.errors import ParseError
from mig_exporter.model.snapshot import CardReading, MigInstance

_GPU_LINE = re.compile(r"^GPU\s+(\d+):\s*(.*?)\s*\(UUID:\s*([^)\s]+)\s*\)\s*$")
_MIG_LINE = re.compile(r"^\s+MIG\s+(\S+)\s+Device\s+(\d+):\s*\(UUID:\s*([^)\s]+)\s*\)\s*$")
# Lines nvidia-smi prints instead of a listing when it finds nothing.
_NOTHING_FOUND = re.compile(r"^(No devices were found|No devices found)\.?$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ListedMig:
    index: int
    profile: str
    uuid: str


@dataclass(frozen=True, slots=True)
class ListedGpu:
    index: int
    name: str
    uuid: str
    mig_devices: tuple[ListedMig, ...] = ()


@dataclass(frozen=True, slots=True)
class Listing:
    """``nvidia-smi -L``: the GPUs it lists, and the lines it could not place."""

    gpus: tuple[ListedGpu, ...]
    skipped: tuple[str, ...] = ()


def parse_list(text: str | bytes) -> Listing:
    """Parse ``nvidia-smi -L``.

    A line that is neither a GPU nor a MIG line (nvidia-smi interleaves its
    errors, "Unable to determine the device handle for GPU ...") is skipped
    and reported, so it cannot cost the other cards their profiles. Output
    without a single GPU line but with other text raises ``ParseError``.
    """
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8", errors="replace")
    # Each GPU line with the MIG lines under it; made into ListedGpu once all are read.
    gpus: list[tuple[re.Match[str], list[ListedMig]]] = []
    skipped: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        # Most lines are MIG lines; no MIG line is blank, a GPU line or "No devices found".
        mig = _MIG_LINE.match(line)
        if mig and gpus:
            profile, mig_index, uuid = mig.groups()
            gpus[-1][1].append(ListedMig(int(mig_index), profile, uuid))
            continue
        if not line.strip() or _NOTHING_FOUND.match(line.strip()):
            continue
        gpu = _GPU_LINE.match(line)
        if gpu:
            gpus.append((gpu, []))
            continue
        skipped.append(f"nvidia-smi -L line {number} is not a GPU or MIG line: {line.strip()[:80]!r}")
    if skipped and not gpus:
        raise ParseError(skipped[0])
    listed = tuple(ListedGpu(int(g.group(1)), g.group(2), g.group(3), tuple(migs)) for g, migs in gpus)
    return Listing(listed, tuple(skipped))


def apply_listing(
    cards: Sequence[CardReading], listing: Sequence[ListedGpu]
) -> tuple[tuple[CardReading, ...], tuple[str, ...]]:
    """Give each MIG instance its profile and UUID from ``-L``.

    A card is matched by UUID, or by index when either side has none; an
    instance by its MIG device index. What cannot be matched is left ``None``
    and reported as a problem line.
    """
    by_uuid = {g.uuid: g for g in listing}
    by_index = {g.index: g for g in listing}
    out: list[CardReading] = []
    problems: list[str] = []
    xml_uuids = {c.uuid for c in cards if c.uuid}
    for card in cards:
        listed = by_uuid.get(card.uuid) if card.uuid else None
        if listed is None:
            # By index, unless that -L line is another card's (masked or
            # missing UUIDs are why the fallback exists).
            candidate = by_index.get(card.index)
            if candidate is not None and candidate.uuid not in xml_uuids:
                listed = candidate
        if not card.instances:
            out.append(card)
            continue
        if listed is None:
            problems.append(f"card {card.index}: not in nvidia-smi -L; MIG profiles and UUIDs unknown")
            out.append(card)
            continue
        migs = {m.index: m for m in listed.mig_devices}
        instances = []
        for inst in card.instances:
            m = migs.get(inst.mig_index)
            if m is None:
                problems.append(f"card {card.index}: MIG device {inst.mig_index} not in nvidia-smi -L; "
                                "profile and UUID unknown")
                instances.append(inst)
            else:
                instances.append(MigInstance(inst.mig_index, inst.gpu_instance_id, inst.compute_instance_id,
                                             inst.memory, m.profile, m.uuid, inst.ecc_errors))
        out.append(dataclasses.replace(card, instances=tuple(instances)))
    return tuple(out), tuple(problems)
