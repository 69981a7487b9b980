"""``mig-exporter fleet``: the fleet by device class, asked of a Prometheus that scrapes the
exporters, through its HTTP query API (``/api/v1/query``, the standard library's urllib and
json: no PromQL result is parsed by hand). The planner's question, "is there one free 3g.40gb
instance, and where?", answered from the metrics.

It asks the shipped recording rules' expressions, not their recorded names, so it answers
from a Prometheus that does not load the rules too; the counting is the rules' own (free: a
device whose ``mig_exporter_device_processes`` is 0; a probe target's series never count).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

# The exporter's own /metrics series only: a probe target exports the device families but no
# build_info. The same guard as deploy/prometheus/alerts.yml's capacity rules.
_OWN = "and ignoring (class, version) last_over_time(mig_exporter_build_info[3m])"
_DEVICE_LABELS = "index, card, mig_profile, uuid, gpu_instance, compute_instance, name, device"
DEVICES_PER_NODE = f"count without ({_DEVICE_LABELS}) (mig_exporter_device_info) {_OWN}"
FREE_PER_NODE = (
    f"count without ({_DEVICE_LABELS}) ("
    "mig_exporter_device_info and ignoring (uuid, gpu_instance, compute_instance, class, name, device) "
    f"(mig_exporter_device_processes == 0)) {_OWN}"
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


@dataclass(frozen=True, slots=True)
class Fleet:
    classes: tuple[ClassInFleet, ...]
    # With a class asked for: each node with at least one free device of it, most free first.
    nodes: tuple[NodeWithFree, ...] | None = None


class PrometheusClient:
    """Instant queries against one Prometheus (or anything that serves its query API:
    Thanos Query, Mimir, VictoriaMetrics)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise FleetError(f"{url}: not an http:// or https:// URL")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector ``promql`` gives now: each element's ``metric`` and ``value``."""
        endpoint = f"{self.url}/api/v1/query"
        data = urllib.parse.urlencode({"query": promql}).encode()
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
        except (TimeoutError, OSError) as e:
            raise FleetError(f"{endpoint}: {e}") from None
        try:
            answer = json.loads(body)
        except ValueError:
            raise FleetError(f"{endpoint}: the answer is not JSON (is this a Prometheus?)") from None
        if not isinstance(answer, dict) or answer.get("status") != "success":
            raise FleetError(f"{endpoint}: {_error_of(body) or 'the answer is not a success'}")
        result = answer.get("data", {})
        if result.get("resultType") != "vector":
            raise FleetError(f"{endpoint}: expected an instant vector, got {result.get('resultType')!r}")
        return list(result.get("result", []))


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
    devices = {e["metric"].get("class", ""): _number(e)
               for e in client.query(f"sum by (class) ({DEVICES_PER_NODE})")}
    free = {e["metric"].get("class", ""): _number(e) for e in client.query(f"sum by (class) ({FREE_PER_NODE})")}
    classes = tuple(ClassInFleet(name, count, free.get(name, 0)) for name, count in sorted(devices.items()))
    if device_class is None:
        return Fleet(classes)
    # A PromQL string literal is a JSON string literal: any class name is matched as it is.
    of_class = f"mig_exporter_device_info{{class={json.dumps(device_class)}}}"
    per_node = client.query(f"sum by (instance) ({FREE_PER_NODE.replace('mig_exporter_device_info', of_class, 1)})")
    nodes = sorted((NodeWithFree(e["metric"].get("instance", ""), _number(e)) for e in per_node),
                   key=lambda n: (-n.free, n.instance))
    return Fleet(classes, tuple(n for n in nodes if n.free > 0))


def as_json(fleet: Fleet) -> dict[str, Any]:
    out: dict[str, Any] = {"classes": [{"class": c.device_class, "devices": c.devices, "free": c.free}
                                       for c in fleet.classes]}
    if fleet.nodes is not None:
        out["nodes"] = [{"instance": n.instance, "free": n.free} for n in fleet.nodes]
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
            lines += [f"  {n.instance}  {n.free} free" for n in fleet.nodes]
        else:
            lines.append(f"No node has a free {device_class} now.")
    return "\n".join(lines) + "\n"
