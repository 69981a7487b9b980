"""NVML's field ids and enum values, per header: what the driver in use means by each number.

NVML's numbers are the header's, and the header changed under the same names. The clock-event
counters ``NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN``, ``_HW_THERM_SLOWDOWN`` and
``_HW_POWER_BRAKE_SLOWDOWN`` are absent from 570's header (where 251-268 are power smoothing),
251-253 in 575's and in 580's first release (580.65, CUDA 13.0), and 269-271 from 580.82 on (CUDA
13.0 Update 1, "v580 TRD2"), 251 back to ``NVML_FI_PWR_SMOOTHING_ENABLED``: NVML's own known issues
(docs.nvidia.com/deploy/nvml-api/known-issues.html: "NVML Field Values from #251 - #273 ... have
changed between 13.0 and 13.0U1/v580TRD2"), and the pynvml.py of nvidia-ml-py 13.580.65 (251) and
13.580.82 (269). A table is therefore chosen by branch and release, not by branch alone.
The recovery-action enum ``nvmlDeviceGpuRecoveryAction_t`` has 0-4 up to 595's header, 5
``RECOVER_IMEX_DOMAIN`` from 610's and 6 ``BUS_RESET``, 7 ``SYSTEM_REBOOT`` from 615's; one
nvidia-ml-py release (13.580.65) calls 5 ``GPU_RESET_BUS``. So the numbers the exporter asks and
reads come from the table of the driver in use (``nvmlSystemGetNVMLVersion``), never from the
installed pynvml, whose constants are those of its own release.

Sources: NVIDIA's nvml.h as NVIDIA/go-nvml keeps it (``gen/nvml/nvml.h``; its history follows the
driver releases: github.com/NVIDIA/go-nvml/commits/main/gen/nvml/nvml.h, stored here at
314e96d0e80c8d21d5e52fd1a697ec2e46e11605, a CUDA 13 header with the counters at 269-271), checked
number by number against the pynvml.py of the nvidia-ml-py release of each branch, which mirrors
that release's nvml.h: 12.535.161, 12.550.89, 12.555.43, 12.560.30, 12.570.86, 12.575.51,
13.580.65, 13.590.48, 13.595.45, 13.610.43, 13.615.71. Each ``Header`` names the release it was
checked with.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Ids that have kept their number in every header this exporter knows (535 to 615).
_STABLE: dict[str, int] = {
    "NVML_FI_DEV_ECC_CURRENT": 1,
    "NVML_FI_DEV_ECC_PENDING": 2,
    # Device memory (the DRAM location: NVML_MEMORY_LOCATION_DRAM == _DEVICE_MEMORY), by scope.
    "NVML_FI_DEV_ECC_SBE_VOL_DEV": 11,
    "NVML_FI_DEV_ECC_DBE_VOL_DEV": 12,
    "NVML_FI_DEV_ECC_SBE_AGG_DEV": 22,
    "NVML_FI_DEV_ECC_DBE_AGG_DEV": 23,
    "NVML_FI_DEV_RETIRED_SBE": 29,
    "NVML_FI_DEV_RETIRED_DBE": 30,
    "NVML_FI_DEV_RETIRED_PENDING": 31,
    # 575's header names these two NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP and _SYNC_BOOST
    # (defined as these): the same counters, in ns, under their older names.
    "NVML_FI_DEV_PERF_POLICY_POWER": 74,
    "NVML_FI_DEV_PERF_POLICY_SYNC_BOOST": 76,
    "NVML_FI_DEV_MEMORY_TEMP": 82,
    "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 83,
    "NVML_FI_DEV_PCIE_REPLAY_COUNTER": 94,
    "NVML_FI_DEV_REMAPPED_COR": 142,
    "NVML_FI_DEV_REMAPPED_UNC": 143,
    "NVML_FI_DEV_REMAPPED_PENDING": 144,
    "NVML_FI_DEV_REMAPPED_FAILURE": 145,
    # In milliwatts (nvml.h's comments); CURRENT is the enforced limit.
    "NVML_FI_DEV_POWER_CURRENT_LIMIT": 190,
    "NVML_FI_DEV_POWER_REQUESTED_LIMIT": 192,
}
# 550.89's header adds the reset flags nvidia-smi shows as gpu_reset_status (550.52's lacks them).
_RESET_FLAGS = {"NVML_FI_DEV_RESET_STATUS": 226, "NVML_FI_DEV_DRAIN_AND_RESET_STATUS": 227}
_RECOVERY_FIELD = {"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": 230}
_COUNTERS_575 = {
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN": 251,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": 252,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN": 253,
}
_COUNTERS_590 = {
    "NVML_FI_PWR_SMOOTHING_ENABLED": 251,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN": 269,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": 270,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN": 271,
}
# 570's header: power smoothing at 251-268, no thermal counters.
_SMOOTHING_570 = {"NVML_FI_PWR_SMOOTHING_ENABLED": 251}
_ACTIONS_570 = ("NONE", "GPU_RESET", "NODE_REBOOT", "DRAIN_P2P", "DRAIN_AND_RESET")
_ACTIONS_610 = (*_ACTIONS_570, "RECOVER_IMEX_DOMAIN")
_ACTIONS_615 = (*_ACTIONS_610, "BUS_RESET", "SYSTEM_REBOOT")


@dataclass(frozen=True)
class Header:
    """One driver branch's nvml.h, as far as this exporter reads it: ``fields`` maps NVML's
    name (``NVML_FI_DEV_MEMORY_TEMP``) to its id, ``recovery_actions`` maps each number of
    ``nvmlDeviceGpuRecoveryAction_t`` to its name without ``NVML_GPU_RECOVERY_ACTION_``."""

    branch: int
    checked_with: str  # the nvidia-ml-py release whose pynvml.py the numbers were checked against
    fields: Mapping[str, int] = field(default_factory=dict)
    recovery_actions: Mapping[int, str] = field(default_factory=dict)
    release: int = 0  # the first release of the branch with this table (580.82: 82)

    def field_id(self, name: str) -> int | None:
        return self.fields.get(name)


def _header(branch: int, checked_with: str, *parts: dict[str, int], actions: tuple[str, ...] = (),
            release: int = 0) -> Header:
    merged: dict[str, int] = {}
    for part in parts:
        merged.update(part)
    return Header(branch, checked_with, MappingProxyType(merged), MappingProxyType(dict(enumerate(actions))),
                  release)


# Oldest first. A branch between two is read with the older one's table (its header is a superset
# of the older header's in every field kept here, but for the counters, which 570 and 590 moved).
HEADERS: tuple[Header, ...] = (
    _header(535, "12.535.161", _STABLE),
    _header(550, "12.550.89", _STABLE, _RESET_FLAGS),
    _header(555, "12.555.43", _STABLE),  # released before 550.89's addition reached its branch
    _header(560, "12.560.30", _STABLE, _RESET_FLAGS),
    _header(570, "12.570.86", _STABLE, _RESET_FLAGS, _RECOVERY_FIELD, _SMOOTHING_570, actions=_ACTIONS_570),
    _header(575, "12.575.51", _STABLE, _RESET_FLAGS, _RECOVERY_FIELD, _COUNTERS_575, actions=_ACTIONS_570),
    # 13.580.65's pynvml adds 5 as GPU_RESET_BUS; nvml.h of 580 (go-nvml) does not define 5.
    _header(580, "13.580.65", _STABLE, _RESET_FLAGS, _RECOVERY_FIELD, _COUNTERS_575, actions=_ACTIONS_570),
    # 580.82 (CUDA 13.0 Update 1) renumbered the counters as 590 has them.
    _header(580, "13.580.82", _STABLE, _RESET_FLAGS, _RECOVERY_FIELD, _COUNTERS_590, actions=_ACTIONS_570,
            release=82),
    _header(590, "13.590.48", _STABLE, _RESET_FLAGS, _RECOVERY_FIELD, _COUNTERS_590, actions=_ACTIONS_570),
    _header(610, "13.610.43", _STABLE, _RESET_FLAGS, _RECOVERY_FIELD, _COUNTERS_590, actions=_ACTIONS_610),
    _header(615, "13.615.71", _STABLE, _RESET_FLAGS, _RECOVERY_FIELD, _COUNTERS_590, actions=_ACTIONS_615),
)
_BRANCH = re.compile(r"\d+")


def driver_branch(nvml_version: str | bytes | None) -> int | None:
    """The driver branch in ``nvmlSystemGetNVMLVersion``'s answer: 570 for "12.570.86" (CUDA's
    major version, then the driver's), and for a bare driver version ("570.86.15"); ``None``
    where it names none."""
    release = driver_release(nvml_version)
    return None if release is None else release[0]


def driver_release(nvml_version: str | bytes | None) -> tuple[int, int] | None:
    """The driver's branch and release: (580, 82) for "13.580.82.07" and for "580.82.07"; the
    release 0 where the version names only the branch; ``None`` where it names none."""
    if isinstance(nvml_version, bytes):
        nvml_version = nvml_version.decode("ascii", errors="replace")
    numbers = [int(n) for n in _BRANCH.findall(nvml_version or "")]
    # Branches have three digits; CUDA's major version has at most two.
    at = next((i for i, n in enumerate(numbers) if 100 <= n <= 9999), None)
    if at is None:
        return None
    return numbers[at], numbers[at + 1] if at + 1 < len(numbers) else 0


def header_for(nvml_version: str | bytes | None) -> Header:
    """The table for the driver that answered ``nvml_version``: its branch and release's, or the
    newest older one's; a driver newer than every table gets the newest; an older one, or one
    whose version is unknown, the oldest, which has none of the fields that moved."""
    release = driver_release(nvml_version)
    if release is None:
        return HEADERS[0]
    return next((h for h in reversed(HEADERS) if (h.branch, h.release) <= release), HEADERS[0])


__all__ = ["HEADERS", "Header", "driver_branch", "driver_release", "header_for"]
