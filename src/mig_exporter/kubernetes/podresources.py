"""The kubelet pod-resources API: which devices are allocated to which pod.

One gRPC call, ``v1.PodResourcesLister/List``, over the kubelet's unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock``), under a short deadline, on a
channel opened for the call and closed after it (a kubelet restart replaces
the socket; nothing is kept that could point at the old one). The answer is
decoded here, by ``parse_list_response``: pure, bytes in, frozen dataclasses
out, from the protobuf wire format and the field numbers of
``podresources.proto``. So the exporter needs grpcio to talk, but not protobuf
or generated code; grpcio is imported at the first call, so a host without a
kubelet never loads it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from mig_exporter.core.errors import ReadError

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_TIMEOUT_S = 2.0
LIST_METHOD = "/v1.PodResourcesLister/List"
# The kubelet's own client allows 16 MiB; gRPC's default of 4 MiB is reachable
# on a node with many pods, each listing its CPUs.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# Field numbers, as in podresources.proto (a test checks they agree).
FIELDS = {
    "ListPodResourcesResponse.pod_resources": 1,
    "PodResources.name": 1,
    "PodResources.namespace": 2,
    "PodResources.containers": 3,
    "ContainerResources.name": 1,
    "ContainerResources.devices": 2,
    "ContainerDevices.resource_name": 1,
    "ContainerDevices.device_ids": 2,
}


class PodResourcesError(ReadError):
    """The kubelet could not be asked, or its answer could not be read."""


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    resource_name: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ContainerResources:
    name: str
    devices: tuple[ContainerDevices, ...]


@dataclass(frozen=True, slots=True)
class PodResources:
    namespace: str
    name: str
    containers: tuple[ContainerResources, ...]


# --- pure decoding -------------------------------------------------------------------------------

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 64 bits")


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(number, wire type, value)`` of each field of one message; a
    length-delimited value is its bytes. Raises ``ValueError`` on bad input."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == _VARINT:
            value, pos = _varint(data, pos)
        elif wire in (_FIXED64, _FIXED32, _LENGTH):
            if wire == _LENGTH:
                size, pos = _varint(data, pos)
            else:
                size = 8 if wire == _FIXED64 else 4
            if pos + size > len(data):
                raise ValueError("field runs past the end of the message")
            value = data[pos:pos + size]
            pos += size
        else:
            raise ValueError(f"unsupported wire type {wire} (field {number})")
        if number == 0:
            raise ValueError("field number 0")
        yield number, wire, value


def _strings_and_messages(data: bytes, name: str) -> Iterator[tuple[str, bytes]]:
    """The length-delimited fields of a message, named ``Message.field``;
    fields this decoder does not know are skipped, as protobuf requires."""
    by_number = {number: key for key, number in FIELDS.items() if key.startswith(name + ".")}
    for number, wire, value in _fields(data):
        key = by_number.get(number)
        if key is None:
            continue
        if wire != _LENGTH:
            raise ValueError(f"{key} is not length-delimited")
        assert isinstance(value, bytes)
        yield key.split(".", 1)[1], value


def _text(value: bytes) -> str:
    return value.decode("utf-8", errors="replace")


def _container_devices(data: bytes) -> ContainerDevices:
    resource, ids = "", []
    for field, value in _strings_and_messages(data, "ContainerDevices"):
        if field == "resource_name":
            resource = _text(value)
        else:
            ids.append(_text(value))
    return ContainerDevices(resource, tuple(ids))


def _container(data: bytes) -> ContainerResources:
    name, devices = "", []
    for field, value in _strings_and_messages(data, "ContainerResources"):
        if field == "name":
            name = _text(value)
        else:
            devices.append(_container_devices(value))
    return ContainerResources(name, tuple(devices))


def _pod(data: bytes) -> PodResources:
    name = namespace = ""
    containers = []
    for field, value in _strings_and_messages(data, "PodResources"):
        if field == "name":
            name = _text(value)
        elif field == "namespace":
            namespace = _text(value)
        else:
            containers.append(_container(value))
    return PodResources(namespace, name, tuple(containers))


def parse_list_response(data: bytes) -> tuple[PodResources, ...]:
    """Decode a ``ListPodResourcesResponse``. Raises ``ValueError`` on bytes
    that are not one."""
    return tuple(_pod(value) for _, value in _strings_and_messages(data, "ListPodResourcesResponse"))


# --- the call ------------------------------------------------------------------------------------

class PodResourcesClient:
    """Asks the kubelet at ``socket_path`` for every pod's allocated devices."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def describe(self) -> str:
        return f"kubelet pod-resources at {self.socket_path}"

    def present(self) -> bool:
        """Whether a unix socket is at the path (the kubelet creates it at start)."""
        try:
            return stat.S_ISSOCK(os.stat(self.socket_path).st_mode)
        except OSError:
            return False

    def list(self, timeout_s: float | None = None) -> tuple[PodResources, ...]:
        """Every pod on the node. Waits at most ``timeout_s`` (default: the
        client's own), and raises ``PodResourcesError`` with the reason."""
        deadline = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        try:
            import grpc
        except ImportError as e:  # a broken install: say so, and carry on without allocations
            raise PodResourcesError(f"cannot ask the kubelet: grpcio does not load ({e})") from None
        if not os.path.exists(self.socket_path):
            raise PodResourcesError(f"no kubelet pod-resources socket at {self.socket_path}")
        if not os.access(self.socket_path, os.W_OK):
            # connect(2) on a unix socket needs write permission on it; the
            # kubelet's is root's, mode 0755. gRPC would say only "UNAVAILABLE".
            raise PodResourcesError(
                f"cannot connect to {self.socket_path}: permission denied (the socket is root's; "
                "run the exporter as uid 0, see docs/kubernetes.md)"
            )
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.enable_http_proxy", 0),  # a unix socket is never behind a proxy
        ]
        channel = grpc.insecure_channel("unix:" + os.path.abspath(self.socket_path), options=options)
        try:
            call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(LIST_METHOD)  # answer decoded here
            answer = call(b"", timeout=deadline)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise PodResourcesError(f"the kubelet at {self.socket_path} did not answer List within "
                                        f"{deadline:.1f}s") from None
            name = code.name if code is not None else "error"
            raise PodResourcesError(f"List at {self.socket_path} failed: {name}: {details}") from None
        finally:
            channel.close()
        try:
            return parse_list_response(answer)
        except ValueError as e:
            raise PodResourcesError(f"the kubelet at {self.socket_path} answered List with bytes that are not a "
                                    f"ListPodResourcesResponse: {e}") from None
