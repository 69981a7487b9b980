"""The snapshot from nvidia-smi's two outputs: the ``-q -x`` report, joined with
``-L`` where it was read, then placed. Pure: bytes in, a snapshot out."""

from __future__ import annotations

from mig_exporter.core.errors import ReadError
from mig_exporter.model.placement import place
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.nvidia_smi.listing import apply_listing, parse_list
from mig_exporter.nvidia_smi.query_xml import parse_query_xml


def snapshot_from_smi(query_xml: bytes, listing: str | bytes | None, listing_error: str | None = None) -> Snapshot:
    """Build the snapshot from the two outputs. Pure; raises ``ParseError``
    only for the ``-q -x`` report: without ``-L`` the read still stands, with
    MIG profiles and UUIDs unknown and a problem line saying why."""
    report = parse_query_xml(query_xml)
    problems = list(report.problems)
    cards = report.cards
    if listing is not None:
        try:
            parsed = parse_list(listing)
            cards, join_problems = apply_listing(cards, parsed.gpus)
            problems.extend(parsed.skipped)
            problems.extend(join_problems)
        except ReadError as e:
            problems.append(str(e))
    elif listing_error is not None:
        problems.append(listing_error)
    return place(cards, driver_version=report.driver_version, cuda_version=report.cuda_version, problems=problems)
