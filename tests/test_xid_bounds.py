"""Bounded XID labels (docs/xids.md): codes outside NVIDIA's catalogue count under xid="other",
and distinct (card, index, xid) series are capped, the rest under xid="other" on their card,
with what was folded counted (mig_exporter_xid_series_folded_total)."""

from __future__ import annotations

from mig_exporter.metrics.exposition import render
from mig_exporter.metrics.xid_families import xid_families
from mig_exporter.model.health import OTHER_XID, XID_SERIES_CAP, XidSeen
from mig_exporter.sources.demo import DemoSource
from mig_exporter.sources.xid import XidBook


def _series(text: str, family: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(family + "{")]


def test_a_code_outside_the_catalogue_counts_under_other_on_its_card_and_index() -> None:
    snapshot = DemoSource().read()
    book = XidBook()
    events = [XidSeen(0, 0, 79, 1, 10.0), XidSeen(0, 0, 999_999, 2, 20.0), XidSeen(0, 0, 0, 3, 5.0)]
    seen = book.seen(snapshot, events=events)
    assert [(x.card, x.device_index, x.xid, x.seen, x.last_seconds) for x in seen] == [
        (0, 0, OTHER_XID, 5, 20.0), (0, 0, 79, 1, 10.0)]
    assert book.folded() == {"out_of_range": 2, "over_cap": 0}
    text = render(list(xid_families(seen, folded=book.folded())), "")[0].decode()
    assert _series(text, "mig_exporter_xid_errors_total") == [
        'mig_exporter_xid_errors_total{card="0",index="0",xid="other"} 5.0',
        'mig_exporter_xid_errors_total{card="0",index="0",xid="79"} 1.0']
    assert 'mig_exporter_xid_series_folded_total{reason="out_of_range"} 2.0' in text


def test_20000_distinct_xid_codes_add_at_most_the_cap_in_series() -> None:
    """The done-when's attack: 20 000 distinct (card, index, xid), each seen once."""
    snapshot = DemoSource().read()
    book = XidBook()
    events = [XidSeen(card, index, xid, 1, 1.0) for card in range(2) for index in range(100)
              for xid in range(1, 101)][:20_000]
    assert len(events) == 20_000
    seen = book.seen(snapshot, events=events)
    text = render(list(xid_families(seen, folded=book.folded())), "")[0].decode()
    series = _series(text, "mig_exporter_xid_errors_total")
    # The cap, and one "other" series on each card that went past it.
    assert len(series) <= XID_SERIES_CAP + 2
    assert sum(x.seen for x in seen) == 20_000  # nothing lost: the rest are in "other"
    assert book.folded() == {"out_of_range": 0, "over_cap": 20_000 - XID_SERIES_CAP}
    assert f'mig_exporter_xid_series_folded_total{{reason="over_cap"}} {20_000 - XID_SERIES_CAP}.0' in text
    assert len(_series(text, "mig_exporter_xid_last_process_info")) == len(series)


def test_20000_distinct_codes_on_one_card_are_the_catalogue_s_at_most_and_other() -> None:
    snapshot = DemoSource().read()
    book = XidBook()
    seen = book.seen(snapshot, events=[XidSeen(0, 0, xid, 1, 1.0) for xid in range(1, 20_001)])
    assert [x.xid for x in seen] == [OTHER_XID, *range(1, 173)]
    assert (seen[0].seen, book.folded()) == (20_000 - 172, {"out_of_range": 20_000 - 172, "over_cap": 0})


def test_a_series_let_in_stays_and_never_moves_into_other() -> None:
    """Which series are let in is fixed once seen: a counter never goes down for another's sake."""
    snapshot = DemoSource().read()
    book = XidBook(series_cap=2)
    first = book.seen(snapshot, events=[XidSeen(0, 0, 94, 1, 1.0), XidSeen(0, 0, 95, 1, 1.0)])
    assert [(x.xid, x.seen) for x in first] == [(94, 1), (95, 1)]
    later = book.seen(snapshot, events=[XidSeen(0, 0, 13, 4, 2.0), XidSeen(0, 0, 94, 2, 3.0),
                                        XidSeen(0, 0, 95, 1, 1.0)])
    assert [(x.card, x.device_index, x.xid, x.seen) for x in later] == [
        (0, 0, OTHER_XID, 4), (0, 0, 94, 2), (0, 0, 95, 1)]
    assert book.folded() == {"out_of_range": 0, "over_cap": 1}
