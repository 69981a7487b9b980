"""A fake kubelet: the real pod-resources gRPC API, served by grpcio on a unix socket.

The messages and the service come from ``src/mig_exporter/kubernetes/podresources.proto``,
compiled with grpcio-tools when the tests start (``compile_proto``), so the
bytes the exporter decodes are what the protobuf library encodes, not what
our own decoder would expect. Each answer also carries the fields the exporter
does not read (CPU ids, memory, NUMA topology), as a real kubelet's does.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import grpc

from mig_exporter.kubernetes.podresources import ContainerDevices, ContainerResources, PodResources

PROTO = Path(__file__).resolve().parent.parent / "src" / "mig_exporter" / "kubernetes" / "podresources.proto"


def compile_proto(out: Path) -> ModuleType:
    """``podresources_pb2``, generated into ``out`` by grpcio-tools' protoc."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(PROTO, out / PROTO.name)
    rc = protoc.main(["protoc", f"-I{out}", f"--python_out={out}", str(out / PROTO.name)])
    assert rc == 0, "protoc failed on podresources.proto"
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("podresources_pb2")
    finally:
        sys.path.remove(str(out))


@dataclass
class Container:
    name: str
    devices: dict[str, list[str]] = field(default_factory=dict)  # resource name -> device ids


@dataclass
class Pod:
    namespace: str
    name: str
    containers: list[Container]


def encode(pb: ModuleType, pods: list[Pod]) -> object:
    """A ListPodResourcesResponse, with CPUs, memory and topology like a real one's."""
    response = pb.ListPodResourcesResponse()
    for pod in pods:
        p = response.pod_resources.add(name=pod.name, namespace=pod.namespace)
        for c in pod.containers:
            container = p.containers.add(name=c.name, cpu_ids=[2, 3, 66, 67])
            memory = container.memory.add(memory_type="memory", size=8 << 30)
            memory.topology.nodes.add(ID=0)
            for resource, ids in c.devices.items():
                devices = container.devices.add(resource_name=resource, device_ids=ids)
                devices.topology.nodes.add(ID=1)
    return response


def pods_from_protobuf(response: object) -> tuple[PodResources, ...]:
    """The exporter's pods from protobuf's decoding of a ListPodResourcesResponse."""
    return tuple(
        PodResources(p.namespace, p.name, tuple(
            ContainerResources(c.name, tuple(
                ContainerDevices(d.resource_name, tuple(d.device_ids)) for d in c.devices
            )) for c in p.containers
        )) for p in response.pod_resources
    )


class FakeKubelet:
    """Serves ``List`` on ``socket_path`` until ``stop()``. ``pods`` may be
    replaced at any time; ``delay_s`` makes each answer late; ``raw`` sends
    those bytes instead of a response."""

    def __init__(self, pb: ModuleType, socket_path: str, pods: list[Pod] | None = None) -> None:
        self.pb = pb
        self.pods = list(pods or [])
        self.delay_s = 0.0
        self.raw: bytes | None = None
        self.calls = 0
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        # Service and method names from the compiled proto: /v1.PodResourcesLister/List.
        service = pb.DESCRIPTOR.services_by_name["PodResourcesLister"]
        method = service.methods_by_name["List"]
        handler = grpc.method_handlers_generic_handler(service.full_name, {
            method.name: grpc.unary_unary_rpc_method_handler(
                self._list,
                request_deserializer=pb.ListPodResourcesRequest.FromString,
                response_serializer=lambda r: r if isinstance(r, bytes) else r.SerializeToString(),
            ),
        })
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"unix:{socket_path}")
        self.server.start()
        assert os.path.exists(socket_path)

    def _list(self, request: object, context: grpc.ServicerContext) -> object:
        with self._lock:
            self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.raw is not None:
            return self.raw
        return encode(self.pb, self.pods)

    def stop(self) -> None:
        self.server.stop(grace=0).wait(5)


def short_socket_dir() -> str:
    """A directory for the socket: a unix socket's path must fit in 108 bytes,
    which pytest's tmp_path names can pass."""
    return tempfile.mkdtemp(prefix="kubelet-", dir="/tmp")
