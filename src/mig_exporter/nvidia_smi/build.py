"""The snapshot from nvidia-smi's two outputs: the ``-q -x`` report, joined with
``-L`` where it was read, then placed. Pure: bytes in, a snapshot out. A
``ReadMemo`` lets one source's reads skip what did not change since the last
(the same bytes read the same): the report's process lists, MIG devices and
clock tables, the whole ``-L`` listing, which changes only when MIG is
reconfigured, and the placement of each card whose instances and processes
read the same."""

from __future__ import annotations

from mig_exporter.core.errors import ReadError
from mig_exporter.model.placement import PlacementMemo, place
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.nvidia_smi.listing import Listing, apply_listing, parse_list
from mig_exporter.nvidia_smi.query_xml import SectionMemo, parse_query_xml


class ReadMemo:
    """What the last read made of the parts of its outputs that rarely change."""

    __slots__ = ("listing", "placement", "sections")

    def __init__(self) -> None:
        self.sections = SectionMemo()
        self.listing: tuple[bytes, Listing] | None = None
        self.placement = PlacementMemo()

    def parse_list(self, data: bytes) -> Listing:
        last = self.listing
        if last is not None and last[0] == data:
            return last[1]
        parsed = parse_list(data)  # one that raises is not kept: it is read again, as it should say again
        self.listing = (data, parsed)
        return parsed


def snapshot_from_smi(query_xml: bytes, listing: str | bytes | None, listing_error: str | None = None,
                      memo: ReadMemo | None = None) -> Snapshot:
    """Build the snapshot from the two outputs. Pure; raises ``ParseError``
    only for the ``-q -x`` report: without ``-L`` the read still stands, with
    MIG profiles and UUIDs unknown and a problem line saying why. ``memo``: the
    last read's, updated with this one."""
    report = parse_query_xml(query_xml, None if memo is None else memo.sections)
    problems = list(report.problems)
    cards = report.cards
    if listing is not None:
        try:
            parsed = (memo.parse_list(listing) if memo is not None and isinstance(listing, bytes)
                      else parse_list(listing))
            cards, join_problems = apply_listing(cards, parsed.gpus)
            problems.extend(parsed.skipped)
            problems.extend(join_problems)
        except ReadError as e:
            problems.append(str(e))
    elif listing_error is not None:
        problems.append(listing_error)
    return place(cards, driver_version=report.driver_version, cuda_version=report.cuda_version, problems=problems,
                 memo=None if memo is None else memo.placement)
