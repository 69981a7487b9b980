"""The kubelet pod-resources API: which devices are allocated to which pod.

One gRPC call, ``v1.PodResourcesLister/List``, over the kubelet's unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock``), under a short deadline, on a
channel opened for the call and closed after it (a kubelet restart replaces
the socket; nothing is kept that could point at the old one). The answer is
decoded here, by ``parse_list_response``: pure, bytes in, frozen dataclasses
out, from the protobuf wire format and the field numbers of
``podresources.proto``. So the exporter needs grpcio to talk, but not protobuf
or generated code; grpcio is imported at the first call, so a host without a
kubelet never loads it. The decoder is within 1.3x of protobuf's generated
stubs (docs/performance.md, "Pod-resources decoding").
"""

from __future__ import annotations

import os
import stat
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
_FIXED_SIZES = {_FIXED64: 8, _FIXED32: 4}


def _fields_read(message: str) -> dict[int, str]:
    """The fields of ``message`` this decoder reads: number -> ``Message.field``."""
    return {number: key for key, number in FIELDS.items() if key.split(".", 1)[0] == message}


# Built once here, not per message: a node's answer holds thousands of them.
_RESPONSE = _fields_read("ListPodResourcesResponse")
_POD = _fields_read("PodResources")
_CONTAINER = _fields_read("ContainerResources")
_DEVICES = _fields_read("ContainerDevices")
_POD_NAME, _POD_NAMESPACE = FIELDS["PodResources.name"], FIELDS["PodResources.namespace"]
_CONTAINER_NAME = FIELDS["ContainerResources.name"]
_RESOURCE_NAME = FIELDS["ContainerDevices.resource_name"]


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 64 bits")


def _read_fields(data: bytes, pos: int, end: int, wanted: dict[int, str]) -> list[tuple[int, int, int]]:
    """``(number, start, stop)`` of each field in ``wanted`` of the message at ``data[pos:end]``,
    in order; the others are skipped, as protobuf requires. Offsets, not slices: a nested
    message is read where it lies. Raises ``ValueError`` on bad input."""
    found = []
    while pos < end:
        key = data[pos]
        if key < 0x80:  # a field number below 16: one byte
            pos += 1
        else:
            key, pos = _varint(data, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire == _LENGTH:
            if pos < end and data[pos] < 0x80:
                size = data[pos]
                pos += 1
            else:
                size, pos = _varint(data, pos, end)
        elif wire == _VARINT:
            pos = _varint(data, pos, end)[1]
            size = 0
        elif wire in _FIXED_SIZES:
            size = _FIXED_SIZES[wire]
        else:
            raise ValueError(f"unsupported wire type {wire} (field {number})")
        stop = pos + size
        if stop > end:
            raise ValueError("field runs past the end of the message")
        if number in wanted:
            if wire != _LENGTH:
                raise ValueError(f"{wanted[number]} is not length-delimited")
            found.append((number, pos, stop))
        pos = stop
    return found


def _text(data: bytes, start: int, stop: int) -> str:
    return data[start:stop].decode("utf-8", errors="replace")


def _container_devices(data: bytes, start: int, end: int) -> ContainerDevices:
    resource, ids = "", []
    for number, field_start, field_stop in _read_fields(data, start, end, _DEVICES):
        if number == _RESOURCE_NAME:
            resource = _text(data, field_start, field_stop)
        else:
            ids.append(_text(data, field_start, field_stop))
    return ContainerDevices(resource, tuple(ids))


def _container(data: bytes, start: int, end: int) -> ContainerResources:
    name, devices = "", []
    for number, field_start, field_stop in _read_fields(data, start, end, _CONTAINER):
        if number == _CONTAINER_NAME:
            name = _text(data, field_start, field_stop)
        else:
            devices.append(_container_devices(data, field_start, field_stop))
    return ContainerResources(name, tuple(devices))


def _pod(data: bytes, start: int, end: int) -> PodResources:
    name = namespace = ""
    containers = []
    for number, field_start, field_stop in _read_fields(data, start, end, _POD):
        if number == _POD_NAME:
            name = _text(data, field_start, field_stop)
        elif number == _POD_NAMESPACE:
            namespace = _text(data, field_start, field_stop)
        else:
            containers.append(_container(data, field_start, field_stop))
    return PodResources(namespace, name, tuple(containers))


def parse_list_response(data: bytes) -> tuple[PodResources, ...]:
    """Decode a ``ListPodResourcesResponse``. Raises ``ValueError`` on bytes
    that are not one."""
    fields = _read_fields(data, 0, len(data), _RESPONSE)
    return tuple(_pod(data, field_start, field_stop) for _, field_start, field_stop in fields)


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
