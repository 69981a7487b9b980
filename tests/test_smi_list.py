"""nvidia-smi -L: the listing that names MIG profiles and UUIDs, and its join onto -q -x."""

from __future__ import annotations

import pytest

from conftest import fixture_bytes
from mig_exporter.core.errors import ParseError
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from mig_exporter.nvidia_smi.listing import apply_listing, parse_list
from mig_exporter.nvidia_smi.query_xml import parse_query_xml


def test_gpu_and_mig_lines_including_compute_instance_profiles():
    text = (
        "GPU 0: NVIDIA H200 (UUID: GPU-11111111-2222-3333-4444-555555555555)\n"
        "  MIG 1c.3g.71gb  Device  0: (UUID: MIG-aaaaaaaa-2222-3333-4444-555555555555)\n"
        "  MIG 2g.35gb     Device 10: (UUID: MIG-bbbbbbbb-2222-3333-4444-555555555555)\n"
        "GPU 1: NVIDIA GeForce RTX 3060 Laptop GPU (UUID: GPU-99999999-2222-3333-4444-555555555555)\n"
    )
    gpus = parse_list(text).gpus
    assert [(g.index, g.name) for g in gpus] == [(0, "NVIDIA H200"), (1, "NVIDIA GeForce RTX 3060 Laptop GPU")]
    assert [(m.index, m.profile, m.uuid[:12]) for m in gpus[0].mig_devices] == [
        (0, "1c.3g.71gb", "MIG-aaaaaaaa"),
        (10, "2g.35gb", "MIG-bbbbbbbb"),
    ]
    assert gpus[1].mig_devices == ()


def test_pre_r470_mig_uuid_form_is_read():
    text = (
        "GPU 0: A100-SXM4-40GB (UUID: GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2)\n"
        "  MIG 3g.20gb Device 0: (UUID: MIG-GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2/1/0)\n"
    )
    (gpu,) = parse_list(text).gpus
    assert gpu.mig_devices[0].uuid == "MIG-GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2/1/0"
    assert gpu.mig_devices[0].profile == "3g.20gb"


def test_no_devices_found_is_an_empty_listing():
    assert parse_list("No devices were found\n").gpus == ()
    assert parse_list(b"").gpus == ()


@pytest.mark.parametrize(
    "text",
    [
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
        "  MIG 1g.5gb      Device  0: (UUID: MIG-x)\n",  # a MIG line before any GPU line
        "GPU zero: something\n",
    ],
)
def test_output_without_any_gpu_line_raises_parse_error(text):
    with pytest.raises(ParseError):
        parse_list(text)


def test_join_falls_back_to_the_index_when_the_listing_masks_uuids():
    report = parse_query_xml(fixture_bytes("h100-mig-processes.xml"))
    masked = (
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)\n"
        "  MIG 3g.40gb     Device  0: (UUID: MIG-00000000-0000-0000-0000-000000000000)\n"
        "  MIG 2g.20gb     Device  1: (UUID: MIG-00000001-0000-0000-0000-000000000001)\n"
        "  MIG 1g.10gb     Device  2: (UUID: MIG-00000002-0000-0000-0000-000000000002)\n"
        "  MIG 1g.10gb     Device  3: (UUID: MIG-00000003-0000-0000-0000-000000000003)\n"
    )
    cards, problems = apply_listing(report.cards, parse_list(masked).gpus)
    profiles = [i.profile for i in sorted(cards[0].instances, key=lambda i: i.mig_index)]
    assert profiles == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert problems == ()


def test_join_by_uuid_survives_a_listing_in_another_order():
    report = parse_query_xml(fixture_bytes("a100-mig-nothing-carved.xml"))
    lines = fixture_bytes("a100-mig-nothing-carved.L.txt").decode().splitlines(keepends=True)
    # Card 1 (with its MIG line) first, renumbered: UUIDs still pair them right.
    swapped = lines[1].replace("GPU 1:", "GPU 0:") + lines[2] + lines[0].replace("GPU 0:", "GPU 1:")
    cards, problems = apply_listing(report.cards, parse_list(swapped).gpus)
    assert cards[1].instances[0].profile == "7g.40gb"
    assert problems == ()


def test_instances_missing_from_the_listing_keep_their_memory_and_are_reported():
    xml = fixture_bytes("h100-mig-processes.xml")
    short = b"\n".join(fixture_bytes("h100-mig-processes.L.txt").splitlines()[:3]) + b"\n"
    s = snapshot_from_smi(xml, short)
    assert [d.profile for d in s.devices] == ["3g.40gb", "2g.20gb", None, None]
    assert s.device(1002).memory.used_bytes is not None
    assert s.device(1002).device_class == "h100-80g-mig-unknown"
    assert sorted(s.problems) == [
        "card 0: MIG device 2 not in nvidia-smi -L; profile and UUID unknown",
        "card 0: MIG device 3 not in nvidia-smi -L; profile and UUID unknown",
    ]


def test_an_error_line_among_the_gpus_is_skipped_and_reported_not_fatal():
    xml = fixture_bytes("h100-mig-processes.xml")
    lines = fixture_bytes("h100-mig-processes.L.txt").decode().splitlines(keepends=True)
    noisy = lines[0] + "Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error\n" + "".join(lines[1:])
    s = snapshot_from_smi(xml, noisy)
    assert [d.profile for d in s.devices] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert s.problems == ("nvidia-smi -L line 2 is not a GPU or MIG line: "
                          "'Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error'",)


def test_an_unreadable_listing_does_not_fail_the_read():
    s = snapshot_from_smi(fixture_bytes("h100-mig-processes.xml"), b"garbage\x00\xff")
    assert len(s.devices) == 4 and len(s.processes) == 3
    assert all(d.profile is None for d in s.devices)
    assert len(s.problems) == 1 and "nvidia-smi -L line 1" in s.problems[0]
