"""The demo read path: bundled sample outputs, read through the same parser.

A newcomer without a GPU sees real series: an A100 in MIG mode with three
instances and their processes, and a whole A100 with a Vulkan (type G)
llama-server on it. The outputs are hand-written in the exact form of
``nvidia-smi -q -x`` and ``nvidia-smi -L``. Beside them, the host's
processes (``samples/demo-proc.json``, /proc's own file contents) show the
engine metrics, including a llama-server that runs on the CPU.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from mig_exporter.core.deadline import Deadline
from mig_exporter.host.procfs import PidNamespace, ProcTable, parse_process
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.nvidia_smi.build import snapshot_from_smi


def sample_bytes(name: str) -> bytes:
    return resources.files("mig_exporter").joinpath("samples").joinpath(name).read_bytes()


class DemoSource:
    """Serves the bundled sample at every read, parsed afresh each time."""

    name = "demo"

    def ready(self) -> tuple[bool, str]:
        return True, "demo sample bundled with the package"

    def describe(self) -> str:
        return "demo (bundled sample: an A100 in MIG mode and a whole A100; not a real GPU)"

    def read(self, deadline: Deadline | None = None) -> Snapshot:
        return snapshot_from_smi(sample_bytes("demo.xml"), sample_bytes("demo.L.txt"))


class DemoProcs:
    """The demo host's /proc, parsed afresh at each read by the /proc parsers."""

    root = "demo"

    def describe(self) -> str:
        return "bundled demo processes"

    def _document(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(sample_bytes("demo-proc.json"))
        return document

    def read_namespace(self) -> PidNamespace:
        return PidNamespace(self.root, self._document()["self_pid_namespace"])

    def read(self) -> ProcTable:
        doc = self._document()
        entries = [
            parse_process(p["stat"].encode(), p["cmdline"].encode(), p["exe"], p["tasks"])
            for p in doc["processes"]
        ]
        return ProcTable(PidNamespace(self.root, doc["self_pid_namespace"]), {e.pid: e for e in entries})
