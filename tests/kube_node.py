"""A Kubernetes node for tests: the demo sample's GPUs and processes, run in pods.

The demo's processes (samples/demo.xml, demo-proc.json) get cgroups in the
forms the kubelet's systemd driver and containerd create on cgroup v2, the
kubelet's log directories name their pods and containers, and the fake
kubelet allocates devices. Two things are wrong on this node, for the alerts:

- pid 50318 (pod notebooks/jupyter-alice) runs on card 1, which is allocated
  to graphics/vk-llama-0 only (the notebook asked for no GPU and got them all
  through NVIDIA_VISIBLE_DEVICES=all): GPUProcessOutsideAllocation;
- MIG device 1002 is allocated to batch/train-7 and no process holds memory
  on it: GPUAllocatedButUnused.

| pid | device | pod | container | QoS |
|---|---|---|---|---|
| 48213 | 1000 (MIG 3g.40gb) | llm/llama-0 | server | Burstable |
| 51877 | 1001 (MIG 2g.20gb) | llm/vllm-6b7f9c-x2x4q | vllm | BestEffort |
| 50102 | 1 (card 1) | graphics/vk-llama-0 | llama | Guaranteed |
| 50318 | 1 (card 1) | notebooks/jupyter-alice | notebook | BestEffort |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fake_kubelet import Container, Pod


@dataclass(frozen=True)
class Workload:
    namespace: str
    pod: str
    container: str
    pod_uid: str
    container_id: str
    qos: str  # "", "burstable", "besteffort"

    def cgroup(self) -> str:
        """/proc/PID/cgroup under cgroup v2, systemd driver, containerd."""
        uid = self.pod_uid.replace("-", "_")
        qos = f"kubepods-{self.qos}" if self.qos else "kubepods"
        middle = f"/{qos}.slice" if self.qos else ""
        return f"0::/kubepods.slice{middle}/{qos}-pod{uid}.slice/cri-containerd-{self.container_id}.scope\n"


LLAMA = Workload("llm", "llama-0", "server", "5f0b8f8e-3a8e-4d0e-9a55-0f2a9c1b7d01",
                 "3b9d1f0e6c2a4b8d9e7f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f", "burstable")
VLLM = Workload("llm", "vllm-6b7f9c-x2x4q", "vllm", "a1c3e5f7-0b2d-4f6a-8c9e-1d3f5a7b9c0e",
                "c0ffee00112233445566778899aabbccddeeff00112233445566778899aabbcc", "besteffort")
VK_LLAMA = Workload("graphics", "vk-llama-0", "llama", "7e6d5c4b-3a29-4180-9f8e-7d6c5b4a3921",
                    "9a8b7c6d5e4f30211203f4e5d6c7b8a99a8b7c6d5e4f30211203f4e5d6c7b8a9", "")
NOTEBOOK = Workload("notebooks", "jupyter-alice", "notebook", "0f1e2d3c-4b5a-4697-8877-665544332211",
                    "deadbeefcafe0123456789abcdef0123456789abcdef0123456789abcdef0123", "besteffort")
TRAINER = Workload("batch", "train-7", "trainer", "11111111-2222-4333-8444-555555555555",
                   "f00dfeedf00dfeedf00dfeedf00dfeedf00dfeedf00dfeedf00dfeedf00dfeed", "burstable")
DNS = Workload("kube-system", "coredns-5d78c9869d-7kq2p", "coredns", "22222222-3333-4444-8555-666666666666",
               "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", "burstable")

BY_PID = {48213: LLAMA, 51877: VLLM, 50102: VK_LLAMA, 50318: NOTEBOOK}
WORKLOADS = [LLAMA, VLLM, VK_LLAMA, NOTEBOOK, TRAINER, DNS]

MIG_3G = "MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b"  # index 1000
MIG_2G = "MIG-bd142880-e842-57ab-bec1-2975fd55911e"  # index 1001
MIG_1G = "MIG-a2cbd390-b656-5a4d-8bad-821df997d529"  # index 1002
CARD_1 = "GPU-975dcb6d-e070-3b4a-b7ed-013e50181d96"  # index 1

PODS = [
    Pod("llm", "llama-0", [Container("server", {"nvidia.com/mig-3g.40gb": [MIG_3G]})]),
    Pod("llm", "vllm-6b7f9c-x2x4q", [Container("vllm", {"nvidia.com/mig-2g.20gb": [MIG_2G]})]),
    # Time-slicing: the device plugin hands out replicas of card 1 as GPU-…::N.
    Pod("graphics", "vk-llama-0", [Container("llama", {"nvidia.com/gpu": [CARD_1 + "::0"]})]),
    Pod("notebooks", "jupyter-alice", [Container("notebook")]),
    Pod("batch", "train-7", [Container("trainer", {"nvidia.com/mig-1g.10gb": [MIG_1G]})]),
    Pod("kube-system", "coredns-5d78c9869d-7kq2p", [Container("coredns")]),
]


def make_kubelet_logs(log_dir: Path, workloads: list[Workload] = WORKLOADS) -> Path:
    """The kubelet's /var/log/pods and /var/log/containers for the workloads,
    as the kubelet lays them out: a directory per pod and container, and a link
    per container into it."""
    for w in workloads:
        pod_dir = log_dir / "pods" / f"{w.namespace}_{w.pod}_{w.pod_uid}"
        (pod_dir / w.container).mkdir(parents=True, exist_ok=True)
        (pod_dir / w.container / "0.log").write_text("")
        (log_dir / "containers").mkdir(parents=True, exist_ok=True)
        os.symlink(str(pod_dir / w.container / "0.log"),
                   log_dir / "containers" / f"{w.pod}_{w.namespace}_{w.container}-{w.container_id}.log")
    return log_dir
