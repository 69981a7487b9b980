"""The XID catalogue: what each driver XID the alerts name means, how bad it is, and
what on-call does about it.

Taken from NVIDIA's "Xid Errors" document, its "Xid Catalog" for Ampere and newer
GPUs (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, the
catalogue's Description and Resolution Bucket columns; ``CATALOGUE_VERSION``), and
its A100/H100 memory error recovery notes (an uncorrectable memory error logs XID 48,
then XID 94 where the driver contained it to the work that hit it, or XID 95 where it
did not). Meanings and actions are written here in our words, not copied.

One row per code; deploy/prometheus/alerts.yml's XID alerts (their ``xid=~`` sets and
the meaning and action chains in their annotations) and docs/alerts.md's XID catalogue
section follow this table, and tests/test_xid_catalogue.py holds them to it
(scripts/sync-xid-docs writes the docs section).

Pure data; imports nothing of the project.
"""

from __future__ import annotations

from typing import NamedTuple

CATALOGUE_VERSION = (
    "NVIDIA Xid Errors: Xid Catalog for Ampere and newer GPUs, edition covering driver R575 "
    "(CUDA 12.9, codes 1-172), https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
)

# The alert each severity raises; "" for codes no alert raises (noise, or covered by
# another alert).
CRITICAL_ALERT = "GPUCriticalXID"
MEMORY_ALERT = "GPUMemoryErrorXID"
APPLICATION_ALERT = "GPUApplicationXID"
ALERTS = (CRITICAL_ALERT, MEMORY_ALERT, APPLICATION_ALERT)


class XidEntry(NamedTuple):
    """One XID: its meaning, its severity, what on-call does, and the alert it raises."""

    code: int
    meaning: str
    severity: str  # "critical" | "warning" | "info"
    action: str  # what on-call does, one sentence
    alert: str  # GPUCriticalXID | GPUMemoryErrorXID | GPUApplicationXID | "" (none)
    mnemonic: str = ""  # the catalogue's Mnemonic
    immediate: str = ""  # the catalogue's Resolution Bucket (Immediate Action)


def _entry(code: int, meaning: str, severity: str, action: str, alert: str) -> tuple[int, XidEntry]:
    mnemonic, immediate = _CATALOGUE[code]
    return code, XidEntry(code, meaning, severity, action, alert, mnemonic, immediate)


# The catalogue's own words for each code: (Mnemonic, Resolution Bucket (Immediate Action)).
_CATALOGUE = {
    13: ("ROBUST_CHANNEL_GR_EXCEPTION", "RESTART_APP"),
    31: ("ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "RESTART_APP"),
    43: ("ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "IGNORE"),
    45: ("ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "WORKFLOW_XID_45"),
    46: ("ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "RESET_GPU"),
    48: ("ROBUST_CHANNEL_GPU_ECC_DBE", "WORKFLOW_XID_48"),
    62: ("PMU_HALT_ERROR", "RESET_GPU"),
    63: ("INFOROM_DRAM_RETIREMENT_EVENT", "IGNORE"),
    64: ("INFOROM_DRAM_RETIREMENT_FAILURE", "RESET_GPU"),
    68: ("ROBUST_CHANNEL_NVDEC0_ERROR", "RESTART_APP"),
    69: ("ROBUST_CHANNEL_GR_CLASS_ERROR", "RESTART_APP"),
    74: ("NVLINK_ERROR", "WORKFLOW_NVLINK_ERR"),
    79: ("ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "RESTART_BM"),
    92: ("EXCESSIVE_SBE_INTERRUPTS", "IGNORE"),
    94: ("ROBUST_CHANNEL_CONTAINED_ERROR", "RESTART_APP"),
    95: ("ROBUST_CHANNEL_UNCONTAINED_ERROR", "RESET_GPU"),
    109: ("ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "RESET_GPU"),
    110: ("SEC_FAULT_ERROR", "RESET_GPU"),
    119: ("GSP_RPC_TIMEOUT", "RESET_GPU"),
    120: ("GSP_ERROR", "RESET_GPU"),
    136: ("ALI_TRAINING_FAIL", "RESET_GPU"),
    140: ("UNRECOVERABLE_ECC_ERROR_ESCAPE", "RESET_GPU"),
    143: ("GPU_INIT_ERROR", "RESET_GPU"),
    144: ("NVLINK_SAW_ERROR", "WORKFLOW_NVLINK5_ERR"),
    145: ("NVLINK_RLW_ERROR", "WORKFLOW_NVLINK5_ERR"),
    146: ("NVLINK_TLW_ERROR", "WORKFLOW_NVLINK5_ERR"),
    147: ("NVLINK_TREX_ERROR", "WORKFLOW_NVLINK5_ERR"),
    148: ("NVLINK_NVLPW_CTRL_ERROR", "WORKFLOW_NVLINK5_ERR"),
    149: ("NVLINK_NETIR_ERROR", "WORKFLOW_NVLINK5_ERR"),
    150: ("NVLINK_MSE_ERROR", "WORKFLOW_NVLINK5_ERR"),
    154: ("GPU_RECOVERY_ACTION_CHANGED", "XID_154"),
    158: ("GPU_FATAL_TIMEOUT", "RESET_GPU"),
}


_RESET = "drain the card and reset it (nvidia-smi -r)"
_RESTART = "restart the work that hit it; the card needs nothing"
_NVLINK = (
    "drain the card and reset it or reboot the node; the fault may be the GPU or NVSwitch "
    "at the link's other end (nvidia-smi nvlink)"
)

XIDS: dict[int, XidEntry] = dict(
    sorted(
        [
            # Application faults: the catalogue's RESTART_APP, with the application or CUDA
            # code to look at; the card is fine.
            _entry(13, "graphics engine exception", "info", "check the work's code and restart it", APPLICATION_ALERT),
            _entry(31, "GPU memory page fault", "info", "check the work's code and restart it", APPLICATION_ALERT),
            _entry(
                43,
                "GPU stopped processing: the application hit a software fault",
                "info",
                _RESTART,
                APPLICATION_ALERT,
            ),
            _entry(68, "video decoder exception", "info", _RESTART, APPLICATION_ALERT),
            _entry(
                69, "graphics engine class error", "info", "check the work's code and restart it", APPLICATION_ALERT
            ),
            # Noise after another error: the catalogue's IGNORE.
            _entry(45, "preemptive cleanup after an earlier error", "info", "act on the XID logged before it", ""),
            # Memory errors. On A100 and newer the driver follows XID 48 with 94 (contained)
            # or 95 (uncontained), and that one decides; the card's row remap state
            # (GPUCardNeedsReset) says when a reset is due.
            _entry(
                48,
                "double-bit (uncorrectable) ECC error",
                "warning",
                (
                    "act on the XID 94 (contained) or 95 (uncontained) that follows; "
                    "with neither, drain the card and reset it"
                ),
                MEMORY_ALERT,
            ),
            _entry(
                63,
                "row remap or page retirement recorded",
                "warning",
                "drain the card and reset it when convenient: the remap takes effect at the reset",
                MEMORY_ALERT,
            ),
            _entry(
                92,
                "high single-bit ECC error rate",
                "warning",
                "watch the card's ECC counts; corrected errors harm no work",
                MEMORY_ALERT,
            ),
            _entry(
                94,
                "contained memory error",
                "warning",
                "restart the work that hit it, other work is unaffected; reset the card when convenient",
                MEMORY_ALERT,
            ),
            _entry(95, "uncontained memory error", "critical", _RESET, CRITICAL_ALERT),
            # Faults that need the card reset (the catalogue's RESET_GPU) or the node
            # rebooted (RESTART_BM).
            _entry(46, "GPU stopped processing", "critical", _RESET, CRITICAL_ALERT),
            _entry(62, "internal micro-controller halt", "critical", _RESET, CRITICAL_ALERT),
            _entry(
                64,
                "row remapping or page retirement recording failure",
                "critical",
                _RESET,
                CRITICAL_ALERT,
            ),
            _entry(74, "NVLink error", "critical", _NVLINK, CRITICAL_ALERT),
            _entry(
                79,
                "GPU has fallen off the bus",
                "critical",
                "drain the node and reboot it; the card is off the PCIe bus (check the kernel's PCI logs)",
                CRITICAL_ALERT,
            ),
            _entry(109, "context switch timeout", "critical", _RESET, CRITICAL_ALERT),
            _entry(110, "security fault", "critical", _RESET, CRITICAL_ALERT),
            _entry(119, "GSP RPC timeout", "critical", _RESET, CRITICAL_ALERT),
            _entry(120, "GSP error", "critical", _RESET, CRITICAL_ALERT),
            _entry(136, "link training failed", "critical", _RESET, CRITICAL_ALERT),
            _entry(140, "unrecovered ECC error", "critical", _RESET, CRITICAL_ALERT),
            _entry(143, "GPU initialization error", "critical", _RESET, CRITICAL_ALERT),
            # NVLink 5 (B100, GB200): the catalogue's WORKFLOW_NVLINK5_ERR.
            _entry(144, "NVLink SAW error", "critical", _NVLINK, CRITICAL_ALERT),
            _entry(145, "NVLink RLW error", "critical", _NVLINK, CRITICAL_ALERT),
            _entry(146, "NVLink TLW error", "critical", _NVLINK, CRITICAL_ALERT),
            _entry(147, "NVLink TREX error", "critical", _NVLINK, CRITICAL_ALERT),
            _entry(148, "NVLink NVLPW_CTRL error", "critical", _NVLINK, CRITICAL_ALERT),
            _entry(149, "NVLink NETIR error", "critical", _NVLINK, CRITICAL_ALERT),
            _entry(150, "NVLink MSE error", "critical", _NVLINK, CRITICAL_ALERT),
            # XID 154 carries the driver's recovery action, which the card's health
            # (GPUCardNeedsRecovery, GPUCardNeedsReset) already alerts on.
            _entry(
                154,
                "GPU recovery action changed",
                "info",
                "follow GPUCardNeedsRecovery or GPUCardNeedsReset for the action it names",
                "",
            ),
            _entry(158, "GPU fatal timeout", "critical", _RESET, CRITICAL_ALERT),
        ]
    )
)


def describe(code: int) -> XidEntry:
    """The catalogue's entry for ``code``; a generic warning for a code it lacks."""
    entry = XIDS.get(code)
    if entry is not None:
        return entry
    return XidEntry(code, "see NVIDIA's XID catalogue", "warning", "see NVIDIA's XID catalogue", "")


def alert_codes(alert: str) -> tuple[int, ...]:
    """The codes ``alert`` fires on, in order."""
    return tuple(sorted(code for code, entry in XIDS.items() if entry.alert == alert))
