"""``mig-exporter fleet``: the fleet by device class, asked of a Prometheus that scrapes the
exporters, through its HTTP query API (``/api/v1/query``, the standard library's urllib and
json: no PromQL result is parsed by hand). The planner's question, "is there one free 3g.40gb
instance, and where?", answered from the metrics.

It asks the shipped recording rules' expressions, not their recorded names, so it answers
from a Prometheus that does not load the rules too; the counting is the rules' own (free: a
device whose ``mig_exporter_device_processes`` is 0; a probe target's series never count).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

# The expressions of deploy/prometheus/alerts.yml's instance_class:mig_exporter_devices:count and
# instance_class:mig_exporter_devices_free:count, word for word (tests/test_capacity.py holds them
# equal; the package carries no deploy/ to read them from). The exporter's own /metrics series only:
# a probe target exports the device families but no build_info.
_OWN = "and ignoring (class, version) last_over_time(mig_exporter_build_info[3m])"
_DEVICE_LABELS = "index, card, mig_profile, uuid, gpu_instance, compute_instance, name, device"
DEVICES_PER_NODE = f"count without ({_DEVICE_LABELS}) ( mig_exporter_device_info ) {_OWN}"
FREE_PER_NODE = (
    f"( count without ({_DEVICE_LABELS}) ( mig_exporter_device_info "
    "and ignoring (uuid, gpu_instance, compute_instance, class, name, device) (mig_exporter_device_processes == 0) ) "
    f"or 0 * count without ({_DEVICE_LABELS}) ( mig_exporter_device_info ) ) {_OWN}"
)


class FleetError(Exception):
    """The Prometheus could not be asked, or answered an error: the message names the URL and why."""


@dataclass(frozen=True, slots=True)
class ClassInFleet:
    device_class: str
    devices: int
    free: int


@dataclass(frozen=True, slots=True)
class NodeWithFree:
    instance: str
    free: int
    # The node's other labels (job, and external ones such as cluster): two clusters' nodes of one
    # name stay apart.
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Fleet:
    classes: tuple[ClassInFleet, ...]
    # With a class asked for: each node with at least one free device of it, most free first.
    nodes: tuple[NodeWithFree, ...] | None = None


class PrometheusClient:
    """Instant queries against one Prometheus (or anything that serves its query API:
    Thanos Query, Mimir, VictoriaMetrics)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        try:
            parsed = urllib.parse.urlsplit(url)
            parsed.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        except ValueError as e:
            raise FleetError(f"{url}: not a URL: {e}") from None
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise FleetError(f"{url}: not an http:// or https:// URL")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector ``promql`` gives at ``at`` (seconds since the epoch; now when
        ``None``): each element's ``metric`` (a dict) and ``value`` ([time, "number"])."""
        endpoint = f"{self.url}/api/v1/query"
        form = {"query": promql} | ({"time": f"{at:.3f}"} if at is not None else {})
        data = urllib.parse.urlencode(form).encode()
        request = urllib.request.Request(endpoint, data=data, method="POST",
                                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as e:  # Prometheus answers 400/422/503 with a JSON error
            body = e.read()
            raise FleetError(f"{endpoint}: HTTP {e.code}: {_error_of(body) or e.reason}") from None
        except urllib.error.URLError as e:
            raise FleetError(f"{endpoint}: cannot reach it: {e.reason}") from None
        except (TimeoutError, OSError, http.client.HTTPException, ValueError) as e:
            # A TLS or gRPC port answering garbage, a cut answer, a URL urllib refuses.
            raise FleetError(f"{endpoint}: {type(e).__name__}: {e}") from None
        try:
            answer = json.loads(body)
        except ValueError:
            raise FleetError(f"{endpoint}: the answer is not JSON (is this a Prometheus?)") from None
        if not isinstance(answer, dict) or answer.get("status") != "success":
            raise FleetError(f"{endpoint}: {_error_of(body) or 'the answer is not a success'}")
        result = answer.get("data")
        if not isinstance(result, dict) or result.get("resultType") != "vector":
            kind = result.get("resultType") if isinstance(result, dict) else type(result).__name__
            raise FleetError(f"{endpoint}: expected an instant vector, got {kind!r}")
        elements = result.get("result")
        if not isinstance(elements, list) or not all(_is_sample(e) for e in elements):
            raise FleetError(f"{endpoint}: the answer's samples are not a Prometheus instant vector's")
        return elements


def _is_sample(element: object) -> bool:
    """``{"metric": {...}, "value": [time, "number"]}``, the number parseable."""
    if not isinstance(element, dict) or not isinstance(element.get("metric"), dict):
        return False
    value = element.get("value")
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], str):
        return False
    try:
        float(value[1])
    except ValueError:
        return False
    return True


def _error_of(body: bytes) -> str | None:
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    if isinstance(answer, dict) and answer.get("error"):
        return f"{answer.get('errorType', 'error')}: {answer['error']}"
    return None


def _number(element: dict[str, Any]) -> int:
    return int(float(element["value"][1]))


def read_fleet(client: PrometheusClient, device_class: str | None = None) -> Fleet:
    at = time.time()  # every query at one instant: free never counts another moment than devices
    devices = {e["metric"].get("class", ""): _number(e)
               for e in client.query(f"sum by (class) ({DEVICES_PER_NODE})", at)}
    free = {e["metric"].get("class", ""): _number(e)
            for e in client.query(f"sum by (class) ({FREE_PER_NODE})", at)}
    classes = tuple(ClassInFleet(name, count, free.get(name, 0)) for name, count in sorted(devices.items()))
    if device_class is None:
        return Fleet(classes)
    # A PromQL string literal is a JSON string literal: any class name is matched as it is.
    of_class = f"mig_exporter_device_info{{class={json.dumps(device_class)}}}"
    # Per node, keeping its target and external labels (job, cluster): not merged by instance name.
    per_node = client.query(f"sum without (class) ({FREE_PER_NODE.replace('mig_exporter_device_info', of_class, 1)})",
                            at)
    nodes = sorted((NodeWithFree(e["metric"].get("instance", ""), _number(e),
                                 tuple(sorted((k, v) for k, v in e["metric"].items() if k != "instance")))
                    for e in per_node), key=lambda n: (-n.free, n.instance, n.labels))
    return Fleet(classes, tuple(n for n in nodes if n.free > 0))


def as_json(fleet: Fleet) -> dict[str, Any]:
    out: dict[str, Any] = {"classes": [{"class": c.device_class, "devices": c.devices, "free": c.free}
                                       for c in fleet.classes]}
    if fleet.nodes is not None:
        out["nodes"] = [{"instance": n.instance, "free": n.free, "labels": dict(n.labels)} for n in fleet.nodes]
    return out


def render_text(fleet: Fleet, device_class: str | None = None) -> str:
    if not fleet.classes:
        return "No devices: the Prometheus has no mig-exporter device series (is it scraping the exporters?)\n"
    rows = [("CLASS", "DEVICES", "FREE")] + [(c.device_class or "(unknown class)", str(c.devices), str(c.free))
                                            for c in fleet.classes]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}" for r in rows]
    if fleet.nodes is not None:
        lines.append("")
        if fleet.nodes:
            lines.append(f"Nodes with a free {device_class} now:")
            lines += [f"  {n.instance}  {n.free} free" + _others(n) for n in fleet.nodes]
        else:
            lines.append(f"No node has a free {device_class} now.")
    return "\n".join(lines) + "\n"


def _others(node: NodeWithFree) -> str:
    """The node's labels beyond its job (``{cluster="eu-1"}``), where it has any."""
    others = [f'{k}="{v}"' for k, v in node.labels if k != "job"]
    return f"  {{{', '.join(others)}}}" if others else ""
