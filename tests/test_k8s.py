"""deploy/k8s: the kustomization rendered as kubectl would, core kinds checked
with kubernetes-validate --strict (offline), the Prometheus Operator objects
checked for structure, and the DaemonSet carrying what a GPU node needs."""

from __future__ import annotations

import copy
import subprocess

import yaml

from conftest import REPO, require_tool
from mig_exporter.config.file import parse_config

K8S = REPO / "deploy" / "k8s"
CORE_KINDS = {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "Service"}
CLUSTER_SCOPED = {"Namespace"}
# Every monitor endpoint's: node, and instance too, the node's name (the dashboards' Node variable
# lists instance; a pod's address changes with each pod).
NODE_RELABELINGS = [{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"},
                    {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "instance"}]


def render(path=K8S) -> list[dict]:
    """The kustomization's resources with its namespace and labels applied
    (the subset of kustomize this kustomization uses)."""
    kustomization = yaml.safe_load((path / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "namespace", "labels", "resources", "components"}, \
        "the renderer handles only these kustomize fields; extend it with the kustomization"
    docs = []
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((path / resource).read_text()):
            if doc is None:
                continue
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = kustomization["namespace"]
            for entry in kustomization.get("labels", []):
                doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
            docs.append(doc)
    return docs


def by_kind(docs: list[dict]) -> dict[str, dict]:
    out = {}
    for doc in docs:
        assert doc["kind"] not in out, f"two {doc['kind']} objects"
        out[doc["kind"]] = doc
    return out


def test_every_resource_is_rendered_once():
    kinds = by_kind(render())
    assert set(kinds) == CORE_KINDS | {"ServiceMonitor", "PrometheusRule"}
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "mig-exporter" for d in kinds.values())
    assert {d["metadata"].get("namespace") for k, d in kinds.items() if k != "Namespace"} == {"mig-exporter"}


def test_core_kinds_pass_kubernetes_validate_strict(tmp_path):
    tool = require_tool("kubernetes-validate")
    for doc in render():
        if doc["kind"] not in CORE_KINDS:
            continue
        path = tmp_path / f"{doc['kind'].lower()}.yaml"
        path.write_text(yaml.safe_dump(doc))
        result = subprocess.run([tool, "--strict", "--quiet", str(path)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{doc['kind']}: {result.stdout}{result.stderr}"


def test_kubernetes_validate_rejects_a_broken_daemonset(tmp_path):
    """The check above can fail: a misspelt field is an error under --strict."""
    tool = require_tool("kubernetes-validate")
    daemonset = copy.deepcopy(by_kind(render())["DaemonSet"])
    daemonset["spec"]["template"]["spec"]["hostPid"] = True
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(daemonset))
    result = subprocess.run([tool, "--strict", "--quiet", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0


def test_the_daemonset_has_what_a_gpu_node_needs():
    kinds = by_kind(render())
    pod = kinds["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0] == {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # GPU Operator v25.10 and later (CDI on by default) no longer make nvidia the default runtime:
    # without the class the pod gets no driver. components/default-runtime drops it.
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["priorityClassName"] == "system-node-critical"
    (container,) = pod["containers"]
    assert container["args"][0] == "serve"
    assert "--proc.root=/host/proc" in container["args"]
    assert "--config.file=/etc/mig-exporter/config.yaml" in container["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    # No NVIDIA_MIG_MONITOR_DEVICES: the runtime hook refuses it without CAP_SYS_ADMIN
    # (components/mig-monitor adds both).
    assert env == {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "utility",
                   "MIG_EXPORTER_WEB_NODE_NAME": None}  # from spec.nodeName: the page names the node
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    # uid 0 for the kubelet's root-owned socket, and nothing else of root's: no capability, read-only mounts.
    assert pod["securityContext"]["runAsUser"] == 0 and pod["securityContext"]["runAsNonRoot"] is False
    assert all(m.get("readOnly") for m in container["volumeMounts"] if m["name"] != "tmp")
    assert container["livenessProbe"]["httpGet"]["path"] == "/-/healthy"
    assert container["readinessProbe"]["httpGet"]["path"] == "/-/ready"
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["host-proc"] == {"name": "host-proc", "mountPath": "/host/proc", "readOnly": True}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["host-proc"]["hostPath"]["path"] == "/proc"
    # The pod-resources socket's directory, at the path the socket flag names.
    assert mounts["pod-resources"] == {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources",
                                       "readOnly": True}
    assert volumes["pod-resources"]["hostPath"] == {"path": "/var/lib/kubelet/pod-resources"}
    assert "--kubelet.pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock" in container["args"]
    # The kubelet's log directories under the log dir the flag names.
    assert "--kubelet.log-dir=/host/var/log" in container["args"]
    for name, host in (("pod-logs", "/var/log/pods"), ("container-logs", "/var/log/containers")):
        assert mounts[name] == {"name": name, "mountPath": "/host" + host, "readOnly": True}
        assert volumes[name]["hostPath"] == {"path": host}
    assert volumes["config"]["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]
    # The driver-root probe target's nvidia-smi, under the GPU Operator's driver root.
    assert mounts["run-nvidia"] == {"name": "run-nvidia", "mountPath": "/run/nvidia", "readOnly": True,
                                    "mountPropagation": "HostToContainer"}
    assert volumes["run-nvidia"]["hostPath"] == {"path": "/run/nvidia", "type": "DirectoryOrCreate"}
    assert pod["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]


def test_the_namespace_allows_host_pid():
    namespace = by_kind(render())["Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_configmap_holds_a_valid_config():
    config = parse_config(by_kind(render())["ConfigMap"]["data"]["config.yaml"], "configmap.yaml")
    assert "koboldcpp" in config.engines.engines
    assert config.probe_targets["driver-root"].command == ("/run/nvidia/driver/usr/bin/nvidia-smi",)


def test_service_and_servicemonitor_point_at_the_pods_metrics_port():
    kinds = by_kind(render())
    pod_labels = kinds["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    service = kinds["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    container_ports = {p["name"]: p["containerPort"] for p in kinds["DaemonSet"]["spec"]["template"]["spec"]
                       ["containers"][0]["ports"]}
    assert port["targetPort"] == "metrics" and container_ports["metrics"] == 10064
    monitor = kinds["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "honorLabels", "relabelings"}
    # The exporter's namespace/pod/container name the workload; the Operator's target labels
    # of those names (the exporter's own pod) must not rename them to exported_*.
    assert endpoint["honorLabels"] is True
    assert endpoint["relabelings"] == NODE_RELABELINGS


def test_the_prometheus_rule_is_an_operator_object():
    rule = by_kind(render())["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"}
        for r in group["rules"]:
            assert ("alert" in r) != ("record" in r) and "expr" in r


def component(name: str) -> tuple[dict, list[dict]]:
    """A component of deploy/k8s/components: its kustomization, and its one patch's JSON patch ops."""
    kustomization = yaml.safe_load((K8S / "components" / name / "kustomization.yaml").read_text())
    (patch,) = kustomization["patches"]
    return kustomization, yaml.safe_load(patch["patch"])


def test_the_default_runtime_component_drops_the_runtime_class():
    kustomization, ops = component("default-runtime")
    assert kustomization["kind"] == "Component"
    assert kustomization["patches"][0]["target"] == {"kind": "DaemonSet", "name": "mig-exporter"}
    daemonset = apply_patch(by_kind(render())["DaemonSet"], ops)
    assert "runtimeClassName" not in daemonset["spec"]["template"]["spec"]


def test_the_mig_monitor_component_adds_the_variable_with_the_capability_the_hook_asks():
    kustomization, ops = component("mig-monitor")
    assert kustomization["patches"][0]["target"] == {"kind": "DaemonSet", "name": "mig-exporter"}
    (container,) = apply_patch(by_kind(render())["DaemonSet"], ops)["spec"]["template"]["spec"]["containers"]
    assert container["env"][-1] == {"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"}
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}


def apply_patch(doc: dict, ops: list[dict]) -> dict:
    """The JSON patch ops the components use (add, replace, remove; RFC 6902: "-" appends
    to a list, and remove and replace need the member), applied as kustomize does."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] in ("add", "replace", "remove")
        *parents, last = op["path"].lstrip("/").split("/")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "remove":
            assert last in node, op
            del node[last]
        elif isinstance(node, list) and last == "-":
            assert op["op"] == "add"
            node.append(op["value"])
        elif isinstance(node, list):
            assert op["op"] == "replace" and int(last) < len(node)
            node[int(last)] = op["value"]
        else:
            assert (last in node) == (op["op"] == "replace"), op
            node[last] = op["value"]
    return doc


def test_the_non_root_component_runs_as_nobody_and_asks_no_kubelet():
    kustomization, ops = component("non-root")
    assert kustomization["kind"] == "Component"
    assert kustomization["patches"][0]["target"] == {"kind": "DaemonSet", "name": "mig-exporter"}
    daemonset = apply_patch(by_kind(render())["DaemonSet"], ops)
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 65534 and pod["securityContext"]["runAsNonRoot"] is True
    args = pod["containers"][0]["args"]
    assert "--kubelet.pod-resources-socket=" in args
    assert not any(a.startswith("--kubelet.pod-resources-socket=/") for a in args)
    assert "--kubelet.log-dir=/host/var/log" in args
