"""deploy/helm/mig-exporter: the chart rendered, linted and packaged by Helm's own code
(helm-python-sdk's libhelm), every switch; every object checked with
kubernetes-validate against Kubernetes 1.28 and 1.37 and the Prometheus Operator's
schemas; the DaemonSet, rules and dashboards held equal to deploy/k8s,
deploy/prometheus and dashboards/grafana."""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import tarfile
from functools import cache
from pathlib import Path

import bcrypt
import pydantic
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as operator
from helm_python import chart as helm
from helm_python.errors import HelmRenderError, HelmValuesError

import test_k8s
from certs import make_pki
from conftest import REPO, require_tool
from mig_exporter import __version__
from mig_exporter.cli import serve
from mig_exporter.config.file import parse_config
from mig_exporter.web.webconfig import parse_web_config

CHART = REPO / "deploy" / "helm" / "mig-exporter"
RELEASE = NAMESPACE = "mig-exporter"   # what deploy/k8s is: a release of that name, in its namespace
OPERATOR_KINDS = {"ServiceMonitor": operator.ServiceMonitor, "PodMonitor": operator.PodMonitor,
                  "PrometheusRule": operator.PrometheusRule}
# What Helm adds to every object and deploy/k8s has no use for: the rest must be equal.
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/version")
HELM_POD_ANNOTATIONS = ("checksum/config", "checksum/web-config")
BCRYPT_HASH = bcrypt.hashpw(b"scrape-me", bcrypt.gensalt(4)).decode()
PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n"

# Every switch and variant, each rendered, linted, validated and parsed by the CLI below.
VARIANTS: dict[str, dict] = {
    "defaults": {},
    "non-root": {"nonRoot": True},
    "runtime class and priority": {"runtimeClassName": "nvidia", "priorityClassName": "system-node-critical"},
    "TLS from values": {"tls": {"enabled": True, "cert": PEM, "key": KEY}},
    "TLS from a Secret": {"tls": {"enabled": True, "existingSecret": "mig-exporter-cert"},
                          "serviceMonitor": {"tlsConfig": {"insecureSkipVerify": True}}},
    "basic auth": {"basicAuth": {"users": {"prometheus": BCRYPT_HASH}},
                   "serviceMonitor": {"basicAuth": {"username": {"name": "scrape", "key": "user"},
                                                    "password": {"name": "scrape", "key": "password"}}}},
    "web config from a Secret": {"webConfig": {"existingSecret": "my-web-config"}},
    "config from a ConfigMap": {"config": {"existingConfigMap": "my-config"}},
    "PodMonitor": {"serviceMonitor": {"enabled": False}, "podMonitor": {
        "enabled": True, "additionalLabels": {"release": "kps"}, "interval": "30s", "scrapeTimeout": "20s"}},
    "probe targets scraped": {"probe": {"scrape": True, "interval": "1m", "targets": {
        "driver-root": {"command": ["/run/nvidia/driver/usr/bin/nvidia-smi"], "timeout": "10s"},
        "host": {"command": ["/host/usr/bin/nvidia-smi"]}}}},
    "PodMonitor over TLS with basic auth, probes scraped": {
        "serviceMonitor": {"enabled": False}, "tls": {"enabled": True, "existingSecret": "mig-exporter-cert"},
        "basicAuth": {"users": {"prometheus": BCRYPT_HASH}}, "probe": {"scrape": True, "interval": "30s"},
        "podMonitor": {"enabled": True, "tlsConfig": {"insecureSkipVerify": True},
                       "basicAuth": {"username": {"name": "scrape", "key": "user"},
                                     "password": {"name": "scrape", "key": "password"}}}},
    "NetworkPolicy": {"networkPolicy": {"enabled": True}},
    "dashboards in a folder elsewhere": {"dashboards": {"folder": "GPU", "namespace": "monitoring",
                                                        "labels": {"grafana_dashboard": "1", "team": "ml"}}},
    "nothing optional": {"service": {"enabled": False}, "serviceMonitor": {"enabled": False},
                         "prometheusRule": {"enabled": False}, "dashboards": {"enabled": False}},
    "everything extra": {
        "image": {"repository": "registry.example/mig-exporter", "tag": "0.1.0-rc1", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "registry"}], "port": 9464, "logLevel": "warn",
        "extraArgs": ["--collector.processes=top=3"], "env": [{"name": "TZ", "value": "UTC"}],
        "nodeSelector": {"node-role.example/gpu": "true"}, "tolerations": [{"operator": "Exists"}],
        "affinity": None, "podAnnotations": {"example.com/team": "ml"}, "podLabels": {"team": "ml"},
        "extraVolumes": [{"name": "extra", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra", "readOnly": True}],
        "hostPaths": {"podResources": "/var/snap/microk8s/common/var/lib/kubelet/pod-resources",
                      "logs": "/var/snap/microk8s/common/var/log"},
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "serviceAccount": {"create": False, "name": "gpu-monitoring"},
        "serviceMonitor": {"additionalLabels": {"release": "kps"}, "interval": "30s"},
        "prometheusRule": {"additionalLabels": {"release": "kps"}},
        "fullnameOverride": "gpu-memory",
        "updateStrategy": {"type": "OnDelete"},
    },
}


@cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render_files(values: dict | None = None, name: str = RELEASE) -> dict[str, str]:
    return _chart().render(copy.deepcopy(values), name=name, namespace=NAMESPACE, is_install=True)


def render(values: dict | None = None, name: str = RELEASE) -> list[dict]:
    """The objects a `helm install` of these values would create."""
    docs = []
    for path, text in sorted(render_files(values, name).items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def one(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def kinds(docs: list[dict]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def pod_spec(docs: list[dict]) -> dict:
    return one(docs, "DaemonSet")["spec"]["template"]["spec"]


def container(docs: list[dict]) -> dict:
    (only,) = pod_spec(docs)["containers"]
    return only


def without_helm_labels(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for key in HELM_LABELS:
        doc["metadata"]["labels"].pop(key)
    return doc


def without_helm_bookkeeping(daemonset: dict) -> dict:
    """The DaemonSet less Helm's labels and the checksum annotations (all it has)."""
    doc = without_helm_labels(daemonset)
    annotations = doc["spec"]["template"]["metadata"].pop("annotations")
    assert sorted(annotations) == sorted(HELM_POD_ANNOTATIONS)
    return doc


def k8s_daemonset() -> dict:
    return test_k8s.by_kind(test_k8s.render())["DaemonSet"]


# -- the chart itself -------------------------------------------------------------------------


def test_the_charts_app_version_is_the_packages_version():
    metadata = _chart().metadata
    assert metadata["appVersion"] == __version__
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'\nversion = "{__version__}"\n' in pyproject


def test_the_chart_supports_kubernetes_1_28_to_1_37():
    assert _chart().metadata["kubeVersion"] == ">=1.28.0-0 <1.38.0-0"
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    assert "Kubernetes 1.28 to 1.37" in docs
    assert "Kubernetes 1.28 to 1.37" in (CHART / "README.md").read_text()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kube_version", ["v1.28.0", "v1.37.0"])
def test_every_variant_lints_clean_in_strict_mode(variant, kube_version):
    report = helm.lint(CHART, copy.deepcopy(VARIANTS[variant]), strict=True, kube_version=kube_version)
    findings = [m for m in report["messages"] if m["severity"] >= 2]
    assert findings == [] and report["errors"] == []
    # Only the missing icon is left, at info level: the project has no icon to point at.
    assert [m["error"] for m in report["messages"]] == ["icon is recommended"]


def test_lint_finds_a_broken_template(tmp_path):
    """The lint above can fail: a template that does not parse is an error."""
    broken = Path(helm.Chart.load(CHART).save_dir(tmp_path))
    (broken / "templates" / "service.yaml").write_text("{{ if }}\n")
    report = helm.lint(broken, strict=True)
    assert report["errors"], report


def _validate(tmp_path: Path, version: str, docs: list[tuple[str, dict]]) -> subprocess.CompletedProcess:
    tool = require_tool("kubernetes-validate")
    paths = []
    for i, (label, doc) in enumerate(docs):
        path = tmp_path / f"{i:03d}-{label}-{doc['kind']}.yaml"
        path.write_text(yaml.safe_dump(doc))
        paths.append(str(path))
    return subprocess.run([tool, "--strict", "--quiet", "-k", version, *paths],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("version", ["1.28.0", "1.37.0"])
def test_every_core_object_of_every_variant_passes_kubernetes_validate(tmp_path, version):
    docs = [(variant.replace(" ", "-"), doc) for variant, values in VARIANTS.items() for doc in render(values)
            if doc["kind"] not in OPERATOR_KINDS]
    assert {doc["kind"] for _, doc in docs} == {"ConfigMap", "DaemonSet", "NetworkPolicy", "Secret",
                                                "Service", "ServiceAccount"}
    result = _validate(tmp_path, version, docs)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_validate_refuses_a_misspelt_field_of_the_charts_daemonset(tmp_path):
    daemonset = one(render(), "DaemonSet")
    daemonset["spec"]["template"]["spec"]["hostPid"] = daemonset["spec"]["template"]["spec"].pop("hostPID")
    result = _validate(tmp_path, "1.37.0", [("broken", daemonset)])
    assert result.returncode != 0


def operator_check(doc: dict) -> None:
    """Validated by the Prometheus Operator's own CRD schema (cloudcoil's models of it):
    types, enums and patterns; and every field known, since a field the schema does not
    have would be dropped on the way back out."""
    model = OPERATOR_KINDS[doc["kind"]].model_validate(doc)
    assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc


def test_every_operator_object_of_every_variant_matches_the_operators_schema():
    seen = set()
    for values in VARIANTS.values():
        for doc in render(values):
            if doc["kind"] in OPERATOR_KINDS:
                operator_check(doc)
                seen.add(doc["kind"])
    assert seen == set(OPERATOR_KINDS)


@pytest.mark.parametrize("change", [
    lambda m: m["spec"]["endpoints"][0].update(intervall="15s"),
    lambda m: m["spec"]["endpoints"][0].update(interval="15 seconds"),
    lambda m: m["spec"]["endpoints"][0].update(scheme="HTTPS"),
], ids=["unknown field", "bad duration", "bad scheme"])
def test_the_operator_check_refuses_a_broken_servicemonitor(change):
    monitor = one(render(), "ServiceMonitor")
    change(monitor)
    with pytest.raises((pydantic.ValidationError, AssertionError)):  # the schema's refusal, or the round trip's
        operator_check(monitor)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_rendered_arguments_are_ones_serve_accepts(variant):
    args = container(render(VARIANTS[variant]))["args"]
    assert args[0] == "serve"
    context = serve.make_context("serve", list(args[1:]))
    assert context.params["config_file"] == "/etc/mig-exporter/config.yaml"


# -- one DaemonSet, one set of rules, one set of dashboards ------------------------------------


def test_the_default_daemonset_is_deploy_k8s_daemonset_field_by_field():
    chart = without_helm_bookkeeping(one(render(), "DaemonSet"))
    assert chart == k8s_daemonset()


def test_non_root_is_deploy_k8s_non_root_component():
    chart = without_helm_bookkeeping(one(render({"nonRoot": True}), "DaemonSet"))
    assert chart == test_k8s.apply_patch(k8s_daemonset(), test_k8s.component("non-root")[1])


def test_runtime_class_name_is_deploy_k8s_runtimeclass_component():
    chart = without_helm_bookkeeping(one(render({"runtimeClassName": "nvidia"}), "DaemonSet"))
    assert chart == test_k8s.apply_patch(k8s_daemonset(), test_k8s.component("runtimeclass-nvidia")[1])


def test_the_default_objects_are_deploy_k8s_objects_less_the_namespace():
    """Helm leaves the namespace to `kubectl create namespace` (its Pod Security label)."""
    chart = render()
    k8s = test_k8s.render()
    assert kinds(chart) == sorted([d["kind"] for d in k8s if d["kind"] != "Namespace"] + ["ConfigMap"] * 3)
    for kind in ("Service", "ServiceMonitor", "ServiceAccount"):
        assert without_helm_labels(one(chart, kind)) == test_k8s.by_kind(k8s)[kind], kind


def test_the_config_file_is_deploy_k8s_config_file():
    ours = one([d for d in render() if d["metadata"]["name"] == RELEASE], "ConfigMap")["data"]["config.yaml"]
    theirs = test_k8s.by_kind(test_k8s.render())["ConfigMap"]["data"]["config.yaml"]
    assert yaml.safe_load(ours) == yaml.safe_load(theirs)
    assert parse_config(ours, "config.yaml") == parse_config(theirs, "config.yaml")


def test_the_prometheus_rule_holds_deploy_prometheus_alerts_yml():
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    rule = one(render(), "PrometheusRule")
    assert rule["spec"] == {"groups": alerts["groups"]}
    assert rule["spec"] == test_k8s.by_kind(test_k8s.render())["PrometheusRule"]["spec"]
    assert rule["metadata"]["labels"]["app.kubernetes.io/component"] == "alerting-rules"


def test_promtool_accepts_the_prometheus_rules_groups_as_rendered(tmp_path):
    """Helm's toYaml rewrote the file (keys sorted, comments gone): what the operator hands
    Prometheus still loads."""
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": one(render(), "PrometheusRule")["spec"]["groups"]}))
    result = subprocess.run([require_tool("promtool"), "check", "rules", str(rules)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_charts_rules_and_dashboards_are_links_to_the_one_source():
    """Helm reads only the chart's folder and follows links when it loads or packages it:
    the links are what keeps one source. A copy in their place would drift."""
    links = {CHART / "files" / "alerts.yml": REPO / "deploy" / "prometheus" / "alerts.yml"}
    dashboards = sorted((REPO / "dashboards" / "grafana").glob("*.json"))
    assert [p.name for p in dashboards] == ["health.json", "node.json", "overview.json"]
    links.update({CHART / "files" / "dashboards" / p.name: p for p in dashboards})
    assert sorted((CHART / "files" / "dashboards").iterdir()) == sorted(
        p for p in links if p.parent.name == "dashboards")
    for link, target in links.items():
        assert link.is_symlink(), f"{link} must be a link to {target}, not a copy"
        assert not os.path.isabs(os.readlink(link)), "relative, so a clone anywhere keeps it"
        assert link.resolve() == target.resolve()


def test_each_dashboard_is_a_configmap_the_grafana_sidecar_loads():
    maps = {d["metadata"]["name"]: d for d in render()
            if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]}
    assert sorted(maps) == [f"{RELEASE}-dashboard-{n}" for n in ("health", "node", "overview")]
    for name, configmap in maps.items():
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert "annotations" not in configmap["metadata"]
        stem = name.removeprefix(f"{RELEASE}-dashboard-")
        (key,) = configmap["data"]
        assert key == f"mig-exporter-{stem}.json"
        source = (REPO / "dashboards" / "grafana" / f"{stem}.json").read_text()
        assert configmap["data"][key] == source
        assert json.loads(configmap["data"][key])["uid"] == f"mig-exporter-{stem}"


def test_dashboards_go_to_a_folder_and_namespace_when_asked():
    maps = [d for d in render(VARIANTS["dashboards in a folder elsewhere"]) if "dashboard" in d["metadata"]["name"]]
    assert len(maps) == 3
    for configmap in maps:
        assert configmap["metadata"]["namespace"] == "monitoring"
        assert configmap["metadata"]["annotations"] == {"grafana_folder": "GPU"}
        assert {"grafana_dashboard": "1", "team": "ml"}.items() <= configmap["metadata"]["labels"].items()


# -- what users set ---------------------------------------------------------------------------


def _selects(selector: dict, labels: dict) -> bool:
    return selector["matchLabels"].items() <= labels.items()


def test_a_kube_prometheus_stack_user_sets_only_the_release_label():
    """kube-prometheus-stack (release "kps") selects ServiceMonitors and rules on
    release: kps, and its Grafana sidecar loads ConfigMaps labelled grafana_dashboard: "1"."""
    stack_selector = {"matchLabels": {"release": "kps"}}
    values = {"serviceMonitor": {"additionalLabels": {"release": "kps"}},
              "prometheusRule": {"additionalLabels": {"release": "kps"}}}
    docs = render(values)
    monitor, rule = one(docs, "ServiceMonitor"), one(docs, "PrometheusRule")
    assert _selects(stack_selector, monitor["metadata"]["labels"])
    assert _selects(stack_selector, rule["metadata"]["labels"])
    service = one(docs, "Service")
    assert _selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    assert _selects({"matchLabels": service["spec"]["selector"]},
                    one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"])
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [service["spec"]["ports"][0]["name"]]
    assert len([d for d in docs if d["metadata"]["labels"].get("grafana_dashboard") == "1"]) == 3
    # Without the label the stack's Prometheus would not see them, and the install's notes say so.
    assert not _selects(stack_selector, one(render(), "ServiceMonitor")["metadata"]["labels"])
    notes = render_files()["mig-exporter/templates/NOTES.txt"]
    assert "--set serviceMonitor.additionalLabels.release=<its release name>" in notes
    assert "--set prometheusRule.additionalLabels.release=<its release name>" in notes


def test_a_pod_monitor_replaces_the_service_monitor():
    docs = render(VARIANTS["PodMonitor"])
    assert "ServiceMonitor" not in kinds(docs)
    monitor = one(docs, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert _selects(monitor["spec"]["selector"], one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "30s", "scrapeTimeout": "20s",
                        "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                         "targetLabel": "node"}]}


def test_probe_targets_come_from_values_and_are_scraped_on_every_node():
    docs = render(VARIANTS["probe targets scraped"])
    config = parse_config(one([d for d in docs if d["metadata"]["name"] == RELEASE], "ConfigMap")
                          ["data"]["config.yaml"], "chart")
    assert sorted(config.probe_targets) == ["driver-root", "host"]
    assert config.probe_targets["host"].command == ("/host/usr/bin/nvidia-smi",)
    metrics, *probes = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert metrics["path"] == "/metrics" and metrics["interval"] == "15s"
    assert [(p["path"], p["params"], p["interval"]) for p in probes] == [
        ("/probe", {"target": ["driver-root"]}, "1m"), ("/probe", {"target": ["host"]}, "1m")]
    for probe, name in zip(probes, ["driver-root", "host"], strict=True):
        # A job of its own: the rules count a card once, by /metrics' (job, instance).
        assert {"targetLabel": "job", "replacement": f"{RELEASE}-probe"} in probe["relabelings"]
        assert {"targetLabel": "target", "replacement": name} in probe["relabelings"]


def test_tls_and_basic_auth_from_values_make_a_web_config_the_exporter_loads(tmp_path):
    pki = make_pki(tmp_path)
    values = {"tls": {"enabled": True, "cert": pki.server.cert.read_text(), "key": pki.server.key.read_text()},
              "basicAuth": {"users": {"prometheus": BCRYPT_HASH}}}
    docs = render(values)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    tls = secrets[f"{RELEASE}-tls"]
    assert tls["type"] == "kubernetes.io/tls"
    tls_dir = tmp_path / "etc-mig-exporter-tls"
    tls_dir.mkdir()
    for key, data in tls["data"].items():
        (tls_dir / key).write_bytes(base64.b64decode(data))
    text = secrets[f"{RELEASE}-web-config"]["stringData"]["web-config.yml"]
    assert "/etc/mig-exporter-tls/tls.crt" in text
    web = parse_web_config(text.replace("/etc/mig-exporter-tls", str(tls_dir)), "chart")
    assert web.tls is not None and web.users == ("prometheus",)
    pod = pod_spec(docs)
    (only,) = pod["containers"]
    assert "--web.config.file=/etc/mig-exporter-web/web-config.yml" in only["args"]
    mounts = {m["name"]: m["mountPath"] for m in only["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["web-config"] == "/etc/mig-exporter-web" and mounts["tls"] == "/etc/mig-exporter-tls"
    assert volumes["web-config"]["secret"]["secretName"] == f"{RELEASE}-web-config"
    assert volumes["tls"]["secret"]["secretName"] == f"{RELEASE}-tls"
    # The kubelet cannot answer basic auth: its probes only check the port.
    assert only["livenessProbe"]["tcpSocket"] == {"port": "metrics"}
    assert only["readinessProbe"]["tcpSocket"] == {"port": "metrics"}
    assert one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["scheme"] == "https"


def test_tls_from_an_existing_secret_mounts_it_and_probes_over_https():
    docs = render(VARIANTS["TLS from a Secret"])
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == [f"{RELEASE}-web-config"]
    pod = pod_spec(docs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "mig-exporter-cert"
    (only,) = pod["containers"]
    assert only["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert only["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    endpoint = one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"] == {"insecureSkipVerify": True}


def test_existing_config_map_and_web_config_secret_are_used_not_written():
    docs = render({"config": {"existingConfigMap": "my-config"}, "webConfig": {"existingSecret": "my-web"}})
    assert [d for d in docs if d["kind"] == "Secret"] == []
    assert all("dashboard" in d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap")
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "my-config"
    assert volumes["web-config"]["secret"]["secretName"] == "my-web"


def test_a_changed_config_or_web_config_rolls_the_pods():
    def checksums(values):
        return one(render(values), "DaemonSet")["spec"]["template"]["metadata"]["annotations"]

    base = checksums({})
    assert checksums({}) == base
    engines = {"config": {"engines": {"presets": {"triton": False}}}}
    assert checksums(engines)["checksum/config"] != base["checksum/config"]
    assert checksums(engines)["checksum/web-config"] == base["checksum/web-config"]
    users = checksums({"basicAuth": {"users": {"prometheus": BCRYPT_HASH}}})
    assert users["checksum/web-config"] != base["checksum/web-config"]
    assert users["checksum/config"] == base["checksum/config"]
    assert checksums({"probe": {"targets": {"driver-root": None}}})["checksum/config"] != base["checksum/config"]
    # A new certificate from values rolls them too (one of the user's own Secret is re-read by the exporter).
    first = checksums({"tls": {"enabled": True, "cert": PEM, "key": KEY}})
    renewed = checksums({"tls": {"enabled": True, "cert": PEM.replace("MIIB", "MIIC"), "key": KEY}})
    assert first["checksum/web-config"] != renewed["checksum/web-config"]


def test_the_values_users_set_reach_the_pods():
    docs = render(VARIANTS["everything extra"])
    daemonset = one(docs, "DaemonSet")
    assert daemonset["metadata"]["name"] == "gpu-memory"
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    pod = daemonset["spec"]["template"]["spec"]
    (only,) = pod["containers"]
    assert only["image"] == "registry.example/mig-exporter:0.1.0-rc1" and only["imagePullPolicy"] == "Always"
    assert only["args"][-3:] == ["--web.listen-address=:9464", "--log.level=warning", "--collector.processes=top=3"]
    assert only["ports"] == [{"name": "metrics", "containerPort": 9464, "protocol": "TCP"}]
    assert only["env"][-1] == {"name": "TZ", "value": "UTC"}
    assert only["resources"] == {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}
    assert only["volumeMounts"][-1] == {"name": "extra", "mountPath": "/extra", "readOnly": True}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["extra"] == {"name": "extra", "emptyDir": {}}
    assert volumes["pod-resources"]["hostPath"]["path"] == "/var/snap/microk8s/common/var/lib/kubelet/pod-resources"
    assert volumes["pod-logs"]["hostPath"]["path"] == "/var/snap/microk8s/common/var/log/pods"
    assert pod["nodeSelector"] == {"node-role.example/gpu": "true"}
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert "affinity" not in pod
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["serviceAccountName"] == "gpu-monitoring"
    assert "ServiceAccount" not in kinds(docs)
    template = daemonset["spec"]["template"]["metadata"]
    assert template["labels"]["team"] == "ml" and template["annotations"]["example.com/team"] == "ml"
    assert one(docs, "Service")["spec"]["ports"][0]["port"] == 9464


def test_the_network_policy_lets_only_prometheus_reach_the_metrics_port():
    docs = render(VARIANTS["NetworkPolicy"])
    policy = one(docs, "NetworkPolicy")
    assert _selects(policy["spec"]["podSelector"], one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert rule["from"] == [{"namespaceSelector": {},
                             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    assert "NetworkPolicy" not in kinds(render())


def test_nothing_optional_leaves_the_daemonset_and_its_config():
    assert kinds(render(VARIANTS["nothing optional"])) == ["ConfigMap", "DaemonSet", "ServiceAccount"]


# -- values refused ---------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "named"), [
    ({"port": -1}, "/port"),
    ({"port": 70000}, "/port"),
    ({"logLevel": "verbose"}, "/logLevel"),
    ({"tls": {"enabled": True}}, "/tls"),
    ({"tls": {"enabled": True, "cert": PEM}}, "/tls/key"),
    ({"colour": "green"}, "'colour'"),
    ({"serviceMonitor": {"interval": "15 seconds"}}, "/serviceMonitor/interval"),
    ({"image": {"tag": 1}}, "/image/tag"),
    ({"podLabels": {"app.kubernetes.io/name": "other"}}, "/podLabels"),
    ({"probe": {"targets": {"host": {"command": ["nvidia-smi"], "timout": "5s"}}}}, "/probe/targets/host"),
    ({"probe": {"targets": {"host": {"command": ["nvidia-smi"], "timeout": "5 s"}}}}, "/probe/targets/host/timeout"),
    ({"config": {"engines": {"presets": {"tritonn": False}}}}, "/config/engines"),
    ({"networkPolicy": {"from": [{}]}}, "/networkPolicy/from/0"),
], ids=["negative port", "port too high", "unknown log level", "TLS with no Secret or key",
        "TLS with a certificate and no key", "unknown top-level key", "bad interval", "numeric tag",
        "a selector label in podLabels", "misspelt probe target key", "bad probe timeout", "unknown preset",
        "an empty NetworkPolicy peer"])
def test_bad_values_are_refused_by_the_schema_naming_the_value(values, named):
    with pytest.raises(HelmValuesError) as schema:
        _chart().validate_schema(values)
    assert named in str(schema.value)
    with pytest.raises(HelmValuesError) as install:
        render(values)
    assert named in str(install.value)
    report = helm.lint(CHART, values, strict=True)
    assert any(named in error for error in report["errors"]), report


@pytest.mark.parametrize(("values", "message"), [
    ({"podMonitor": {"enabled": True}}, "serviceMonitor.enabled and podMonitor.enabled are both true"),
    ({"service": {"enabled": False}}, "serviceMonitor.enabled needs service.enabled"),
    ({"serviceMonitor": {"enabled": False}, "probe": {"scrape": True}}, "probe.scrape needs serviceMonitor.enabled"),
    ({"probe": {"scrape": True}, "config": {"existingConfigMap": "mine"}}, "probe.scrape scrapes probe.targets"),
    ({"serviceMonitor": {"interval": "5s"}},
     "serviceMonitor.scrapeTimeout (10s) is longer than serviceMonitor.interval"),
    ({"probe": {"scrape": True, "interval": "5s"}}, "serviceMonitor.scrapeTimeout (10s) is longer than probe.interval"),
    ({"updateStrategy": {"rollingUpdate": {"maxSurge": 1}}}, "set updateStrategy.rollingUpdate.maxUnavailable=0"),
], ids=["two monitors", "monitor without service", "probe scrape without monitor", "probe scrape of a foreign config",
        "timeout over interval", "timeout over probe interval", "maxSurge beside maxUnavailable"])
def test_contradicting_switches_fail_the_render_with_what_to_do(values, message):
    with pytest.raises(HelmRenderError) as error:
        render(values)
    assert message in str(error.value)


def test_durations_are_compared_as_durations():
    for values in ({"serviceMonitor": {"interval": "1m", "scrapeTimeout": "59s"}},
                   {"serviceMonitor": {"enabled": False}, "podMonitor": {"enabled": True, "interval": "1s",
                                                                         "scrapeTimeout": "500ms"}},
                   {"probe": {"scrape": True, "interval": "1m30s"}},
                   {"updateStrategy": {"rollingUpdate": {"maxSurge": "10%", "maxUnavailable": 0}}}):
        assert one(render(values), "DaemonSet")


def test_the_schemas_config_file_words_are_the_exporters():
    """The schema refuses a config file the exporter would refuse at start (pods that
    crash-loop), with the exporter's own words for it."""
    from mig_exporter.config import engines, file
    from mig_exporter.engines.rules import PRESETS

    config = _chart().schema["properties"]["config"]["properties"]["engines"]["anyOf"][1]
    assert config["properties"]["presets"]["anyOf"][1]["propertyNames"]["enum"] == list(PRESETS)
    rule = config["properties"]["rules"]["items"]
    assert tuple(rule["properties"]) == engines.RULE_KEYS
    assert tuple(rule["properties"]["gpu_offload"]["properties"]) == engines.OFFLOAD_KEYS
    targets = _chart().schema["properties"]["probe"]["properties"]["targets"]
    assert tuple(targets["additionalProperties"]["anyOf"][1]["properties"]) == file._TARGET_KEYS
    assert targets["propertyNames"]["pattern"] == f"^{file.TARGET_NAME.pattern}$"


def test_the_defaults_pass_the_schema_and_every_value_is_in_it():
    _chart().validate_schema({})
    schema = _chart().schema
    assert schema is not None and schema["additionalProperties"] is False

    def walk(values: dict, node: dict, path: str) -> None:
        """Each object the schema closes names exactly the keys values.yaml has."""
        properties = node["properties"]
        assert sorted(values) == sorted(set(properties) - {"global"}), path   # global: Helm's own
        for key, value in values.items():
            if properties[key].get("additionalProperties") is False:
                walk(value, properties[key], f"{path}.{key}")

    walk(_chart().values, schema, "")


# -- packaging and the README -----------------------------------------------------------------


def test_the_chart_packages_the_same_twice_with_the_linked_files_inside(tmp_path):
    first = helm.package(CHART, destination=tmp_path / "first")
    second = helm.package(CHART, destination=tmp_path / "second")
    assert Path(first).name == f"mig-exporter-{__version__}.tgz"
    assert helm.digest(first) == helm.digest(second)
    assert Path(first).read_bytes() == Path(second).read_bytes()
    with tarfile.open(first) as archive:
        member = archive.getmember("mig-exporter/files/alerts.yml")
        assert member.isfile(), "the link's content, not a link"
        assert archive.extractfile(member).read() == (REPO / "deploy" / "prometheus" / "alerts.yml").read_bytes()
        assert "mig-exporter/values.schema.json" in archive.getnames()
    with helm.Chart.load(first) as packaged:
        assert packaged.render(name=RELEASE, namespace=NAMESPACE) == render_files()


def test_the_chart_readme_is_what_the_generator_writes_from_values_yaml():
    result = subprocess.run([str(REPO / "scripts" / "helm-readme"), "--check"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    readme = (CHART / "README.md").read_text()
    for key in ("`port`", "`logLevel`", "`tls.existingSecret`", "`serviceMonitor.additionalLabels`",
                "`dashboards.labels`", "`networkPolicy.enabled`", "`nonRoot`", "`extraArgs`"):
        assert key in readme


def test_a_stale_readme_is_caught(tmp_path):
    """The check above can fail: a value added without its table line is stale."""
    copy_ = tmp_path / "chart"
    copy_.mkdir()
    (copy_ / "README.md").write_bytes((CHART / "README.md").read_bytes())
    (copy_ / "values.yaml").write_text((CHART / "values.yaml").read_text().replace(
        "logLevel: info\n", "logLevel: info\n## @param logFormat Log lines as logfmt or json\nlogFormat: logfmt\n"))
    result = subprocess.run([str(REPO / "scripts" / "helm-readme"), "--check", str(copy_)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1
    assert "+| `logFormat`" in result.stdout
    assert "README.md is out of date: run scripts/helm-readme" in result.stderr
