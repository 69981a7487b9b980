"""The capacity recording rules' expressions (deploy/prometheus/alerts.yml, group
``mig-exporter.capacity``, which scripts/sync-capacity-rules writes from this module): ``fleet``
asks them of a Prometheus that may not load the rules, and the dashboard runs them.
docs/capacity.md explains each part.

A node counts while it reports: its newest ``read_success`` within ``FRESH_WITHIN`` is 1 for
every read path, that sample is not stale, and it is an exporter's own /metrics (probe targets
export no ``build_info``). ``FRESH_WITHIN`` is the rules' one parameter: two scrape intervals
(plus the federation interval behind a federating Prometheus). A node seen within
``SEEN_WITHIN`` that no longer reports has its devices of then counted, as unknown: a killed
exporter, a failed read, a Prometheus restarted while the target was down never leave a device
free. Each expression is written out in full, with line breaks, so that each rule stands alone
in any ruler and reads as the rules file shows it.
"""

from __future__ import annotations

import json

FRESH_WITHIN = "1m"
SEEN_WITHIN = "1h"

# Labels that name a device, not its node: what the node rules aggregate away, and ignore when
# they match a device series to its node's. Never `by (job, instance)` or `on (job, instance)`:
# target and external labels (cluster) stay on every result.
DEVICE_LABELS = "index, card, mig_profile, uuid, gpu_instance, compute_instance, name, device"
_NOT_NODE = f"{DEVICE_LABELS}, class, state, source, version"
# The exporter pod's own target labels (the Prometheus Operator's, kept by honorLabels): a new
# pod of the same node (a rollout) is the same node, not a silent one beside a new one.
POD_LABELS = "pod, container, endpoint, service, namespace"
_DEVICE_ONLY = "uuid, gpu_instance, compute_instance, class, name, device"


def _block(opening: str, lines: list[str], closing: str = ")") -> list[str]:
    """``opening`` then ``lines`` indented by two, then ``closing``."""
    return [opening, *("  " + line if line else line for line in lines), closing]


def _text(lines: list[str]) -> str:
    return "\n".join(lines)


# A node that reports: its newest read on every path within the window succeeded, and that read
# is not stale (a failed scrape, an exporter gone from a plain Prometheus end it at once; where no
# staleness marker comes, federation or a restart, the window does).
_REPORTING = [
    f"min without (source) (last_over_time(mig_exporter_read_success[{FRESH_WITHIN}])) == 1",
    f"and ignoring (version) last_over_time(mig_exporter_build_info[{FRESH_WITHIN}])",
    "and ignoring (source) mig_exporter_read_success",
]
# Its devices, from its newest read: a device gone from it (a MIG reconfiguration) is gone.
_DEVICES_REPORTING = _block("(", [
    f"last_over_time(mig_exporter_device_info[{FRESH_WITHIN}])",
    "and mig_exporter_device_info",
    *_block(f"and ignoring ({_NOT_NODE}) (", _REPORTING),
])
# A node seen within SEEN_WITHIN that does not report now, under any pod of its exporter.
_DEVICES_SILENT = _block("(", [
    *_block("(", [
        f"last_over_time(mig_exporter_device_info[{SEEN_WITHIN}])",
        f"and ignoring ({_NOT_NODE})",
        f"  last_over_time(mig_exporter_build_info[{SEEN_WITHIN}])",
    ]),
    *_block(f"unless ignoring ({_NOT_NODE}, {POD_LABELS}) (", _REPORTING),
])
_DEVICES_SEEN = _block("(", [*_DEVICES_REPORTING, "or", *_DEVICES_SILENT])


def _in_state(state: str) -> list[str]:
    """The reporting nodes' devices whose newest state is ``state``."""
    return _block("(", [
        *_DEVICES_REPORTING,
        f"and ignoring ({_DEVICE_ONLY}, state)",
        f"  (last_over_time(mig_exporter_device_state{{state=\"{state}\"}}[{FRESH_WITHIN}]) == 1)",
    ])


# Unknown: neither free nor in use (an exporter without device_state included), or silent.
_UNKNOWN = [
    *_block("(", [
        *_DEVICES_REPORTING,
        f"unless ignoring ({_DEVICE_ONLY}, state)",
        f"  (last_over_time(mig_exporter_device_state{{state=~\"free|in_use\"}}[{FRESH_WITHIN}]) == 1)",
    ]),
    "or",
    *_DEVICES_SILENT,
]


def _per_node(devices: list[str]) -> str:
    """How many of ``devices`` each node has of each class, with an explicit 0."""
    return _text(_block("(", [
        *_block(f"count without ({DEVICE_LABELS}) (", devices),
        "or",
        *_block(f"0 * count without ({DEVICE_LABELS}) (", _DEVICES_SEEN),
    ]))


DEVICES_PER_NODE = _text(_block(f"count without ({DEVICE_LABELS}) (", _DEVICES_SEEN))
FREE_PER_NODE = _per_node(_in_state("free"))
IN_USE_PER_NODE = _per_node(_in_state("in_use"))
UNKNOWN_PER_NODE = _per_node(_UNKNOWN)
# Compute instances of one GPU instance share its memory: it counts once per (card, GPU
# instance). topk keeps one device_info per device where a reconfigured one's lingers beside it.
MEMORY_FREE_PER_NODE = _text(_block("sum without (card, gpu_instance) (", _block("max without (index, mig_profile) (", [
    f"last_over_time(mig_exporter_device_memory_free_bytes[{FRESH_WITHIN}])",
    *_block(f"* ignoring ({_DEVICE_ONLY}) group_left (class, gpu_instance) topk without ({_DEVICE_ONLY}) (",
            ["1,", *_DEVICES_REPORTING]),
])))

# The recorded name of each node rule, in the rules file's order, and what it says.
NODE_RULES = {
    "instance_class:mig_exporter_devices:count": DEVICES_PER_NODE,
    "instance_class:mig_exporter_devices_free:count": FREE_PER_NODE,
    "instance_class:mig_exporter_devices_in_use:count": IN_USE_PER_NODE,
    "instance_class:mig_exporter_devices_unknown:count": UNKNOWN_PER_NODE,
    "instance_class:mig_exporter_device_memory_free_bytes:sum": MEMORY_FREE_PER_NODE,
}
NODE_RULE_NOTES = {
    "instance_class:mig_exporter_devices:count":
        "Devices of each class on each node: a reporting node's now, and a silent one's of its last read within 1h.",
    "instance_class:mig_exporter_devices_free:count": "Free devices of each class on each node, with an explicit 0.",
    "instance_class:mig_exporter_devices_in_use:count":
        "In use: a process listed, or allocated to a pod or a Slurm job.",
    "instance_class:mig_exporter_devices_unknown:count":
        "Unknown: a reporting node's devices neither free nor in use, and every device of a silent one.",
    "instance_class:mig_exporter_device_memory_free_bytes:sum":
        "Memory free of each class on a reporting node, each GPU instance once.",
}


def free_devices(device_class: str) -> str:
    """Each free device of ``device_class`` on a reporting node, as its ``device_info`` series
    (node, ``device``, ``uuid``, ``gpu_instance``), its value its memory free in bytes."""
    # A PromQL string literal is a JSON string literal: any class name matches as it is.
    of_class = f"mig_exporter_device_info{{class={json.dumps(device_class)}}}"
    devices = _text(_in_state("free")).replace("mig_exporter_device_info[", of_class + "[", 1)
    # `group_right ()`: the empty list written out, or PromQL reads the operand's "(" as one.
    return (f"last_over_time(mig_exporter_device_memory_free_bytes[{FRESH_WITHIN}])\n"
            f"* ignoring ({_DEVICE_ONLY}) group_right () {devices}")


# Nodes that stopped reporting: an exporter's /metrics seen within SEEN_WITHIN, not reporting now.
NOT_REPORTING = _text([
    f"last_over_time(mig_exporter_build_info[{SEEN_WITHIN}])",
    *_block(f"unless ignoring (source, version, {POD_LABELS}) (", _REPORTING),
])
