"""The kubelet pod-resources client against a fake kubelet serving the real
gRPC API on a unix socket, and the decoder against protobuf's own encoding
of our proto: chosen answers, generated ones, and mutated ones."""

from __future__ import annotations

import os
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_kubelet import Container, Pod, encode, pods_from_protobuf
from kube_node import PODS
from mig_exporter.kubernetes.podresources import (
    FIELDS,
    LIST_METHOD,
    ContainerDevices,
    ContainerResources,
    PodResources,
    PodResourcesClient,
    PodResourcesError,
    parse_list_response,
)


def test_the_decoder_s_field_numbers_are_the_proto_s(podresources_pb):
    for key, number in FIELDS.items():
        message, field = key.split(".")
        assert podresources_pb.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].number == number, key
    service = podresources_pb.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert f"/{service.full_name}/{service.methods_by_name['List'].name}" == LIST_METHOD


def test_decoding_what_protobuf_encodes_skipping_cpus_memory_and_topology(podresources_pb):
    data = encode(podresources_pb, [
        Pod("llm", "llama-0", [
            Container("server", {"nvidia.com/mig-3g.40gb": ["MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b"],
                                 "example.com/fpga": ["fpga-0", "fpga-1"]}),
            Container("sidecar"),
        ]),
        Pod("kube-system", "coredns-5d78c9869d-7kq2p", []),
    ]).SerializeToString()
    assert parse_list_response(data) == (
        PodResources("llm", "llama-0", (
            ContainerResources("server", (
                ContainerDevices("nvidia.com/mig-3g.40gb", ("MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b",)),
                ContainerDevices("example.com/fpga", ("fpga-0", "fpga-1")),
            )),
            ContainerResources("sidecar", ()),
        )),
        PodResources("kube-system", "coredns-5d78c9869d-7kq2p", ()),
    )


def test_an_empty_answer_is_no_pods():
    assert parse_list_response(b"") == ()


def test_unknown_fields_of_every_wire_type_are_skipped():
    # field 9 varint 150, field 10 fixed64, field 11 fixed32, then pod_resources {name: "a"}
    data = b"\x48\x96\x01" + b"\x51" + b"\0" * 8 + b"\x5d" + b"\0" * 4 + b"\x0a\x03\x0a\x01a"
    assert parse_list_response(data) == (PodResources("", "a", ()),)


@pytest.mark.parametrize("data", [
    b"\x0a\x05\x0a\x01",  # length runs past the end
    b"\x0a",  # truncated length
    b"\x0b",  # group start: not used by proto3
    b"\xff" * 11,  # varint over 64 bits
    b"\x08\x01",  # pod_resources as a varint
    b"\x00\x00",  # field number 0
])
def test_bytes_that_are_not_a_response_are_a_value_error(data):
    with pytest.raises(ValueError):
        parse_list_response(data)


# Names as a kubelet could send them, and some no kubelet would: empty, non-ASCII.
_NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=70)
_CONTAINERS = st.builds(Container, _NAMES, st.dictionaries(_NAMES, st.lists(_NAMES, max_size=4), max_size=3))
_PODS = st.lists(st.builds(Pod, _NAMES, _NAMES, st.lists(_CONTAINERS, max_size=3)), max_size=6)
_EXAMPLES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _expected(pods: list[Pod]) -> tuple[PodResources, ...]:
    return tuple(
        PodResources(p.namespace, p.name, tuple(
            ContainerResources(c.name, tuple(ContainerDevices(r, tuple(ids)) for r, ids in c.devices.items()))
            for c in p.containers))
        for p in pods)


@_EXAMPLES
@given(pods=_PODS)
def test_any_answer_protobuf_encodes_is_decoded_to_its_pods(podresources_pb, pods):
    assert parse_list_response(encode(podresources_pb, pods).SerializeToString()) == _expected(pods)


def _damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with one to four bytes overwritten, inserted or deleted, or cut short."""
    damaged = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(damaged)))
        edit = draw(st.sampled_from(["overwrite", "insert", "delete", "cut"]))
        byte = draw(st.integers(0, 255))
        if edit == "overwrite" and at < len(damaged):
            damaged[at] = byte
        elif edit == "insert":
            damaged.insert(at, byte)
        elif edit == "delete" and at < len(damaged):
            del damaged[at]
        elif edit == "cut":
            del damaged[at:]
    return bytes(damaged)


@_EXAMPLES
@given(drawn=st.data())
def test_a_damaged_answer_is_a_value_error_or_what_protobuf_reads_in_it(podresources_pb, drawn):
    from google.protobuf.message import DecodeError

    pods = drawn.draw(_PODS.filter(bool))
    data = _damaged(drawn.draw, encode(podresources_pb, pods).SerializeToString())
    try:
        ours = parse_list_response(data)
    except ValueError:
        return  # the only error it may raise
    try:
        theirs = podresources_pb.ListPodResourcesResponse.FromString(data)
    except DecodeError:
        return  # protobuf reads more (CPU ids, memory, topology) and rejects bad UTF-8, which we replace
    assert ours == pods_from_protobuf(theirs)


def test_list_over_the_socket(fake_kubelet):
    kubelet = fake_kubelet(PODS)
    pods = PodResourcesClient(kubelet.socket_path).list()
    assert [(p.namespace, p.name) for p in pods] == [(p.namespace, p.name) for p in PODS]
    assert pods[2].containers[0].devices == (
        ContainerDevices("nvidia.com/gpu", ("GPU-975dcb6d-e070-3b4a-b7ed-013e50181d96::0",)),)
    assert kubelet.calls == 1


def test_each_call_sees_the_kubelet_s_current_pods(fake_kubelet):
    kubelet = fake_kubelet(PODS)
    client = PodResourcesClient(kubelet.socket_path)
    assert len(client.list()) == len(PODS)
    kubelet.pods = PODS[:1]
    assert [p.name for p in client.list()] == ["llama-0"]


def test_a_kubelet_that_does_not_answer_costs_the_deadline_and_no_more(fake_kubelet):
    kubelet = fake_kubelet(PODS)
    kubelet.delay_s = 5
    started = time.monotonic()
    with pytest.raises(PodResourcesError, match=r"did not answer List within 0\.3s"):
        PodResourcesClient(kubelet.socket_path, timeout_s=2).list(0.3)
    assert time.monotonic() - started < 2  # generous: the deadline is 0.3 s


def test_the_client_s_own_deadline_caps_what_the_scrape_offers(fake_kubelet):
    kubelet = fake_kubelet(PODS)
    kubelet.delay_s = 5
    started = time.monotonic()
    with pytest.raises(PodResourcesError, match=r"within 0\.2s"):
        PodResourcesClient(kubelet.socket_path, timeout_s=0.2).list(30)
    assert time.monotonic() - started < 2


def test_an_answer_that_is_not_a_response_is_an_error(fake_kubelet):
    kubelet = fake_kubelet(PODS)
    kubelet.raw = b"\x0a\x05\x0a\x01"
    with pytest.raises(PodResourcesError, match="not a ListPodResourcesResponse"):
        PodResourcesClient(kubelet.socket_path).list()


def test_a_missing_socket_is_an_error_and_not_present(tmp_path):
    client = PodResourcesClient(str(tmp_path / "kubelet.sock"))
    assert client.present() is False
    with pytest.raises(PodResourcesError, match="no kubelet pod-resources socket at"):
        client.list()


def test_a_regular_file_is_not_a_socket(tmp_path):
    (tmp_path / "kubelet.sock").write_text("")
    assert PodResourcesClient(str(tmp_path / "kubelet.sock")).present() is False


def test_a_socket_nobody_listens_on_is_an_unavailable_error(tmp_path):
    from fake_kubelet import short_socket_dir

    path = os.path.join(short_socket_dir(), "kubelet.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)  # bound, never listening: connect is refused, as when the kubelet has died
    try:
        client = PodResourcesClient(path, timeout_s=2)
        assert client.present() is True
        with pytest.raises(PodResourcesError, match="UNAVAILABLE"):
            client.list()
    finally:
        s.close()
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
