"""Every real nvidia-smi output in ../shared/fixtures/nvidia-smi/real/ is read,
and what we read matches the facts checked by hand in real_corpus_facts.py."""

from __future__ import annotations

import pytest

from conftest import MIB, REAL_CORPUS, require_real_corpus
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from mig_exporter.nvidia_smi.listing import parse_list
from mig_exporter.nvidia_smi.query_xml import parse_query_xml
from real_corpus_facts import LIST_FACTS, NOT_PARSED, XML_FACTS


@pytest.fixture(autouse=True)
def _corpus_is_there() -> None:
    require_real_corpus()


def _corpus_files() -> list[str]:
    return sorted(p.name for p in REAL_CORPUS.iterdir() if p.name not in ("SOURCES.md", "NOTES.md"))


def test_every_file_in_the_corpus_has_checked_facts():
    known = set(XML_FACTS) | set(LIST_FACTS) | set(NOT_PARSED)
    assert set(_corpus_files()) == known


@pytest.mark.parametrize("name", sorted(XML_FACTS))
def test_real_query_xml(name):
    facts = XML_FACTS[name]
    data = (REAL_CORPUS / name).read_bytes()
    report = parse_query_xml(data)
    assert len(report.cards) == facts["cards"]
    assert report.driver_version == facts["driver_version"]
    assert report.cuda_version == facts["cuda_version"]
    assert tuple(c.name for c in report.cards) == facts["product_names"]
    assert tuple(c.uuid for c in report.cards) == facts["uuids"]
    assert tuple(c.memory.total_bytes for c in report.cards) == tuple(
        None if m is None else m * MIB for m in facts["memory_total_mib"]
    )
    assert tuple(c.memory.used_bytes for c in report.cards) == tuple(
        None if m is None else m * MIB for m in facts["memory_used_mib"]
    )
    modes = tuple(None if c.mig_current is None else (c.mig_current, c.mig_pending) for c in report.cards)
    assert modes == tuple(None if m is None else (m[0] == "Enabled", m[1] == "Enabled") for m in facts["mig_mode"])
    assert sum(len(c.instances) for c in report.cards) == facts["mig_devices"]
    pids = tuple(p.pid for c in report.cards for p in c.processes)
    assert pids == facts["pids"] and len(pids) == facts["processes"]
    with_memory = sum(p.used_bytes is not None for c in report.cards for p in c.processes)
    assert with_memory == facts["processes_with_memory"]
    assert all(c.error is None for c in report.cards)
    assert report.problems == ()

    # Placed: one device per whole card, one per instance of a MIG card, and
    # every process on a whole card lands on it.
    snapshot = snapshot_from_smi(data, None)
    whole = facts["cards"] - facts["mig_enabled_cards"]
    assert len(snapshot.devices) == whole + facts["mig_devices"]
    if facts["mig_enabled_cards"] == 0:
        assert len(snapshot.processes) == len({(c.index, p.pid) for c in report.cards for p in c.processes})
    assert all(card.card_class for card in snapshot.cards)


@pytest.mark.parametrize("name", sorted(LIST_FACTS))
def test_real_list(name):
    facts = LIST_FACTS[name]
    listing = parse_list((REAL_CORPUS / name).read_bytes())
    assert listing.skipped == ()
    gpus = listing.gpus
    assert len(gpus) == facts["gpus"]
    assert sum(len(g.mig_devices) for g in gpus) == facts["mig_devices"]
    assert tuple(g.name for g in gpus) == facts["gpu_names"]
    assert tuple(tuple(m.profile for m in g.mig_devices) for g in gpus) == facts["mig_profiles"]
    first_mig = next((m.uuid for g in gpus for m in g.mig_devices), None)
    assert first_mig == facts["first_mig_uuid"]
    assert [g.index for g in gpus] == list(range(len(gpus)))
    for g in gpus:
        assert [m.index for m in g.mig_devices] == list(range(len(g.mig_devices)))


def test_a100_mig_sample_joined_with_a_listing_of_the_same_shape():
    """The telegraf A100 MIG sample has four 1g instances (GI 3-6): read as four
    devices 1000-1003 with their own memory, never as the whole card."""
    data = (REAL_CORPUS / "telegraf-a100-sxm4-80gb-mig-v12-drv535.xml").read_bytes()
    uuid = XML_FACTS["telegraf-a100-sxm4-80gb-mig-v12-drv535.xml"]["uuids"][0]
    listing = f"GPU 0: NVIDIA A100-SXM4-80GB (UUID: {uuid})\n" + "".join(
        f"  MIG 1g.20gb     Device  {i}: (UUID: MIG-0000000{i}-0000-0000-0000-00000000000{i})\n" for i in range(4)
    )
    s = snapshot_from_smi(data, listing)
    assert [d.index for d in s.devices] == [1000, 1001, 1002, 1003]
    assert [d.gpu_instance_id for d in s.devices] == [3, 4, 5, 6]
    assert all(d.memory.total_bytes == 19968 * MIB for d in s.devices)
    assert [d.device_class for d in s.devices] == ["a100-80g-mig-1g.20gb"] * 4
    assert s.cards[0].utilization_ratio is None


def test_inline_dtd_output_is_read_without_loading_or_expanding_the_dtd():
    plain = parse_query_xml((REAL_CORPUS / "rai-grid-k520-v7-drv352.xml").read_bytes())
    inline = parse_query_xml((REAL_CORPUS / "rai-grid-k520-v7-drv352-inline-dtd.xml").read_bytes())
    assert [c.uuid for c in inline.cards] == [c.uuid for c in plain.cards]
    assert inline.driver_version == "352.99"
