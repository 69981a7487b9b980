"""The kubelet's pod-resources ``List`` answer, decoded three ways (docs/performance.md,
"Pod-resources decoding"):

- **before**: ``parse_list_response`` as it was at ``BEFORE_COMMIT`` (read with ``git show``);
- **after**: ``parse_list_response`` of this checkout;
- **protobuf**: stubs generated from ``podresources.proto`` by grpcio-tools into a temporary
  directory (as the tests do), ``FromString``, then the same frozen dataclasses built from the
  messages, which is what the exporter would run with them; "parse only" is ``FromString``
  alone. The backend is the one this interpreter loads (``api_implementation.Type()``: upb
  where a wheel has it); the pure-Python backend is measured in a child process.

The answers are a node's, at 110 pods (the kubelet's default ``maxPods``) and 500: pods of 1
to 3 containers, a third of them with whole GPUs (``nvidia.com/gpu``, some time-sliced
``::N``), a third with MIG devices (``nvidia.com/mig-*``), some with another vendor's
(``example.com/fpga``, SR-IOV functions), each container with CPU ids, memory and NUMA
topology as a real kubelet's (tests/fake_kubelet.py ``encode``). Every decoder must give the
same pods before it is timed. Medians, run round robin so a busy moment falls on all alike.

    python -m benchmarks --podresources   # only this table
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from benchmarks.tables import f, table
from mig_exporter.kubernetes.podresources import parse_list_response

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from fake_kubelet import Container, Pod, compile_proto, encode, pods_from_protobuf  # noqa: E402 - needs tests/ on sys.path

SIZES = (110, 500)
# The commit before the decoder was reworked: "before" is its parse_list_response.
BEFORE_COMMIT = "fbc5efb"
DECODER_PATH = "src/mig_exporter/kubernetes/podresources.py"
SEED = 16

NAMESPACES = ("default", "kube-system", "monitoring", "ml-serve", "ml-train", "team-vision", "ingress-nginx")
APPS = ("llama-server", "triton", "coredns", "node-exporter", "trainer", "notebook", "redis", "api-gateway")
SIDECARS = ("istio-proxy", "log-shipper")
MIG_PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb")


def _uuid(rng: random.Random, prefix: str) -> str:
    h = f"{rng.getrandbits(128):032x}"
    return f"{prefix}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def node_pods(count: int, seed: int = SEED) -> list[Pod]:
    """``count`` pods of one GPU node: a third with whole GPUs, a third with MIG devices, one
    in ten with another vendor's devices, the rest with none; 1 to 3 containers each."""
    rng = random.Random(seed)
    gpus = [_uuid(rng, "GPU") for _ in range(8)]
    pods = []
    for i in range(count):
        app = APPS[i % len(APPS)]
        name = f"{app}-{rng.getrandbits(40):010x}-{rng.getrandbits(20):05x}"
        devices: dict[str, list[str]] = {}
        kind = i % 30
        if kind < 10:  # whole GPUs, every other pod on a time-sliced replica
            ids = rng.sample(gpus, 1 + i % 2)
            devices["nvidia.com/gpu"] = [f"{g}::{rng.randrange(4)}" if i % 4 == 1 else g for g in ids]
        elif kind < 20:  # MIG devices
            devices[f"nvidia.com/mig-{MIG_PROFILES[i % 3]}"] = [_uuid(rng, "MIG") for _ in range(1 + i % 2)]
        if kind % 10 == 9:  # another vendor's, beside or instead of NVIDIA's
            devices["example.com/fpga"] = [f"fpga-{rng.randrange(4)}"]
            devices["intel.com/sriov_netdevice"] = [f"0000:3b:02.{n}" for n in rng.sample(range(8), 2)]
        containers = [Container("main", devices)]
        containers += [Container(sidecar) for sidecar in SIDECARS[:i % 3]]
        pods.append(Pod(NAMESPACES[i % len(NAMESPACES)], name, containers))
    return pods


def decoder_before(commit: str = BEFORE_COMMIT) -> tuple[Callable[[bytes], tuple] | None, str]:
    """``parse_list_response`` as it was at ``commit``, and what it is (or why there is none)."""
    try:
        source = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{DECODER_PATH}"],
                                capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"n/a: no git checkout with {commit} ({e})"
    spec = importlib.util.spec_from_loader(f"podresources_at_{commit}", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    exec(compile(source, f"{commit}:{DECODER_PATH}", "exec"), module.__dict__)
    return module.parse_list_response, f"parse_list_response at {commit}"


def as_tuples(pods: tuple) -> tuple:
    """Pods as plain tuples: the decoder at another commit has dataclasses of its own."""
    return tuple(dataclasses.astuple(p) for p in pods)


def protobuf_backend() -> str:
    from google.protobuf import __version__
    from google.protobuf.internal import api_implementation

    return f"protobuf {__version__}, backend {api_implementation.Type()}"


@dataclass
class Answer:
    pods: int
    data: bytes
    containers: int
    device_ids: int

    @property
    def kib(self) -> float:
        return len(self.data) / 1024


def answers(pb: ModuleType, sizes: tuple[int, ...] = SIZES) -> list[Answer]:
    out = []
    for count in sizes:
        pods = node_pods(count)
        data = encode(pb, pods).SerializeToString()
        out.append(Answer(count, data, sum(len(p.containers) for p in pods),
                          sum(len(ids) for p in pods for c in p.containers for ids in c.devices.values())))
    return out


def round_robin(work: dict[str, Callable[[], object]], reps: int, warmup: int) -> dict[str, float]:
    """Median ms of each, timed in turn, ``reps`` times each."""
    for fn in work.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[int]] = {name: [] for name in work}
    for _ in range(reps):
        for name, fn in work.items():
            t = time.perf_counter_ns()
            fn()
            samples[name].append(time.perf_counter_ns() - t)
    return {name: statistics.median(ns) / 1e6 for name, ns in samples.items()}


@dataclass
class DecodeRow:
    pods: int
    answer_kib: float
    containers: int
    device_ids: int
    before_ms: float | None
    after_ms: float
    protobuf_ms: float
    protobuf_fields_ms: float
    protobuf_parse_ms: float
    pure_python_ms: float | None = None


@dataclass
class DecodeResults:
    backend: str
    before: str
    pure_python_backend: str
    reps: int
    pure_python_reps: int
    rows: list[DecodeRow]


def read_every_field(response: object) -> int:
    """Every field the exporter reads, read from protobuf's messages and dropped: the least
    the stubs would cost if the exporter used their messages as they are (upb makes the
    Python objects of a message's fields when they are read, not when it parses)."""
    ids = 0
    for p in response.pod_resources:
        p.name, p.namespace  # noqa: B018 - read for their cost
        for c in p.containers:
            c.name  # noqa: B018
            for d in c.devices:
                d.resource_name  # noqa: B018
                ids += len(tuple(d.device_ids))
    return ids


def decoders(data: bytes, pb: ModuleType, before: Callable[[bytes], tuple] | None) -> dict[str, Callable[[], object]]:
    """Each way of decoding ``data``, by the name the table gives it."""
    parse = pb.ListPodResourcesResponse.FromString
    work: dict[str, Callable[[], object]] = {
        "after": lambda: parse_list_response(data),
        "protobuf": lambda: pods_from_protobuf(parse(data)),
        "protobuf fields read": lambda: read_every_field(parse(data)),
        "protobuf parse": lambda: parse(data),
    }
    if before is not None:
        work["before"] = lambda: before(data)
    return work


def check_same(answer: Answer, pb: ModuleType, before: Callable[[bytes], tuple] | None) -> None:
    """Raises ``AssertionError`` unless every decoder reads the same pods in ``answer``."""
    ours = parse_list_response(answer.data)
    theirs = pods_from_protobuf(pb.ListPodResourcesResponse.FromString(answer.data))
    if ours != theirs:
        raise AssertionError(f"{answer.pods} pods: our decoder and protobuf's disagree")
    if before is not None and as_tuples(before(answer.data)) != as_tuples(ours):
        raise AssertionError(f"{answer.pods} pods: the decoder before and after disagree")


def measure(reps: int, warmup: int) -> DecodeResults:
    before, before_note = decoder_before()
    with tempfile.TemporaryDirectory(prefix="podresources-pb-") as tmp:
        pb = compile_proto(Path(tmp))
        rows = []
        for answer in answers(pb):
            check_same(answer, pb, before)
            ms = round_robin(decoders(answer.data, pb, before), reps, warmup)
            rows.append(DecodeRow(answer.pods, answer.kib, answer.containers, answer.device_ids, ms.get("before"),
                                  ms["after"], ms["protobuf"], ms["protobuf fields read"],
                                  ms["protobuf parse"]))
    pure_python_reps = max(3, reps // 5)  # some 15 times slower: fewer runs
    pure_note, by_pods = _pure_python(pure_python_reps, warmup)
    for row in rows:
        row.pure_python_ms = by_pods.get(row.pods)
    return DecodeResults(protobuf_backend(), before_note, pure_note, reps, pure_python_reps, rows)


def _pure_python(reps: int, warmup: int) -> tuple[str, dict[int, float]]:
    """protobuf's pure-Python backend (what a platform without a upb wheel gets), parse and
    convert, in a child: the backend is chosen once, at the first import."""
    env = dict(os.environ, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    try:
        child = subprocess.run([sys.executable, "-m", "benchmarks.podresources", "--pure-python-child",
                                str(reps), str(warmup)], env=env, capture_output=True, text=True, timeout=600,
                               check=True)
    except (OSError, subprocess.SubprocessError) as e:
        return f"n/a ({e})", {}
    found = json.loads(child.stdout)
    return found["backend"], {int(pods): ms for pods, ms in found["ms"].items()}


def _pure_python_child(reps: int, warmup: int) -> None:
    with tempfile.TemporaryDirectory(prefix="podresources-pb-") as tmp:
        pb = compile_proto(Path(tmp))
        ms = {}
        for answer in answers(pb):
            protobuf = decoders(answer.data, pb, None)["protobuf"]
            ms[answer.pods] = round_robin({"protobuf": protobuf}, reps, warmup)["protobuf"]
    print(json.dumps({"backend": protobuf_backend(), "ms": ms}))


def report(results: DecodeResults) -> list[str]:
    """The table, for benchmarks/run.py's report."""
    out = [f"pod-resources List decoding (ms, p50 of {results.reps}; protobuf = {results.backend}, FromString and "
           f"our dataclasses; fields read = FromString and every field we use read, no dataclasses; "
           f"parse only = FromString alone; pure-python = {results.pure_python_backend}, p50 of "
           f"{results.pure_python_reps}; before = {results.before})"]
    out.append(table(
        ["pods", "answer KiB", "containers", "device ids", "before", "after", "protobuf", "fields read",
         "parse only", "pure-python", "after / protobuf", "after / fields read", "before / after"],
        [[str(r.pods), f(r.answer_kib, 0), str(r.containers), str(r.device_ids), f(r.before_ms), f(r.after_ms),
          f(r.protobuf_ms), f(r.protobuf_fields_ms), f(r.protobuf_parse_ms), f(r.pure_python_ms),
          f(r.after_ms / r.protobuf_ms), f(r.after_ms / r.protobuf_fields_ms),
          f(None if r.before_ms is None else r.before_ms / r.after_ms)] for r in results.rows],
    ))
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--pure-python-child"]:
    _pure_python_child(int(sys.argv[2]), int(sys.argv[3]))
