"""deploy/helm/mig-exporter: the chart rendered, linted and packaged by Helm's own code
(helm-python-sdk's libhelm), every switch; every object checked with
kubernetes-validate against Kubernetes 1.28 and 1.37 and the Prometheus Operator's
schemas; the DaemonSet, rules and dashboards held equal to deploy/k8s,
deploy/prometheus and dashboards/grafana."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import tarfile
import tempfile
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
SCRAPE_CREDENTIALS = {"basicAuth": {"username": {"name": "scrape", "key": "user"},
                                    "password": {"name": "scrape", "key": "password"}}}

# Every switch and variant, each rendered, linted, validated and parsed by the CLI below.
VARIANTS: dict[str, dict] = {
    "defaults": {},
    "non-root": {"nonRoot": True},
    "default runtime, no priority class": {"runtimeClassName": "", "priorityClassName": ""},
    "MIG monitor": {"migMonitor": {"enabled": True}},
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
        "image": {"registry": "registry.example", "repository": "mig-exporter", "tag": "0.1.0-rc1",
                  "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "registry"}], "port": 9464, "logLevel": "warn",
        "extraArgs": ["--collector.processes=top=3"], "env": [{"name": "TZ", "value": "UTC"}],
        "nodeSelector": {"node-role.example/gpu": "true"}, "tolerations": [{"operator": "Exists"}],
        "gpuNodes": {"anyOf": []}, "podAnnotations": {"example.com/team": "ml"}, "podLabels": {"team": "ml"},
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
    # The names prometheus-node-exporter's chart (and dcgm-exporter's) give them.
    "escape hatches": {
        "enabled": True,
        "global": {"imageRegistry": "mirror.example", "imagePullSecrets": ["global-pull", {"name": "global-map"}],
                   "anythingElse": {"an": "umbrella chart's"}},
        "image": {"digest": "sha256:" + "ab" * 32},
        "imagePullSecrets": [{"name": "local-pull"}],
        "namespaceOverride": "gpu-monitoring",
        "podSecurityContext": {"fsGroup": 2000, "seccompProfile": {"type": "Localhost",
                                                                   "localhostProfile": "mig-exporter.json"}},
        "securityContext": {"readOnlyRootFilesystem": False,
                            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}},
        "service": {"annotations": {"prometheus.io/scrape": "false"}},
        "serviceAccount": {"annotations": {"iam.example/role": "gpu-reader"}},
        "extraInitContainers": [{"name": "wait-for-driver", "image": "busybox:1.36",
                                 "command": ["sh", "-c",
                                             "until [ -e /run/nvidia/validations/driver-ready ]; do sleep 5; done"]}],
        "terminationGracePeriodSeconds": 5,
        "serviceMonitor": {"namespace": "monitoring", "jobLabel": "app.kubernetes.io/name",
                           "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                            "targetLabel": "host"}],
                           "metricRelabelings": [{"sourceLabels": ["__name__"], "regex": "mig_exporter_scrape_series",
                                                  "action": "drop"}]},
        "prometheusRule": {"additionalRuleLabels": {"team": "ml"}, "disabled": {"GPUAllocatedButUnused": True}},
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


def _kube_version_allows(tmp_path: Path, constraint: str, versions: list[str]) -> dict[str, bool]:
    """What `helm install` and `helm upgrade` decide for a cluster of each version: they check
    the chart's kubeVersion with chartutil.IsCompatibleRange, Masterminds/semver's
    NewConstraint(...).Check, which is also what the template function semverCompare runs. So
    a chart of one template asks Helm's own code (the SDK has no install, and lint does not
    check kubeVersion)."""
    probe = Path(tempfile.mkdtemp(dir=tmp_path))
    (probe / "templates").mkdir()
    (probe / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (probe / "templates" / "answer.yaml").write_text(
        "{{- range .Values.versions }}\n{{ . }}: {{ semverCompare $.Values.constraint . }}\n{{- end }}\n")
    with helm.Chart.load(probe) as chart:
        rendered = chart.render({"constraint": constraint, "versions": versions}, name="probe", namespace="probe")
    return {k: v for k, v in yaml.safe_load(rendered["probe/templates/answer.yaml"]).items()}


def test_the_chart_installs_and_upgrades_on_kubernetes_1_28_and_later(tmp_path):
    """An upper bound would strand every release on a cluster that moves past it (1.38 was
    refused before): the chart has a lower bound only."""
    constraint = _chart().metadata["kubeVersion"]
    assert constraint == ">=1.28.0-0"
    versions = ["v1.27.9", "v1.28.0", "v1.30.4-eks-a737599", "v1.37.0", "v1.38.0", "v1.45.2"]
    assert _kube_version_allows(tmp_path, constraint, versions) == {
        "v1.27.9": False, "v1.28.0": True, "v1.30.4-eks-a737599": True, "v1.37.0": True, "v1.38.0": True,
        "v1.45.2": True}
    # The check can fail: the old range refused 1.38.
    assert _kube_version_allows(tmp_path, ">=1.28.0-0 <1.38.0-0", ["v1.38.0"]) == {"v1.38.0": False}
    for version in ("v1.38.0", "v1.45.2"):
        report = helm.lint(CHART, strict=True, kube_version=version)
        assert report["errors"] == [] and report["messages"] == [], (version, report)
    assert "Kubernetes 1.28 and later" in (REPO / "docs" / "kubernetes.md").read_text()
    assert "Kubernetes 1.28 and later" in (CHART / "README.md").read_text()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kube_version", ["v1.28.0", "v1.37.0"])
def test_every_variant_lints_clean_in_strict_mode(variant, kube_version):
    report = helm.lint(CHART, copy.deepcopy(VARIANTS[variant]), strict=True, kube_version=kube_version)
    findings = [m for m in report["messages"] if m["severity"] >= 2]
    assert findings == [] and report["errors"] == []
    assert [m["error"] for m in report["messages"]] == []


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


def test_the_default_runtime_is_deploy_k8s_default_runtime_component():
    chart = without_helm_bookkeeping(one(render({"runtimeClassName": ""}), "DaemonSet"))
    assert chart == test_k8s.apply_patch(k8s_daemonset(), test_k8s.component("default-runtime")[1])


def test_mig_monitor_is_deploy_k8s_mig_monitor_component():
    chart = without_helm_bookkeeping(one(render({"migMonitor": {"enabled": True}}), "DaemonSet"))
    assert chart == test_k8s.apply_patch(k8s_daemonset(), test_k8s.component("mig-monitor")[1])


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


def test_the_charts_rules_and_dashboards_are_real_copies_of_the_one_source():
    """Helm reads only the chart's folder. Links there would be their path's text on a checkout
    without symbolic links, and the chart would render `spec.groups: null`: files/ holds real
    files, which scripts/sync-chart-files writes and --check compares."""
    copies = {CHART / "files" / "alerts.yml": REPO / "deploy" / "prometheus" / "alerts.yml"}
    dashboards = sorted((REPO / "dashboards" / "grafana").glob("*.json"))
    assert [p.name for p in dashboards] == ["health.json", "node.json", "overview.json"]
    copies.update({CHART / "files" / "dashboards" / p.name: p for p in dashboards})
    assert sorted((CHART / "files").rglob("*.*")) == sorted(copies)
    for copy_, source in copies.items():
        assert not copy_.is_symlink() and copy_.is_file(), f"{copy_} must be a file"
        assert copy_.read_bytes() == source.read_bytes(), f"{copy_} differs from {source}: run scripts/sync-chart-files"
    assert not [p for p in CHART.rglob("*") if p.is_symlink()]
    result = subprocess.run([str(REPO / "scripts" / "sync-chart-files"), "--check"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_a_chart_without_its_rules_fails_to_render(tmp_path):
    """What a checkout without links rendered before, with lint passing: now a failed render."""
    broken = Path(helm.Chart.load(CHART).save_dir(tmp_path))
    (broken / "files" / "alerts.yml").write_text("../../../prometheus/alerts.yml")
    with helm.Chart.load(broken) as chart, pytest.raises(HelmRenderError) as error:
        chart.render(name=RELEASE, namespace=NAMESPACE)
    assert "files/alerts.yml holds no rule groups" in str(error.value)


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
                        "honorLabels": True, "relabelings": test_k8s.NODE_RELABELINGS}


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
              "basicAuth": {"users": {"prometheus": BCRYPT_HASH}}, "serviceMonitor": SCRAPE_CREDENTIALS}
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
    users = checksums({"basicAuth": {"users": {"prometheus": BCRYPT_HASH}}, "serviceMonitor": SCRAPE_CREDENTIALS})
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


def _monitor_endpoints(docs: list[dict]) -> list[dict]:
    return [e for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")
            for e in d["spec"].get("endpoints", d["spec"].get("podMetricsEndpoints", []))]


def _containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _env_names(container: dict) -> list[str]:
    return [e["name"] for e in container.get("env", [])]


def test_a_default_install_runs_under_the_nvidia_runtime_without_the_mig_monitor_variable():
    """GPU Operator v25.10+ (CDI on, nvidia no longer the default runtime): without the class the
    pod gets no driver. Legacy-mode runtime hooks refuse NVIDIA_MIG_MONITOR_DEVICES without
    CAP_SYS_ADMIN (nvidia-container-toolkit, cmd/nvidia-container-runtime-hook)."""
    docs = render()
    pod = pod_spec(docs)
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["priorityClassName"] == "system-node-critical"
    assert not any("NVIDIA_MIG_MONITOR_DEVICES" in _env_names(c) for c in _containers(pod))
    assert container(docs)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "runtimeClassName" not in pod_spec(render({"runtimeClassName": ""}))


def test_every_monitor_endpoint_honours_the_exporters_pod_labels_by_default():
    for values in ({}, VARIANTS["probe targets scraped"], VARIANTS["PodMonitor"],
                   VARIANTS["PodMonitor over TLS with basic auth, probes scraped"]):
        endpoints = _monitor_endpoints(render(values))
        assert endpoints and all(e["honorLabels"] is True for e in endpoints)
    off = _monitor_endpoints(render({"serviceMonitor": {"honorLabels": False}}))
    assert [e["honorLabels"] for e in off] == [False]


def _has_sys_admin(context: dict) -> bool:
    added = {str(c).upper().removeprefix("CAP_") for c in (context.get("capabilities") or {}).get("add") or []}
    return bool(context.get("privileged")) or bool(added & {"SYS_ADMIN", "ALL"})


MIG_VARIABLE = {"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"}


@pytest.mark.parametrize("mig_monitor", [False, True])
@pytest.mark.parametrize("security", [
    {}, {"capabilities": {"add": []}}, {"capabilities": {"add": ["NET_RAW"]}}, {"capabilities": {"drop": ["ALL"]}},
    {"privileged": True, "allowPrivilegeEscalation": True}, {"privileged": True},
    {"capabilities": {"add": ["CAP_SYS_ADMIN"]}},
], ids=["none", "no additions", "another capability", "drop only", "privileged", "privileged, no escalation",
        "CAP_ spelling"])
@pytest.mark.parametrize("env", [[], [MIG_VARIABLE]], ids=["no env", "the variable in env"])
@pytest.mark.parametrize("init", [[], [{"name": "init", "image": "busybox", "env": [MIG_VARIABLE]}],
                                  [{"name": "init", "image": "busybox", "env": [MIG_VARIABLE],
                                    "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]],
                         ids=["no init", "init with the variable", "init with the variable and SYS_ADMIN"])
def test_no_render_sets_the_mig_monitor_variable_without_sys_admin(mig_monitor, security, env, init):
    """Whatever the values, a container that sets NVIDIA_MIG_MONITOR_DEVICES has CAP_SYS_ADMIN
    (or is privileged), or the render fails saying what to set: the hook would refuse the pod."""
    values = {"migMonitor": {"enabled": mig_monitor}, "securityContext": security, "env": env,
              "extraInitContainers": init}
    # What each combination must give: the first refusal that applies, or a render.
    added = (security.get("capabilities") or {}).get("add", ["SYS_ADMIN"] if mig_monitor else [])
    if env:
        refusal: str | None = "env sets NVIDIA_MIG_MONITOR_DEVICES: set migMonitor.enabled=true instead"
    elif security.get("privileged") and not security.get("allowPrivilegeEscalation"):
        refusal = "securityContext.privileged needs securityContext.allowPrivilegeEscalation=true"
    elif mig_monitor and not _has_sys_admin({**security, "capabilities": {"add": added}}):
        refusal = "migMonitor.enabled needs SYS_ADMIN in securityContext.capabilities.add"
    elif init and not _has_sys_admin(init[0].get("securityContext") or {}):
        refusal = "extraInitContainers: init sets NVIDIA_MIG_MONITOR_DEVICES without SYS_ADMIN"
    else:
        refusal = None
    if refusal is not None:
        with pytest.raises(HelmRenderError) as error:
            render(values)
        assert refusal in str(error.value)
        return
    pod = pod_spec(render(values))
    for each in _containers(pod):
        if "NVIDIA_MIG_MONITOR_DEVICES" in _env_names(each):
            assert _has_sys_admin(each.get("securityContext") or {}), each["name"]
    (only,) = pod["containers"]
    assert ("NVIDIA_MIG_MONITOR_DEVICES" in _env_names(only)) == mig_monitor


def test_mig_monitor_adds_the_variable_and_sys_admin_together():
    only = container(render({"migMonitor": {"enabled": True}}))
    assert only["env"][3] == MIG_VARIABLE  # after the node name
    assert only["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert only["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_escape_hatches_reach_their_objects():
    docs = render(VARIANTS["escape hatches"])
    namespaced = [d for d in docs if "dashboard" not in d["metadata"]["name"] and d["kind"] != "ServiceMonitor"]
    assert {d["metadata"]["namespace"] for d in namespaced} == {"gpu-monitoring"}
    assert {d["metadata"]["namespace"] for d in docs if "dashboard" in d["metadata"]["name"]} == {"gpu-monitoring"}
    pod = pod_spec(docs)
    only = container(docs)
    assert only["image"] == "mirror.example/mig-exporter/mig-exporter@sha256:" + "ab" * 32
    assert pod["imagePullSecrets"] == [{"name": "global-pull"}, {"name": "global-map"}, {"name": "local-pull"}]
    assert pod["securityContext"] == {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0, "fsGroup": 2000,
                                      "seccompProfile": {"type": "Localhost", "localhostProfile": "mig-exporter.json"}}
    # Merged over the chart's: a false of the user's replaces the default true.
    assert only["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
                                       "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}
    assert [c["name"] for c in pod["initContainers"]] == ["wait-for-driver"]
    assert pod["terminationGracePeriodSeconds"] == 5
    assert one(docs, "Service")["metadata"]["annotations"] == {"prometheus.io/scrape": "false"}
    assert one(docs, "ServiceAccount")["metadata"]["annotations"] == {"iam.example/role": "gpu-reader"}
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["namespace"] == "monitoring"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["gpu-monitoring"]}
    assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/name"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["relabelings"] == [
        *test_k8s.NODE_RELABELINGS, {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "host"}]
    assert endpoint["metricRelabelings"] == [{"sourceLabels": ["__name__"], "regex": "mig_exporter_scrape_series",
                                              "action": "drop"}]
    rule = one(docs, "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    records = [r for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r]
    shipped = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert sorted(a["alert"] for a in alerts) == sorted(
        r["alert"] for g in shipped["groups"] for r in g["rules"]
        if "alert" in r and r["alert"] != "GPUAllocatedButUnused")
    assert all(a["labels"]["team"] == "ml" and a["labels"]["severity"] for a in alerts)
    assert all("team" not in r.get("labels", {}) for r in records)
    # The image's tag alone when no digest is given; the registry alone names it without one.
    assert container(render({"image": {"registry": ""}}))["image"] == "mig-exporter/mig-exporter:" + __version__
    assert container(render({"image": {"registry": "", "repository": "localhost:5000/mig-exporter"}}))["image"] == (
        "localhost:5000/mig-exporter:" + __version__)
    assert container(render())["image"] == "ghcr.io/mig-exporter/mig-exporter:" + __version__


def test_an_umbrella_charts_global_values_and_enabled_are_accepted():
    _chart().validate_schema({"enabled": False, "global": {"storageClass": "fast", "imageRegistry": ""}})
    assert kinds(render({"enabled": True})) == kinds(render())


def test_the_default_probe_targets_nvidia_smi_is_mounted():
    """The driver-root target runs /run/nvidia/driver/usr/bin/nvidia-smi: the GPU Operator's
    driver root, mounted read-only with the host's later mounts let in."""
    pod = pod_spec(render())
    mounts = {m["name"]: m for m in container(render())["volumeMounts"]}
    assert mounts["run-nvidia"] == {"name": "run-nvidia", "mountPath": "/run/nvidia", "readOnly": True,
                                    "mountPropagation": "HostToContainer"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["run-nvidia"]["hostPath"] == {"path": "/run/nvidia", "type": "DirectoryOrCreate"}
    for values in ({"probe": {"targets": {"driver-root": None, "host": {"command": ["/host/usr/bin/nvidia-smi"]}}}},
                   {"config": {"existingConfigMap": "mine"}}):
        assert "run-nvidia" not in {v["name"] for v in pod_spec(render(values))["volumes"]}


def test_an_empty_interval_inherits_the_prometheus_interval_and_empty_resources_set_none():
    (endpoint,) = one(render({"serviceMonitor": {"interval": ""}}), "ServiceMonitor")["spec"]["endpoints"]
    assert "interval" not in endpoint and endpoint["scrapeTimeout"] == "10s"
    # Helm merges a map of the user's into the default's: {} keeps them, null drops them.
    assert "resources" not in container(render({"resources": None}))
    assert container(render({"resources": {}}))["resources"] == container(render())["resources"]
    folder = [d for d in render({"dashboards": {"folder": "GPU", "folderAnnotation": "k8s-sidecar-target-directory"}})
              if "dashboard" in d["metadata"]["name"]]
    assert {tuple(d["metadata"]["annotations"].items()) for d in folder} == {(("k8s-sidecar-target-directory", "GPU"),)}
    text = render_files({"dashboards": {"folder": "GPU"}})["mig-exporter/templates/dashboards.yaml"]
    assert '"grafana_folder": "GPU"' in text


def test_the_notes_say_how_to_tell_that_no_node_matched():
    notes = render_files()["mig-exporter/templates/NOTES.txt"]
    assert "kubectl -n mig-exporter get daemonset mig-exporter" in notes
    assert "none carries one of the GPU labels of gpuNodes.anyOf, or\neach that does is a VM host or paused" in notes
    listed = next(line for line in notes.splitlines() if line.strip().startswith("kubectl get nodes -L "))
    anyof = [r["key"] for r in _chart().values["gpuNodes"]["anyOf"]]
    assert listed.split("-L ")[1].split(",")[:len(anyof)] == anyof
    assert "kubectl get runtimeclass nvidia" in notes
    assert "set runtimeClassName=\"\" then" in notes
    plain = render_files({"runtimeClassName": "", "gpuNodes": {"anyOf": []}})["mig-exporter/templates/NOTES.txt"]
    assert "runtimeclass" not in plain and "your nodeSelector matches none" in plain


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
    ({"migMonitor": {"enable": True}}, "/migMonitor"),
    ({"gpuNodes": {"anyOf": [{"key": "nvidia.com/gpu.present", "operator": "Has"}]}}, "/gpuNodes/anyOf/0/operator"),
    ({"image": {"digest": "latest"}}, "/image/digest"),
    ({"prometheusRule": {"disabled": {"GPUAllocatedButUnused": "yes"}}}, "/prometheusRule/disabled"),
    ({"prometheusRule": {"capacityFreshWithin": "1 minute"}}, "/prometheusRule/capacityFreshWithin"),
    ({"prometheusRule": {"memoryHeldIdleFor": "2 hours"}}, "/prometheusRule/memoryHeldIdleFor"),
    ({"prometheusRule": {"memoryHeldIdleBytes": "1Gi"}}, "/prometheusRule/memoryHeldIdleBytes"),
    ({"serviceMonitor": {"honourLabels": True}}, "/serviceMonitor"),
    ({"namespaceOverride": "GPU Monitoring"}, "/namespaceOverride"),
    ({"global": {"imagePullSecrets": [{"nmae": "x"}]}}, "/global/imagePullSecrets/0"),
], ids=["negative port", "port too high", "unknown log level", "TLS with no Secret or key",
        "TLS with a certificate and no key", "unknown top-level key", "bad interval", "numeric tag",
        "a selector label in podLabels", "misspelt probe target key", "bad probe timeout", "unknown preset",
        "an empty NetworkPolicy peer", "misspelt migMonitor key", "unknown selector operator", "a tag as digest",
        "a string to disable an alert", "a freshness window that is no duration", "an idle time that is no duration",
        "an idle memory threshold that is no number of bytes", "misspelt honorLabels",
        "a namespace with spaces", "a pull secret without name"])
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
    ({"basicAuth": {"users": {"prometheus": BCRYPT_HASH}}},
     "basicAuth.users is set but serviceMonitor.basicAuth is empty"),
    ({"basicAuth": {"users": {"prometheus": BCRYPT_HASH}}, "serviceMonitor": {"enabled": False},
      "podMonitor": {"enabled": True}}, "basicAuth.users is set but podMonitor.basicAuth is empty"),
    ({"env": [MIG_VARIABLE]}, "set migMonitor.enabled=true instead"),
    ({"migMonitor": {"enabled": True}, "securityContext": {"capabilities": {"add": []}}},
     "migMonitor.enabled needs SYS_ADMIN"),
    ({"extraInitContainers": [{"name": "probe-mig", "image": "busybox", "env": [MIG_VARIABLE]}]},
     "extraInitContainers: probe-mig sets NVIDIA_MIG_MONITOR_DEVICES without SYS_ADMIN"),
    ({"securityContext": {"privileged": True}},
     "securityContext.privileged needs securityContext.allowPrivilegeEscalation"),
    ({"prometheusRule": {"disabled": {"GPUAlocatedButUnused": True}}},
     "prometheusRule.disabled names GPUAlocatedButUnused, which is no alert"),
    ({"image": {"repository": "registry.example:5000/gpu/mig-exporter"}},
     "image.repository registry.example:5000/gpu/mig-exporter starts with a registry (registry.example:5000), "
     "and image.registry (or global.imageRegistry) ghcr.io would come before it: set "
     "image.registry=registry.example:5000 and image.repository=gpu/mig-exporter"),
], ids=["two monitors", "monitor without service", "probe scrape without monitor", "probe scrape of a foreign config",
        "timeout over interval", "timeout over probe interval", "maxSurge beside maxUnavailable",
        "basic auth, service monitor without credentials", "basic auth, pod monitor without credentials",
        "the MIG variable in env", "MIG monitor with its capability taken away",
        "an init container with the MIG variable",
        "privileged without escalation", "a misspelt alert to disable", "a whole image name as the repository"])
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
        assert sorted(values) == sorted(properties), path
        for key, value in values.items():
            if properties[key].get("additionalProperties") is False:
                walk(value, properties[key], f"{path}.{key}")

    walk(_chart().values, schema, "")


# -- packaging and the README -----------------------------------------------------------------


def test_the_chart_packages_the_same_twice_with_its_files_inside(tmp_path):
    first = helm.package(CHART, destination=tmp_path / "first")
    second = helm.package(CHART, destination=tmp_path / "second")
    assert Path(first).name == f"mig-exporter-{__version__}.tgz"
    assert helm.digest(first) == helm.digest(second)
    assert Path(first).read_bytes() == Path(second).read_bytes()
    with tarfile.open(first) as archive:
        member = archive.getmember("mig-exporter/files/alerts.yml")
        assert member.isfile()
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


def test_the_capacity_rules_freshness_window_is_a_value_and_only_they_change():
    """prometheusRule.capacityFreshWithin replaces the capacity group's [1m] (docs/capacity.md):
    two scrape intervals, plus the federation interval. The other groups keep their windows."""
    def groups(values: dict | None = None) -> dict[str, list[dict]]:
        (rule,) = [d for d in render(values) if d["kind"] == "PrometheusRule"]
        return {g["name"]: g["rules"] for g in rule["spec"]["groups"]}

    shipped, wider = groups(), groups({"prometheusRule": {"capacityFreshWithin": "90s"}})
    for name in shipped:
        for before, after in zip(shipped[name], wider[name], strict=True):
            if name == "mig-exporter.capacity" and before["record"].startswith("instance_class:"):
                assert "[1m]" in before["expr"] and "[1m]" not in after["expr"], before["record"]
                assert after["expr"] == before["expr"].replace("[1m]", "[90s]")
            else:
                assert after == before


def test_the_idle_memory_alert_takes_its_time_and_threshold_from_values_and_only_it_changes():
    """prometheusRule.memoryHeldIdleFor and .memoryHeldIdleBytes (docs/alerts.md): GPUMemoryHeldIdle's
    `for:` and the time its description says, and its threshold and its recording rule's; every
    other rule, GPUProcessesInvisible's own 1 GiB included, is left as shipped."""
    def rules(values: dict | None = None) -> dict[str, dict]:
        (rule,) = [d for d in render(values) if d["kind"] == "PrometheusRule"]
        return {r.get("alert") or r["record"]: r for g in rule["spec"]["groups"] for r in g["rules"]}

    shipped = rules()
    changed = rules({"prometheusRule": {"memoryHeldIdleFor": "45m", "memoryHeldIdleBytes": 4294967296}})
    idle = {"GPUMemoryHeldIdle", "instance_device:mig_exporter_memory_held_idle_bytes:sum"}
    assert {name for name in shipped if shipped[name] != changed[name]} == idle
    for name in idle:
        before, after = shipped[name]["expr"], changed[name]["expr"]
        assert before.count("> 1073741824") == 2 and after == before.replace("> 1073741824", "> 4294967296"), name
    alert, was = changed["GPUMemoryHeldIdle"], shipped["GPUMemoryHeldIdle"]
    assert (was["for"], alert["for"]) == ("2h", "45m")
    assert alert["annotations"]["description"] == was["annotations"]["description"].replace("for 2h:", "for 45m:")
    assert "for 45m:" in alert["annotations"]["description"]
    assert alert["annotations"]["summary"] == was["annotations"]["summary"]


def test_the_dashboards_count_with_the_rules_freshness_window():
    """The capacity panels run the rules' expressions, so they take prometheusRule.capacityFreshWithin
    too; every `}[1m]` in the dashboards is a capacity selector's, so nothing else changes."""
    import re

    def dashboards(values: dict | None = None) -> dict[str, str]:
        return {d["metadata"]["name"]: next(iter(d["data"].values())) for d in render(values)
                if d["kind"] == "ConfigMap" and "-dashboard-" in d["metadata"]["name"]}

    shipped, wider = dashboards(), dashboards({"prometheusRule": {"capacityFreshWithin": "90s"}})
    windows = [m for text in shipped.values() for m in re.findall(r"(mig_exporter_\w+)\{[^}]*\}\[1m\]", text)]
    assert windows and set(windows) <= {"mig_exporter_build_info", "mig_exporter_read_success",
                                        "mig_exporter_device_info", "mig_exporter_device_state",
                                        "mig_exporter_device_memory_free_bytes"}
    for name, text in shipped.items():
        assert wider[name] == text.replace("}[1m]", "}[90s]"), name
    assert any("}[90s]" in text for text in wider.values())


def test_the_idle_memory_panel_takes_the_alerts_threshold():
    """prometheusRule.memoryHeldIdleBytes reaches the overview's idle memory panel, which runs
    GPUMemoryHeldIdle's expression: every `> 1073741824` of the dashboards is that panel's."""
    def dashboards(values: dict | None = None) -> dict[str, str]:
        return {d["metadata"]["name"]: next(iter(d["data"].values())) for d in render(values)
                if d["kind"] == "ConfigMap" and "-dashboard-" in d["metadata"]["name"]}

    shipped = dashboards()
    changed = dashboards({"prometheusRule": {"memoryHeldIdleBytes": 4294967296}})
    held = [name for name, text in shipped.items() if "> 1073741824" in text]
    assert held == ["mig-exporter-dashboard-overview"]
    assert json.loads(shipped[held[0]]) != json.loads(changed[held[0]])
    for name, text in shipped.items():
        assert changed[name] == text.replace("> 1073741824", "> 4294967296"), name


def test_the_kernel_log_is_mounted_by_default_and_read_only_with_privileged_asked_for():
    """/dev/kmsg is mounted read-only by default, and the container stays least-privileged: no
    runtime lets a container open a device it did not allow (c 1:11), so xidKmsg.privileged is the
    one way to read it (docs/xids.md), asked for, never the default; xidKmsg.enabled=false turns the
    reading off and mounts nothing."""
    default = container(render())
    assert {"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True} in default["volumeMounts"]
    assert "privileged" not in default["securityContext"]
    assert default["securityContext"]["allowPrivilegeEscalation"] is False
    privileged = container(render({"xidKmsg": {"privileged": True}}))
    assert privileged["securityContext"]["privileged"] is True
    assert privileged["securityContext"]["allowPrivilegeEscalation"] is True
    off = container(render({"xidKmsg": {"enabled": False, "privileged": True}}))
    assert "--collector.xid.kmsg=" in off["args"]
    assert all(m["name"] != "kmsg" for m in off["volumeMounts"]) and "privileged" not in off["securityContext"]


def test_the_landing_page_names_the_node_not_the_pod():
    """A pod's host name is the pod's: the chart gives serve the node's, from the downward API."""
    env = {e["name"]: e for e in container(render())["env"]}
    assert env["MIG_EXPORTER_WEB_NODE_NAME"] == {
        "name": "MIG_EXPORTER_WEB_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
