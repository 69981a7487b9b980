"""Where the chart's and deploy/k8s's DaemonSet runs: evaluated against the node label
sets and taints of the clusters it meets (tests/kube_scheduling.py evaluates them as
Kubernetes does), and stepping aside while the GPU Operator's MIG manager or driver
manager pauses its GPU clients."""

from __future__ import annotations

import pytest

import test_helm
import test_k8s
from kube_scheduling import Node, driver_manager_paused, mig_manager_paused, runs_on

OPERATOR = {"kubernetes.io/os": "linux", "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.workload.config": "container", "nvidia.com/gpu.deploy.device-plugin": "true",
            "nvidia.com/gpu.deploy.gpu-feature-discovery": "true", "nvidia.com/gpu.deploy.dcgm-exporter": "true",
            "nvidia.com/gpu.deploy.dcgm": "true", "nvidia.com/gpu.deploy.container-toolkit": "true"}
# GPU Operator v26.7 and later also label the node for third-party GPU clients.
OPERATOR_26_7 = {**OPERATOR, "nvidia.com/gpu.deploy.client": "true"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}

PLACED = [
    Node("gpu-operator", OPERATOR, (GPU_TAINT,)),
    Node("gpu-operator-26.7", OPERATOR_26_7),
    Node("gpu-operator, dcgm-exporter off on this node",
         {**OPERATOR_26_7, "nvidia.com/gpu.deploy.dcgm-exporter": "false"}),
    Node("node-feature-discovery",
         {"kubernetes.io/os": "linux", "feature.node.kubernetes.io/pci-10de.present": "true"}),
    Node("gke", {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "cloud.google.com/gke-nodepool": "gpu"},
         (GPU_TAINT,)),
    Node("eks", {"k8s.amazonaws.com/accelerator": "nvidia-h100", "eks.amazonaws.com/nodegroup": "gpu"}),
    Node("aks", {"kubernetes.azure.com/accelerator": "nvidia", "kubernetes.azure.com/agentpool": "gpu"},
         ({"key": "sku", "value": "gpu", "effect": "NoSchedule"},)),
    Node("a node being drained", OPERATOR, ({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},)),
]
NOT_PLACED = [
    Node("cpu", {"kubernetes.io/os": "linux"}),
    Node("a GPU node labelled false", {"nvidia.com/gpu.present": "false"}),
    Node("vm-passthrough", {**OPERATOR, "nvidia.com/gpu.workload.config": "vm-passthrough"}),
    Node("vm-vgpu", {**OPERATOR, "nvidia.com/gpu.workload.config": "vm-vgpu"}),
    Node("MIG change (client label)", mig_manager_paused(OPERATOR_26_7)),
    Node("MIG change (before v26.7)", mig_manager_paused(OPERATOR)),
    Node("driver upgrade (client label)", driver_manager_paused(OPERATOR_26_7)),
    Node("driver upgrade (before v26.7)", driver_manager_paused(OPERATOR)),
    Node("driver upgrade during a MIG change", driver_manager_paused(mig_manager_paused(OPERATOR_26_7))),
    # Before v26.7, with dcgm-exporter turned off on the node (false stays false): the device
    # plugin's label still says paused.
    Node("MIG change, dcgm-exporter off (before v26.7)",
         mig_manager_paused({**OPERATOR, "nvidia.com/gpu.deploy.dcgm-exporter": "false"})),
    Node("driver upgrade, dcgm-exporter off (before v26.7)",
         driver_manager_paused({**OPERATOR, "nvidia.com/gpu.deploy.dcgm-exporter": "false"})),
    Node("a GPU node with a taint of its own", OPERATOR,
         ({"key": "dedicated", "value": "ml", "effect": "NoSchedule"},)),
]


def _pods() -> dict[str, dict]:
    return {"chart": test_helm.pod_spec(test_helm.render()),
            "deploy/k8s": test_k8s.by_kind(test_k8s.render())["DaemonSet"]["spec"]["template"]["spec"]}


@pytest.mark.parametrize("node", PLACED, ids=lambda n: n.name)
def test_the_default_pod_runs_on_every_kind_of_gpu_node(node):
    for source, pod in _pods().items():
        assert runs_on(pod, node), f"{source}: no pod on {node.name}"


@pytest.mark.parametrize("node", NOT_PLACED, ids=lambda n: n.name)
def test_no_pod_runs_where_it_cannot_work_or_must_step_aside(node):
    for source, pod in _pods().items():
        assert not runs_on(pod, node), f"{source}: a pod on {node.name}"


def test_the_pod_leaves_while_the_operator_pauses_and_comes_back_after():
    pod = _pods()["chart"]
    for labels in (OPERATOR, OPERATOR_26_7):
        assert runs_on(pod, Node("before", labels))
        paused = mig_manager_paused(labels)
        assert not runs_on(pod, Node("during", paused))
        # mig-parted restores "true" to every label it paused but "false" ones.
        restored = {k: ("true" if v == "paused-for-mig-change" else v) for k, v in paused.items()}
        assert runs_on(pod, Node("after", restored))


def test_the_evaluator_can_refuse():
    """The checks above can fail: a pod with no toleration stays off a tainted GPU node, and
    one whose affinity names a label the node lacks stays off it."""
    pod = dict(_pods()["chart"])
    assert not runs_on({**pod, "tolerations": []}, PLACED[0])
    assert not runs_on({**pod, "nodeSelector": {"gpu": "yes"}}, PLACED[1])
    assert runs_on({k: v for k, v in pod.items() if k != "affinity"}, NOT_PLACED[0])


def test_gpu_nodes_and_affinity_values_change_where_it_runs():
    cpu = NOT_PLACED[0]
    anywhere = test_helm.pod_spec(test_helm.render({"gpuNodes": {"anyOf": []}}))
    assert "affinity" not in anywhere and runs_on(anywhere, cpu)
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}}
    replaced = test_helm.pod_spec(test_helm.render({"affinity": own}))
    assert replaced["affinity"] == own and runs_on(replaced, cpu)
    # On Operator v26.7 and later, a nodeSelector on the client label lets the MIG manager and the
    # driver manager wait for the pod to be gone (they wait for pods selected so, docs/kubernetes.md).
    waited = test_helm.pod_spec(test_helm.render({"nodeSelector": {"nvidia.com/gpu.deploy.client": "true"}}))
    assert runs_on(waited, PLACED[1]) and not runs_on(waited, PLACED[0])
