"""Where Kubernetes would run a DaemonSet's pod: its node selector, required node affinity
and tolerations, evaluated against a node's labels and taints as Kubernetes evaluates them.

What each function follows:
- node selector: every key present with an equal value (k8s.io/apimachinery
  labels.SelectorFromSet);
- required node affinity: the terms are ORed, the expressions of a term ANDed, and a term
  with no expressions matches nothing (k8s.io/component-helpers scheduling/corev1/
  nodeaffinity, NodeSelector.Match); each expression as labels.Requirement.Matches does
  (k8s.io/apimachinery pkg/labels/selector.go): NotIn and DoesNotExist match a node
  without the key, Gt and Lt compare integers and need the key;
- taints: only NoSchedule and NoExecute keep a pod off (PreferNoSchedule does not); a
  toleration tolerates a taint when its effect is empty or equal, its key empty or equal,
  and its value equal under operator Equal (the default) or anything under Exists
  (k8s.io/api core/v1 toleration.go, Toleration.ToleratesTaint);
- the DaemonSet controller adds its own tolerations to every pod it makes (pkg/controller/
  daemon/util, AddOrUpdateDaemonPodTolerations): the node conditions below, and the
  DaemonSet controller deletes a running pod from a node that stops matching.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DAEMONSET_TOLERATIONS = (
    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/disk-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/memory-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/pid-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
)


@dataclass(frozen=True)
class Node:
    name: str
    labels: dict[str, str]
    taints: tuple[dict[str, str], ...] = field(default=())


def requirement_matches(expression: dict, labels: dict[str, str]) -> bool:
    key, operator = expression["key"], expression["operator"]
    values = expression.get("values", [])
    has = key in labels
    if operator == "In":
        return has and labels[key] in values
    if operator == "NotIn":
        return not has or labels[key] not in values
    if operator == "Exists":
        return has
    if operator == "DoesNotExist":
        return not has
    if operator in ("Gt", "Lt"):
        if not has or len(values) != 1:
            return False
        try:
            mine, theirs = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return mine > theirs if operator == "Gt" else mine < theirs
    raise ValueError(f"unknown operator {operator!r}")


def affinity_matches(affinity: dict | None, labels: dict[str, str]) -> bool:
    required = (((affinity or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if required is None:
        return True
    for term in required.get("nodeSelectorTerms", []):
        expressions = term.get("matchExpressions") or []
        assert not term.get("matchFields"), "matchFields: not used by the chart"
        if expressions and all(requirement_matches(e, labels) for e in expressions):
            return True
    return False


def tolerates(toleration: dict, taint: dict) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint["effect"]:
        return False
    if toleration.get("key") and toleration["key"] != taint["key"]:
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return (toleration.get("value") or "") == (taint.get("value") or "")


def runs_on(pod_spec: dict, node: Node) -> bool:
    """Whether the DaemonSet controller keeps a pod of this spec on the node."""
    selector = pod_spec.get("nodeSelector") or {}
    if any(node.labels.get(k) != v for k, v in selector.items()):
        return False
    if not affinity_matches(pod_spec.get("affinity"), node.labels):
        return False
    tolerations = [*(pod_spec.get("tolerations") or []), *DAEMONSET_TOLERATIONS]
    return all(any(tolerates(t, taint) for t in tolerations)
               for taint in node.taints if taint["effect"] in ("NoSchedule", "NoExecute"))


# -- what the GPU Operator's managers write while they pause their GPU clients ------------------
# NVIDIA/mig-parted pkg/mig/reconfigure (maybeSetPaused, maybeSetTrue): every deploy label but
# "false" becomes paused-for-mig-change, an absent one included (the client label, from
# mig-parted's #426, only where it exists); restored, it is "true" unless it was "false".
# NVIDIA/k8s-driver-manager cmd/driver-manager (maybeSetPaused): "true" becomes
# paused-for-driver-upgrade, "" and "false" stay, a value already holding that word stays, any
# other value v becomes v_paused-for-driver-upgrade (the client label only where it exists).
MIG_MANAGER_LABELS = ("device-plugin", "gpu-feature-discovery", "dcgm-exporter", "dcgm", "nvsm")
DRIVER_MANAGER_LABELS = ("operator-validator", "container-toolkit", "device-plugin", "gpu-feature-discovery",
                         "dcgm-exporter", "dcgm", "nvsm", "sandbox-validator", "sandbox-device-plugin",
                         "vgpu-device-manager")
CLIENT = "nvidia.com/gpu.deploy.client"


def mig_manager_paused(labels: dict[str, str]) -> dict[str, str]:
    out = dict(labels)
    keys = [f"nvidia.com/gpu.deploy.{name}" for name in MIG_MANAGER_LABELS]
    keys += [CLIENT] if labels.get(CLIENT) else []
    for key in keys:
        out[key] = "false" if labels.get(key) == "false" else "paused-for-mig-change"
    return out


def driver_manager_paused(labels: dict[str, str]) -> dict[str, str]:
    out = dict(labels)
    keys = [f"nvidia.com/gpu.deploy.{name}" for name in DRIVER_MANAGER_LABELS]
    keys += [CLIENT] if labels.get(CLIENT) else []
    for key in keys:
        value = labels.get(key, "")
        if value in ("", "false") or "paused-for-driver-upgrade" in value:
            out[key] = value
        elif value == "true":
            out[key] = "paused-for-driver-upgrade"
        else:
            out[key] = f"{value}_paused-for-driver-upgrade"
    return out
