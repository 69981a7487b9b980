"""``mig-exporter fleet``: the fleet by device class, asked of a Prometheus that scrapes the
exporters, through its HTTP query API (``/api/v1/query``, the standard library's urllib and
json: no PromQL result is parsed by hand). The planner's question, "is there one free 3g.40gb
instance, and which?", answered from the metrics.

It asks the capacity recording rules' own expressions (``capacity_rules``), not their recorded
names, so it answers from a Prometheus that does not load the rules too: one definition of free
(``mig_exporter_device_state``, on a node that reports now), in use and unknown.

    CLASS                 DEVICES  FREE  IN USE  UNKNOWN  MEMORY FREE
    a100-80g-mig-3g.40gb        4     2       1        1    106.3 GiB

    Nodes not reporting (seen within 1h, not now): gpu-node-4:10064

    Nodes with a free a100-80g-mig-3g.40gb now:
      gpu-node-1:10064 {cluster="eu-1"}  1 free
      gpu-node-2:10064 {cluster="eu-1"}  1 free

It asks through ``prometheus_api``'s client, which keeps every secret out of every message.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mig_exporter import capacity_rules
from mig_exporter.capacity_rules import (
    DEVICE_LABELS,
    DEVICES_PER_NODE,
    FREE_PER_NODE,
    FRESH_WITHIN,
    IN_USE_PER_NODE,
    MEMORY_FREE_PER_NODE,
    NOT_REPORTING,
    SEEN_WITHIN,
    UNKNOWN_PER_NODE,
)
from mig_exporter.prometheus_api import FleetUsageError, PrometheusClient, for_terminal

# The rules' freshness window as shipped: --capacity.fresh-within's default.
DEFAULT_FRESH_WITHIN = FRESH_WITHIN

_GIB = 1024**3
# The labels of a device series that are the device's, not its node's.
_DEVICE_ONLY = frozenset(label.strip() for label in DEVICE_LABELS.split(",")) | {"class"}
_DURATION = re.compile(r"[1-9][0-9]*(s|m|h)")  # as the chart's capacityFreshWithin takes it


# --- the fleet ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Queries:
    """The expressions fleet asks: the capacity rules' (``capacity_rules``), with their freshness
    window where the rules run with another (``fresh_within``)."""

    devices: str = DEVICES_PER_NODE
    free: str = FREE_PER_NODE
    in_use: str = IN_USE_PER_NODE
    unknown: str = UNKNOWN_PER_NODE
    memory_free: str = MEMORY_FREE_PER_NODE
    not_reporting: str = NOT_REPORTING
    free_devices: Callable[[str], str] = field(default=capacity_rules.free_devices)

    def fresh_within(self, window: str) -> Queries:
        """The same expressions, counting a node while its newest read is younger than ``window``
        (a Prometheus duration: 45s, 2m) in place of the rules' ``FRESH_WITHIN``: what the chart's
        ``prometheusRule.capacityFreshWithin`` does to the rules file, so fleet counts as they do."""
        if not _DURATION.fullmatch(window):
            raise FleetUsageError(f"--capacity.fresh-within {window!a}: give a Prometheus duration such as 45s, "
                                  "1m or 2m (two scrape intervals, plus the federation interval)")
        old, new = f"[{FRESH_WITHIN}]", f"[{window}]"
        listed = self.free_devices
        return Queries(self.devices.replace(old, new), self.free.replace(old, new), self.in_use.replace(old, new),
                       self.unknown.replace(old, new), self.memory_free.replace(old, new),
                       self.not_reporting.replace(old, new), lambda c: listed(c).replace(old, new))


QUERIES = Queries()


@dataclass(frozen=True, slots=True)
class ClassInFleet:
    device_class: str
    devices: int
    free: int
    in_use: int = 0
    unknown: int = 0
    # Memory free on the class's reporting devices, each GPU instance once; None when none reports it.
    memory_free_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Node:
    """A node as the Prometheus names it: its ``instance``, and its other labels (``job``, and
    external ones such as ``cluster``), so two clusters' nodes of one name stay two."""

    instance: str
    labels: tuple[tuple[str, str], ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {"instance": self.instance, "labels": dict(self.labels)}

    def describe(self) -> str:
        """``gpu-node-1:10064`` and, beyond its job, its other labels: ``{cluster="eu-1"}``."""
        others = [f'{for_terminal(k, 40)}="{for_terminal(v, 80)}"' for k, v in self.labels if k != "job"]
        name = for_terminal(self.instance, 120) or "(no instance)"
        return name + (f" {{{', '.join(others)}}}" if others else "")


@dataclass(frozen=True, slots=True)
class NodeWithFree:
    instance: str
    free: int
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def node(self) -> Node:
        return Node(self.instance, self.labels)


@dataclass(frozen=True, slots=True)
class FreeDevice:
    """One free device: what a planner hands to ``CUDA_VISIBLE_DEVICES`` (``uuid``), where it is,
    and its memory free. The same fields as ``status --output json`` gives for the device."""

    node: Node
    device: str  # card/migN, or the card's index for a whole card
    index: int | None  # the placement index, as status gives it (device_info's index label)
    uuid: str
    gpu_instance: int | None
    compute_instance: int | None
    memory_free_bytes: int | None

    def as_json(self) -> dict[str, Any]:
        return {**self.node.as_json(), "device": self.device, "index": self.index, "uuid": self.uuid,
                "gpu_instance": self.gpu_instance, "compute_instance": self.compute_instance,
                "memory_free_bytes": self.memory_free_bytes}


@dataclass(frozen=True, slots=True)
class Fleet:
    classes: tuple[ClassInFleet, ...]
    # Exporters seen within the last hour that do not report now (their devices count unknown).
    not_reporting: tuple[Node, ...] = ()
    # With a class asked for: it, and each node with at least one free device of it, most free first.
    device_class: str | None = None
    nodes: tuple[NodeWithFree, ...] | None = None
    # With --devices: each free device of the class, node by node as ``nodes`` orders them.
    devices: tuple[FreeDevice, ...] | None = None

    def knows(self, device_class: str) -> bool:
        """Whether the Prometheus has a device of ``device_class`` (reporting, or seen within the hour)."""
        return any(c.device_class == device_class for c in self.classes)

    @property
    def any_free(self) -> bool:
        """With a class: whether a device of it is free now."""
        return bool(self.nodes)


def _number(element: Mapping[str, Any]) -> int | None:
    value = float(element["value"][1])
    return int(value) if math.isfinite(value) else None


def _node_of(metric: Mapping[str, str], drop: Iterable[str] = ()) -> Node:
    gone = {"instance", "__name__", *drop}
    return Node(metric.get("instance", ""), tuple(sorted((k, v) for k, v in metric.items() if k not in gone)))


def _id(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def read_fleet(client: PrometheusClient, device_class: str | None = None, *, devices: bool = False,
               queries: Queries = QUERIES) -> Fleet:
    """Devices, free, in use, unknown and memory free per class; the nodes not reporting; with
    ``device_class`` (one the Prometheus has) the nodes with a free one, and with ``devices``
    each free device. Every query at one instant: free never counts another moment than devices.
    All of them within the client's one timeout (``exchange``): a Prometheus that answers slowly,
    or never ends its answer, holds fleet no longer than ``--timeout``."""
    with client.exchange():
        return _read_fleet(client, device_class, devices=devices, queries=queries)


def _read_fleet(client: PrometheusClient, device_class: str | None, *, devices: bool, queries: Queries) -> Fleet:
    at = time.time()

    def per_class(expression: str) -> dict[str, int | None]:
        return {e["metric"].get("class", ""): _number(e) for e in client.query(f"sum by (class) ({expression})", at)}

    counted = per_class(queries.devices)
    free, in_use, unknown = per_class(queries.free), per_class(queries.in_use), per_class(queries.unknown)
    memory = per_class(queries.memory_free)
    classes = tuple(ClassInFleet(name, count or 0, free.get(name) or 0, in_use.get(name) or 0,
                                 unknown.get(name) or 0, memory.get(name))
                    for name, count in sorted(counted.items()))
    silent = tuple(sorted({_node_of(e["metric"], drop=("version",))
                           for e in client.query(queries.not_reporting, at)},
                          key=lambda n: (n.instance, n.labels)))
    found = Fleet(classes, silent, device_class)
    if device_class is None or not found.knows(device_class):
        return found
    # Per node, keeping its target and external labels (job, cluster): not merged by instance name.
    # The class is matched here, not in PromQL: any class name matches as it is.
    per_node = [e for e in client.query(f"({queries.free}) > 0", at) if e["metric"].get("class") == device_class]
    nodes = tuple(sorted((NodeWithFree(e["metric"].get("instance", ""), _number(e) or 0,
                                       _node_of(e["metric"], drop=("class",)).labels) for e in per_node),
                         key=lambda n: (-n.free, n.instance, n.labels)))
    found = Fleet(classes, silent, device_class, nodes)
    if not devices:
        return found
    rank = {n.node: i for i, n in enumerate(nodes)}
    listed = []
    for e in client.query(queries.free_devices(device_class), at):
        metric = e["metric"]
        listed.append(FreeDevice(_node_of(metric, drop=_DEVICE_ONLY), metric.get("device", ""),
                                 _id(metric.get("index")), metric.get("uuid", ""), _id(metric.get("gpu_instance")),
                                 _id(metric.get("compute_instance")), _number(e)))
    listed.sort(key=lambda d: (rank.get(d.node, len(rank)), d.node.instance, d.node.labels,
                               d.index if d.index is not None else -1, d.device))
    return Fleet(classes, silent, device_class, nodes, tuple(listed))


# --- output ------------------------------------------------------------------------------------


def as_json(fleet: Fleet) -> dict[str, Any]:
    """``classes`` (as ``status`` gives a node's), ``not_reporting``; with a class, ``class`` and
    ``nodes``; with --devices, ``devices``."""
    out: dict[str, Any] = {
        "classes": [{"class": c.device_class, "devices": c.devices, "free": c.free, "in_use": c.in_use,
                     "unknown": c.unknown, "memory_free_bytes": c.memory_free_bytes} for c in fleet.classes],
        "not_reporting": [n.as_json() for n in fleet.not_reporting],
    }
    if fleet.nodes is not None:
        out["class"] = fleet.device_class
        out["nodes"] = [{"instance": n.instance, "free": n.free, "labels": dict(n.labels)} for n in fleet.nodes]
    if fleet.devices is not None:
        out["devices"] = [d.as_json() for d in fleet.devices]
    return out


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / _GIB:.1f} GiB"


def _table(rows: list[tuple[str, ...]], right: set[int], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
                               for i, cell in enumerate(row)).rstrip() for row in rows]


def render_text(fleet: Fleet, device_class: str | None = None) -> str:
    device_class = device_class if device_class is not None else fleet.device_class
    if not fleet.classes:
        lines = ["No devices: the Prometheus has no mig-exporter device series (is it scraping the exporters?)"]
    else:
        rows: list[tuple[str, ...]] = [("CLASS", "DEVICES", "FREE", "IN USE", "UNKNOWN", "MEMORY FREE")]
        rows += [(for_terminal(c.device_class, 80) or "(unknown class)", str(c.devices), str(c.free),
                  str(c.in_use), str(c.unknown), _gib(c.memory_free_bytes)) for c in fleet.classes]
        lines = _table(rows, right={1, 2, 3, 4, 5})
    lines.append("")
    silent = ", ".join(n.describe() for n in fleet.not_reporting) or "none"
    lines.append(f"Nodes not reporting (seen within {SEEN_WITHIN}, not now): {silent}")
    shown_class = for_terminal(device_class or "", 80)
    if fleet.devices is not None:
        lines.append("")
        if fleet.devices:
            lines.append(f"Free {shown_class} devices now:")
            rows = [("NODE", "DEVICE", "UUID", "GPU INSTANCE", "MEMORY FREE")]
            rows += [(d.node.describe(), for_terminal(d.device, 20), for_terminal(d.uuid, 80),
                      "-" if d.gpu_instance is None else str(d.gpu_instance), _gib(d.memory_free_bytes))
                     for d in fleet.devices]
            lines += _table(rows, right={3, 4}, indent="  ")
        else:
            lines.append(f"No {shown_class} is free now.")
    elif fleet.nodes is not None:
        lines.append("")
        if fleet.nodes:
            lines.append(f"Nodes with a free {shown_class} now:")
            lines += [f"  {n.node.describe()}  {n.free} free" for n in fleet.nodes]
        else:
            lines.append(f"No node has a free {shown_class} now.")
    return "\n".join(lines) + "\n"


def known_classes(fleet: Fleet) -> str:
    """The classes the Prometheus has, for the message naming an unknown one."""
    return ", ".join(for_terminal(c.device_class, 80) or "(unknown class)" for c in fleet.classes) or "none"
