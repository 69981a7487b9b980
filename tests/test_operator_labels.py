"""Issue 35: the pod attribution survives the Prometheus Operator's target labels.

A real Prometheus scrapes the e2e node (test_e2e.e2e_exporter: the demo's GPUs, the
pods of kube_node.py) with the scrape config the Prometheus Operator generates for
the chart's rendered ServiceMonitor, or PodMonitor, with the shipped rules loaded.

The Operator puts `namespace`, `pod`, `container`, `service` (ServiceMonitor only),
`endpoint` and `job` on every target, each from its service-discovery label. The
exporter writes `namespace`, `pod` and `container` on its own series to name the
workload that holds the memory. With `honor_labels: false` (the Operator's default)
Prometheus keeps the target's and renames the exporter's to `exported_*`: every
pod's memory is then the exporter pod's. The chart sets `honorLabels: true`.

What the Operator generates, from prometheus-operator/prometheus-operator
pkg/prometheus/promcfg.go (as stored at commit 002266347d12f6ee0ef0b4a774dfcc613d2d9547):

- `generateServiceMonitorConfig`: job_name `serviceMonitor/<ns>/<name>/<i>`;
  `AddHonorLabels(cfg, ep.HonorLabels)` writes `honor_labels` (forced false when the
  Prometheus resource sets `overrideHonorLabels`); interval, scrapeTimeout, path,
  params, scheme as `scrape_interval`, `scrape_timeout`, `metrics_path`, `params`,
  `scheme`; relabel_configs: `initRelabelings()` (job -> __tmp_prometheus_job_name), a
  `keep` per selector matchLabel on `__meta_kubernetes_service_label_<k>` and
  `..._labelpresent_<k>`, a `keep` of the port on `__meta_kubernetes_endpoint_port_name`,
  `node`/`pod` from `__meta_kubernetes_endpoint_address_target_kind`/`_name`
  (`Node;(.*)`, `Pod;(.*)`), `namespace` <- `__meta_kubernetes_namespace`, `service` <-
  `__meta_kubernetes_service_name`, `pod` <- `__meta_kubernetes_pod_name`, `container`
  <- `__meta_kubernetes_pod_container_name`, the running filter (drop
  `__meta_kubernetes_pod_phase` Failed|Succeeded), the spec's targetLabels (from the
  Service's labels) and podTargetLabels (the pod's), `job` <- `__meta_kubernetes_service_name`,
  then from the Service's label named by jobLabel where set, `endpoint` = the endpoint's
  port name, then the scrape class's relabelings and last the endpoint's `relabelings`;
  the endpoint's `metricRelabelings` become `metric_relabel_configs` (after the scrape
  class's).
- `generatePodMonitorConfig`: job_name `podMonitor/<ns>/<name>/<i>`; the running filter
  first, `keep`s on `__meta_kubernetes_pod_label_<k>`/`..._labelpresent_<k>` and on
  `__meta_kubernetes_pod_container_port_name`; `namespace`, `container`, `pod` as above
  (no `service`); podTargetLabels; `job` = `<ns>/<name>` of the PodMonitor, then from the
  pod's label named by jobLabel where set; `endpoint`; the endpoint's relabelings last;
  metricRelabelings as above.
- Either discovers the monitor's namespace, or those of its namespaceSelector.
- `generateRelabelConfig`: a RelabelConfig's sourceLabels, separator, targetLabel,
  regex, modulus, replacement, action as source_labels, separator, target_label, regex,
  modulus, replacement, action (lower-cased).

The sharding relabelings (`hashmod` of __address__, kept where it is `$(SHARD)`) are
left out: one shard keeps every target. No Kubernetes service discovery runs here, so
the target is given the `__meta_kubernetes_*` labels it would have (the exporter's pod
mig-exporter-7xk2p on node gpu-node-1, its Service's and pod template's labels as the
chart renders them) as static_configs labels, and the Operator's relabelings make the
target labels from them. Only the intervals are shortened.

Series the exporter writes with an empty `pod` (a host process's process_info: on the
demo node every process with memory is in a pod, so the chart's own /probe endpoint,
which attributes nothing, shows it) keep no pod: Prometheus finds the label in the
scrape and does not add the target's, and an empty value is no label (Prometheus'
honor_labels semantics since prometheus/prometheus#3845). Series that have no `pod`
label at all (device, card, engine, build_info ...) get the target's, the exporter
pod's, as they would without honor_labels: the rules that name pods read them only
from process_info, pod_memory_used_bytes and device_allocation_info, but the alerts
that keep every label of such a series (EngineHoldsNoGPUMemory, the card alerts) carry
the exporter pod's namespace, pod and container.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from conftest import MIB
from kube_node import BY_PID, LLAMA, NOTEBOOK, TRAINER, VK_LLAMA, VLLM
from test_e2e import PROBED, _firing, _rules_with_short_for, _wait, e2e_exporter
from test_helm import NAMESPACE, one, render
from test_prometheus import STARTUP_S, Prometheus, _prometheus_binary, prometheus

pytestmark = pytest.mark.prometheus

EXPORTER_POD = "mig-exporter-7xk2p"
NODE = "gpu-node-1"
# The chart's /probe endpoint for the e2e exporter's probe target alone (null takes the
# default driver-root away): the exporter's config file is e2e_exporter's, so only the
# name matters here.
PROBE = {"probe": {"scrape": True, "targets": {"driver-root": None, PROBED: {"command": ["/host/usr/bin/nvidia-smi"]}}}}
MONITORS = {
    "ServiceMonitor": {},
    "PodMonitor": {"serviceMonitor": {"enabled": False}, "podMonitor": {"enabled": True}},
}
# The families the exporter writes namespace, pod and container on: the workload's.
ATTRIBUTED = {"mig_exporter_process_info", "mig_exporter_pod_memory_used_bytes", "mig_exporter_device_allocation_info"}
# kube_node.py's pods holding memory, with what they hold on the demo (samples/demo.xml).
POD_MEMORY = {
    (LLAMA.namespace, LLAMA.pod): 11520 * MIB,
    (VLLM.namespace, VLLM.pod): 9216 * MIB,
    (VK_LLAMA.namespace, VK_LLAMA.pod): 20480 * MIB,
    (NOTEBOOK.namespace, NOTEBOOK.pod): 1620 * MIB,
}

# What this translation knows of a monitor; anything else the chart renders fails the test
# until it is translated too.
KNOWN_SPEC = {"selector", "endpoints", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "targetLabels",
              "podTargetLabels"}
KNOWN_ENDPOINT = {"port", "path", "params", "interval", "scrapeTimeout", "honorLabels", "relabelings",
                  "metricRelabelings"}
RELABEL_FIELDS = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _relabel(config: dict) -> dict:
    """An Operator RelabelConfig as Prometheus' relabel_config (generateRelabelConfig)."""
    assert set(config) <= RELABEL_FIELDS, f"not a RelabelConfig field: {set(config) - RELABEL_FIELDS}"
    return {re.sub(r"([A-Z])", r"_\1", k).lower(): (v.lower() if k == "action" else v) for k, v in config.items()}


def _discovered(docs: list[dict], kind: str) -> dict[str, str]:
    """The __meta_kubernetes_* labels Kubernetes service discovery gives the exporter's
    pod (role pod for a PodMonitor, endpoints for a ServiceMonitor), from the rendered
    DaemonSet and Service."""
    template = one(docs, "DaemonSet")["spec"]["template"]
    (container,) = [c for c in template["spec"]["containers"] if c.get("ports")]
    (port,) = container["ports"]
    meta = {
        "__meta_kubernetes_namespace": NAMESPACE,
        "__meta_kubernetes_pod_name": EXPORTER_POD,
        "__meta_kubernetes_pod_node_name": NODE,
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_container_name": container["name"],
        "__meta_kubernetes_pod_container_port_name": port["name"],
    }
    for k, v in template["metadata"]["labels"].items():
        meta |= {f"__meta_kubernetes_pod_label_{_sanitize(k)}": v,
                 f"__meta_kubernetes_pod_labelpresent_{_sanitize(k)}": "true"}
    if kind == "ServiceMonitor":
        service = one(docs, "Service")
        (service_port,) = service["spec"]["ports"]
        meta |= {
            "__meta_kubernetes_service_name": service["metadata"]["name"],
            "__meta_kubernetes_endpoint_port_name": service_port["name"],
            "__meta_kubernetes_endpoint_address_target_kind": "Pod",
            "__meta_kubernetes_endpoint_address_target_name": EXPORTER_POD,
        }
        for k, v in service["metadata"]["labels"].items():
            meta |= {f"__meta_kubernetes_service_label_{_sanitize(k)}": v,
                     f"__meta_kubernetes_service_labelpresent_{_sanitize(k)}": "true"}
    return meta


def operator_scrape_config(kind: str, monitor: dict, i: int, endpoint: dict, address: str,
                           meta: dict[str, str]) -> dict:
    """The scrape config the Operator generates for endpoint ``i`` of ``monitor``, its
    target the static ``address`` with the discovered labels ``meta``."""
    spec = monitor["spec"]
    assert set(spec) <= KNOWN_SPEC, f"{kind} fields this test does not translate: {set(spec) - KNOWN_SPEC}"
    assert set(endpoint) <= KNOWN_ENDPOINT, f"endpoint fields not translated: {set(endpoint) - KNOWN_ENDPOINT}"
    assert set(spec["selector"]) == {"matchLabels"}
    # The Operator discovers the monitor's own namespace, else those of its namespaceSelector.
    ns, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    watched = spec.get("namespaceSelector", {})
    assert watched.get("any") or NAMESPACE in watched.get("matchNames", [ns]), "the exporter's pods are not discovered"
    service = kind == "ServiceMonitor"
    kept = "service" if service else "pod"

    def copied(source: str, names: list[str], target: str | None = None) -> list[dict]:
        return [{"source_labels": [f"__meta_kubernetes_{source}_label_{_sanitize(n)}"],
                 "target_label": target or _sanitize(n), "regex": "(.+)", "replacement": "${1}"} for n in names]
    running = {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}
    relabel = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
    if not service:
        relabel.append(running)
    relabel += [{"action": "keep", "regex": f"({v});true",
                 "source_labels": [f"__meta_kubernetes_{kept}_label_{_sanitize(k)}",
                                   f"__meta_kubernetes_{kept}_labelpresent_{_sanitize(k)}"]}
                for k, v in sorted(spec["selector"]["matchLabels"].items())]
    port_name = "__meta_kubernetes_endpoint_port_name" if service else "__meta_kubernetes_pod_container_port_name"
    relabel.append({"action": "keep", "source_labels": [port_name], "regex": endpoint["port"]})
    target = ["__meta_kubernetes_endpoint_address_target_kind", "__meta_kubernetes_endpoint_address_target_name"]
    if service:
        relabel += [
            {"source_labels": target, "separator": ";", "regex": "Node;(.*)", "replacement": "${1}",
             "target_label": "node"},
            {"source_labels": target, "separator": ";", "regex": "Pod;(.*)", "replacement": "${1}",
             "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            running,
            *copied("service", spec.get("targetLabels", [])),
            *copied("pod", spec.get("podTargetLabels", [])),
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"},
        ]
    else:
        relabel += [
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            *copied("pod", spec.get("podTargetLabels", [])),
            {"target_label": "job", "replacement": f"{ns}/{name}"},
        ]
    if spec.get("jobLabel"):
        relabel += copied(kept, [spec["jobLabel"]], "job")
    relabel.append({"target_label": "endpoint", "replacement": endpoint["port"]})
    relabel += [_relabel(r) for r in endpoint.get("relabelings", [])]

    config: dict = {
        "job_name": f"{'serviceMonitor' if service else 'podMonitor'}/{ns}/{name}/{i}",
        "honor_labels": endpoint.get("honorLabels", False),
        "static_configs": [{"targets": [address], "labels": meta}],
        # The endpoint's interval and scrapeTimeout, shortened.
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "relabel_configs": relabel,
    }
    if "path" in endpoint:
        config["metrics_path"] = endpoint["path"]
    if "params" in endpoint:
        config["params"] = endpoint["params"]
    if endpoint.get("metricRelabelings"):
        config["metric_relabel_configs"] = [_relabel(r) for r in endpoint["metricRelabelings"]]
    return config


def _endpoints(monitor: dict) -> list[dict]:
    return monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]


@contextmanager
def operator_scraped_node(fake_nvidia_smi, fake_kubelet, tmp_path: Path, kind: str,
                          values: dict) -> Iterator[tuple[Prometheus, dict, list[dict]]]:
    """The e2e exporter scraped as the Operator would scrape the chart's ``kind`` rendered
    with ``values``: yields Prometheus, the monitor and its scrape configs once every
    endpoint's target has been scraped twice."""
    _prometheus_binary()
    docs = render(values)
    monitor = one(docs, kind)
    rules = _rules_with_short_for(tmp_path)
    with e2e_exporter(fake_nvidia_smi, fake_kubelet, tmp_path) as exp:
        meta = _discovered(docs, kind)
        scrape_configs = [operator_scrape_config(kind, monitor, i, ep, exp.address, meta)
                          for i, ep in enumerate(_endpoints(monitor))]
        config = yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": scrape_configs,
        })
        with prometheus("", tmp_path, config) as prom:
            deadline = time.monotonic() + STARTUP_S
            while True:
                targets = prom.get("/api/v1/targets", state="active")["activeTargets"]
                scraped = [float(s["value"][1]) for s in prom.query("count_over_time(up[1m])")]
                if (len(targets) == len(scrape_configs) and all(t["health"] == "up" for t in targets)
                        and len(scraped) == len(scrape_configs) and min(scraped) >= 2):
                    break
                assert time.monotonic() < deadline, f"targets not scraped twice: {targets}\n{prom.log()}"
                time.sleep(0.2)
            yield prom, monitor, scrape_configs


def _jobs(prom: Prometheus) -> tuple[str, str]:
    """The job of the /metrics target and of the /probe one."""
    jobs = {t["labels"]["job"]: t["scrapeUrl"] for t in prom.get("/api/v1/targets", state="active")["activeTargets"]}
    (metrics,) = [j for j, url in jobs.items() if url.endswith("/metrics")]
    (probe,) = [j for j, url in jobs.items() if f"/probe?target={PROBED}" in url]
    return metrics, probe


def _attribution(prom: Prometheus, promql: str) -> dict[tuple[str, str], float]:
    return {(s["metric"].get("namespace", ""), s["metric"].get("pod", "")): float(s["value"][1])
            for s in prom.query(promql)}


def _alerted(prom: Prometheus, name: str) -> list[tuple[str, str, str, str]]:
    return sorted((a["labels"]["namespace"], a["labels"]["pod"], a["labels"]["index"], a["labels"].get("node", ""))
                  for a in _wait("alert", lambda: _firing(prom, name)))


@pytest.mark.parametrize("kind", MONITORS)
def test_the_operators_scrape_of_the_chart_keeps_the_workloads_pods(fake_nvidia_smi, fake_kubelet, tmp_path, kind):
    with operator_scraped_node(fake_nvidia_smi, fake_kubelet, tmp_path, kind, MONITORS[kind] | PROBE) as (
            prom, _, configs):
        assert [c["honor_labels"] for c in configs] == [True, True], "the chart honours the exporter's labels"
        metrics_job, probe_job = _jobs(prom)
        assert metrics_job == ("mig-exporter" if kind == "ServiceMonitor" else "mig-exporter/mig-exporter")
        assert probe_job == "mig-exporter-probe"
        (target,) = [t for t in prom.get("/api/v1/targets", state="active")["activeTargets"]
                     if t["labels"]["job"] == metrics_job]
        assert target["labels"] == {
            "namespace": NAMESPACE, "pod": EXPORTER_POD, "container": "mig-exporter", "endpoint": "metrics",
            "job": metrics_job, "instance": NODE, "node": NODE,
            **({"service": "mig-exporter"} if kind == "ServiceMonitor" else {})}

        # Memory by pod: the workloads', never the exporter's.
        assert _attribution(prom, "sum by (namespace, pod) (mig_exporter_pod_memory_used_bytes)") == POD_MEMORY
        processes = {(s["metric"]["pid"], s["metric"]["namespace"], s["metric"]["pod"], s["metric"]["container"])
                     for s in prom.query(f'mig_exporter_process_info{{job="{metrics_job}"}}')}
        assert processes == {(str(pid), w.namespace, w.pod, w.container) for pid, w in BY_PID.items()}
        for label in ("exported_namespace", "exported_pod", "exported_container", "exported_job",
                      "exported_instance", "exported_endpoint", "exported_service"):
            assert prom.query(f'{{{label}=~".+"}}') == [], label

        # The allocation alerts name the workloads, and the node from the chart's relabeling.
        assert _alerted(prom, "GPUProcessOutsideAllocation") == [(NOTEBOOK.namespace, NOTEBOOK.pod, "1", NODE)]
        assert _alerted(prom, "GPUAllocatedButUnused") == [(TRAINER.namespace, TRAINER.pod, "1002", NODE)]
        # Neither names the exporter's pod; the alerts that do carry it are about a card, whose
        # series have no pod label, so they keep the target's. The engine on no GPU's list is a
        # host process here, and its alert drops the target's pod labels rather than name the
        # exporter's pod as its owner.
        alerts = prom.get("/api/v1/alerts")["alerts"]
        assert {a["labels"]["alertname"] for a in alerts if a["labels"].get("pod") == EXPORTER_POD} <= {
            "GPUCardNeedsReset", "GPUPCIeLinkWidthDegraded"}
        engine = _wait("engine alert", lambda: _firing(prom, "EngineHoldsNoGPUMemory"))
        assert [(a["labels"]["pid"], a["labels"].get("namespace"), a["labels"].get("pod")) for a in engine] == [
            ("52040", None, None)]

        # Empty labels: /probe attributes nothing (pod="" on every process_info it writes), and
        # with honor_labels Prometheus keeps them empty, not the exporter pod's.
        probed = prom.query(f'mig_exporter_process_info{{job="{probe_job}"}}')
        assert len(probed) == 4
        assert [{k: s["metric"].get(k) for k in ("namespace", "pod", "container")} for s in probed] == [
            {"namespace": None, "pod": None, "container": None}] * 4
        # The series the exporter writes no pod label on take the target's: every family but the
        # attributed ones, from /metrics and /probe alike.
        by_family = prom.query('count by (__name__, job, namespace, pod, container) ({__name__=~"mig_exporter_.+"})')
        exporters = {(s["metric"]["__name__"], s["metric"]["job"]) for s in by_family
                     if (s["metric"].get("namespace"), s["metric"].get("pod"), s["metric"].get("container"))
                     == (NAMESPACE, EXPORTER_POD, "mig-exporter")}
        families = {(s["metric"]["__name__"], s["metric"]["job"]) for s in by_family}
        assert exporters == {f for f in families if f[0] not in ATTRIBUTED}
        assert ("mig_exporter_device_memory_used_bytes", metrics_job) in exporters
        # ...and no rule reads a pod from them: the work on each device is the workload's.
        work = {(s["metric"]["index"], s["metric"]["work"])
                for s in prom.query(f'instance_card_work:mig_exporter_process_info:count{{job="{metrics_job}"}}')}
        assert work == {(i, f"pod {w.namespace}/{w.pod}") for i, w in [
            ("1000", LLAMA), ("1001", VLLM), ("1", VK_LLAMA), ("1", NOTEBOOK)]}


def test_without_honor_labels_every_pod_is_the_exporters(fake_nvidia_smi, fake_kubelet, tmp_path):
    """The defect of issue 35, with the chart's own switch turned off (the ServiceMonitor's;
    the PodMonitor's endpoint is translated the same way): the exporter's labels become
    exported_*, the memory is all the exporter pod's, the notebook's use of a card it was
    not given goes unseen and the unused device is the exporter's."""
    values = {"serviceMonitor": {"honorLabels": False}}
    with operator_scraped_node(fake_nvidia_smi, fake_kubelet, tmp_path, "ServiceMonitor", values) as (
            prom, _, configs):
        assert [c["honor_labels"] for c in configs] == [False]
        assert _attribution(prom, "sum by (namespace, pod) (mig_exporter_pod_memory_used_bytes)") == {
            (NAMESPACE, EXPORTER_POD): sum(POD_MEMORY.values())}
        exported = {(s["metric"]["exported_namespace"], s["metric"]["exported_pod"]): float(s["value"][1])
                    for s in prom.query("mig_exporter_pod_memory_used_bytes")}
        assert exported == POD_MEMORY
        processes = prom.query("mig_exporter_process_info")
        assert {s["metric"]["pod"] for s in processes} == {EXPORTER_POD}
        assert {s["metric"]["exported_pod"] for s in processes} == {w.pod for w in BY_PID.values()}

        assert _alerted(prom, "GPUAllocatedButUnused") == [(NAMESPACE, EXPORTER_POD, "1002", NODE)]
        # Evaluated with the other: the notebook's use of card 1 hides behind the exporter pod,
        # to which every device is "allocated".
        assert [a for a in prom.get("/api/v1/alerts")["alerts"]
                if a["labels"]["alertname"] == "GPUProcessOutsideAllocation"] == []
