"""The capacity recording rules' expressions (deploy/prometheus/alerts.yml, group
``mig-exporter.capacity``), word for word: ``fleet`` asks them of a Prometheus that may not load
the rules, and tests/test_capacity.py holds the rules file equal to them (the package carries no
deploy/ to read them from). docs/capacity.md explains each part.

A node counts while it reports: its newest ``read_success`` within ``FRESH_WITHIN`` is 1, and it
is an exporter's own /metrics (probe targets export no ``build_info``). ``FRESH_WITHIN`` is the
rules' one parameter: two scrape intervals (plus the federation interval behind a federating
Prometheus). A node seen within ``SEEN_WITHIN`` that no longer reports has its devices of then
counted, as unknown: a killed exporter, a failed read, a Prometheus restarted while the target
was down never leave a device free.
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

# The window holds where no staleness marker comes (federation, a restart); the bare selector
# ends it at once where one does (a scrape that failed, an exporter gone from a plain Prometheus).
REPORTING = (
    f"( last_over_time(mig_exporter_read_success[{FRESH_WITHIN}]) == 1 "
    f"and ignoring (source, version) last_over_time(mig_exporter_build_info[{FRESH_WITHIN}]) "
    "and mig_exporter_read_success )"
)
DEVICES_REPORTING = (
    f"( last_over_time(mig_exporter_device_info[{FRESH_WITHIN}]) and ignoring ({_NOT_NODE}) {REPORTING} )"
)
DEVICES_SILENT = (
    f"( ( last_over_time(mig_exporter_device_info[{SEEN_WITHIN}]) "
    f"and ignoring ({_NOT_NODE}) last_over_time(mig_exporter_build_info[{SEEN_WITHIN}]) ) "
    f"unless ignoring ({_NOT_NODE}) {REPORTING} )"
)
DEVICES_SEEN = f"( {DEVICES_REPORTING} or {DEVICES_SILENT} )"


def _in_state(state: str) -> str:
    """The reporting node's devices whose newest state is ``state``."""
    return (f"( {DEVICES_REPORTING} and ignoring (uuid, gpu_instance, compute_instance, class, name, device, state) "
            f"(last_over_time(mig_exporter_device_state{{state=\"{state}\"}}[{FRESH_WITHIN}]) == 1) )")


def _per_node(devices: str) -> str:
    """How many of ``devices`` each node has of each class, with an explicit 0."""
    return (f"( count without ({DEVICE_LABELS}) ( {devices} ) "
            f"or 0 * count without ({DEVICE_LABELS}) ( {DEVICES_SEEN} ) )")


DEVICES_PER_NODE = f"count without ({DEVICE_LABELS}) ( {DEVICES_SEEN} )"
FREE_PER_NODE = _per_node(_in_state("free"))
IN_USE_PER_NODE = _per_node(_in_state("in_use"))
UNKNOWN_PER_NODE = _per_node(f"{_in_state('unknown')} or {DEVICES_SILENT}")
# Compute instances of one GPU instance share its memory: it counts once per (card, GPU instance).
MEMORY_FREE_PER_NODE = (
    "sum without (card, gpu_instance) ( max without (index, mig_profile) ( "
    f"last_over_time(mig_exporter_device_memory_free_bytes[{FRESH_WITHIN}]) "
    f"* ignoring (uuid, gpu_instance, compute_instance, class, name, device) group_left (class, gpu_instance) "
    f"{DEVICES_REPORTING} ) )"
)

# The recorded name of each node rule, in the rules file's order.
NODE_RULES = {
    "instance_class:mig_exporter_devices:count": DEVICES_PER_NODE,
    "instance_class:mig_exporter_devices_free:count": FREE_PER_NODE,
    "instance_class:mig_exporter_devices_in_use:count": IN_USE_PER_NODE,
    "instance_class:mig_exporter_devices_unknown:count": UNKNOWN_PER_NODE,
    "instance_class:mig_exporter_device_memory_free_bytes:sum": MEMORY_FREE_PER_NODE,
}


def free_devices(device_class: str) -> str:
    """Each free device of ``device_class`` on a reporting node, as its ``device_info`` series
    (node, ``device``, ``uuid``, ``gpu_instance``), its value its memory free in bytes."""
    # A PromQL string literal is a JSON string literal: any class name matches as it is.
    of_class = f"mig_exporter_device_info{{class={json.dumps(device_class)}}}"
    devices = _in_state("free").replace("mig_exporter_device_info", of_class, 1)
    return (f"last_over_time(mig_exporter_device_memory_free_bytes[{FRESH_WITHIN}]) "
            # `group_right ()`: the empty list written out, or PromQL reads the operand's "(" as one.
            f"* ignoring (uuid, gpu_instance, compute_instance, class, name, device) group_right () {devices}")


# Nodes that stopped reporting: an exporter's /metrics seen within SEEN_WITHIN, not reporting now.
NOT_REPORTING = (
    f"last_over_time(mig_exporter_build_info[{SEEN_WITHIN}]) unless ignoring (source, version) {REPORTING}"
)
