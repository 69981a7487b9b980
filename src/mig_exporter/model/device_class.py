"""Device classes: a short, stable name for what kind of device a workload gets.

A whole card's class is ``<model>-<memory>g``; a MIG instance's is
``<card class>-mig-<profile>``::

    NVIDIA A100-SXM4-80GB                  -> a100-80g
    NVIDIA H100 80GB HBM3                  -> h100-80g
    NVIDIA H200 (143771 MiB)               -> h200-141g
    3g.40gb on an NVIDIA A100-SXM4-80GB    -> a100-80g-mig-3g.40gb

The model is the product name in lower case without the vendor and brand
words (NVIDIA, GeForce, Tesla, Quadro), the form factor (SXM4, PCIe) and the
memory technology (HBM3). The memory is the size written in the name when
there is one (``80GB``); otherwise the smallest marketed capacity that holds
what the driver reports. Drivers report less than the box says (ECC and
firmware carve-outs: an H200 shows 143771 MiB = 140.4 GiB and is sold as
141 GB, a T4 shows 15360 MiB and is sold as 16 GB), so rounding alone would
name the same card two ways.
"""

from __future__ import annotations

import re

# Capacities NVIDIA has sold cards with, in GB. The list only needs the sizes
# whose reported memory falls short of them; others round to themselves.
MARKETED_CAPACITIES_GB = (
    1, 2, 3, 4, 5, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96,
    120, 128, 141, 144, 180, 186, 192, 256, 279, 288,
)

_DROPPED_WORDS = frozenset({
    "nvidia", "geforce", "tesla", "quadro", "gpu",
    "sxm", "sxm2", "sxm3", "sxm4", "sxm5", "sxm6", "pcie", "pci", "hgx",
    "hbm", "hbm2", "hbm2e", "hbm3", "hbm3e", "gddr6", "gddr6x", "gddr7",
    "generation", "workstation", "edition",
})
_SIZE_IN_NAME = re.compile(r"^(\d+)gb$")
_TOKEN_SPLIT = re.compile(r"[\s\-_/()]+")
_MIB_PER_GIB = 1024
_TOLERANCE_GIB = 0.05  # a size reported a hair over a capacity still counts as it


def card_class(product_name: str | None, memory_total_bytes: int | None) -> str | None:
    """The class of a whole card, or ``None`` when the product name is unknown."""
    if not product_name:
        return None
    tokens = [t for t in _TOKEN_SPLIT.split(product_name.lower()) if t]
    size_gb: int | None = None
    model: list[str] = []
    for token in tokens:
        m = _SIZE_IN_NAME.match(token)
        if m:
            size_gb = int(m.group(1))
        elif token not in _DROPPED_WORDS:
            model.append(token)
    if not model:
        model = tokens or ["gpu"]
    if size_gb is None and memory_total_bytes:
        size_gb = marketed_capacity_gb(memory_total_bytes)
    name = "-".join(model)
    return f"{name}-{size_gb}g" if size_gb else name


def marketed_capacity_gb(memory_total_bytes: int) -> int:
    """The smallest marketed capacity (GB) that holds the reported memory."""
    gib = memory_total_bytes / (_MIB_PER_GIB * 1024 * 1024)
    for capacity in MARKETED_CAPACITIES_GB:
        if gib <= capacity + _TOLERANCE_GIB:
            return capacity
    return round(gib)


def mig_device_class(card_class_name: str | None, profile: str | None) -> str | None:
    """The class of a MIG instance: the card's class, ``-mig-`` and the profile."""
    if not card_class_name:
        return None
    return f"{card_class_name}-mig-{profile or 'unknown'}"
