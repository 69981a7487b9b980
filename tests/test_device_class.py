"""The device class rule, as a table."""

from __future__ import annotations

import pytest

from mig_exporter.model.device_class import card_class, mig_device_class

MIB = 1024 * 1024


@pytest.mark.parametrize(
    "product, memory_mib, expected",
    [
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-80g"),
        ("NVIDIA A100-SXM4-40GB", 40960, "a100-40g"),
        ("NVIDIA A100 80GB PCIe", 81920, "a100-80g"),
        ("NVIDIA H100 80GB HBM3", 81559, "h100-80g"),
        ("NVIDIA H100 NVL", 95830, "h100-nvl-94g"),
        ("NVIDIA H200", 143771, "h200-141g"),
        ("Tesla T4", 15360, "t4-16g"),
        ("NVIDIA A10G", 23028, "a10g-24g"),
        ("NVIDIA L40S", 46068, "l40s-48g"),
        ("NVIDIA GeForce RTX 4090", 24564, "rtx-4090-24g"),
        ("NVIDIA RTX 4000 SFF Ada Generation", 20475, "rtx-4000-sff-ada-20g"),
        ("Tesla K80", 11441, "k80-12g"),
        ("Graphics Device", 6144, "graphics-device-6g"),
        ("NVIDIA A10G", None, "a10g"),
        (None, 81920, None),
    ],
)
def test_card_class(product, memory_mib, expected):
    assert card_class(product, None if memory_mib is None else memory_mib * MIB) == expected


@pytest.mark.parametrize(
    "klass, profile, expected",
    [
        ("a100-80g", "3g.40gb", "a100-80g-mig-3g.40gb"),
        ("h200-141g", "1c.3g.71gb", "h200-141g-mig-1c.3g.71gb"),
        ("h100-80g", None, "h100-80g-mig-unknown"),
        (None, "1g.10gb", None),
    ],
)
def test_mig_device_class(klass, profile, expected):
    assert mig_device_class(klass, profile) == expected
