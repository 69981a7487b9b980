"""The demo read path: bundled sample outputs, read through the same parser.

A newcomer without a GPU sees real series: an A100 in MIG mode with three
instances and their processes, and a whole A100 with a Vulkan (type G)
llama-server on it. The outputs are hand-written in the exact form of
``nvidia-smi -q -x`` and ``nvidia-smi -L`` of a 575 driver (whose XML has the
clock-event counters). The whole A100 is the sick card, so that every health
view has something to show: a pending row remap and an uncorrectable DRAM error
(needs reset), 8.4 s of a power brake since the driver loaded (not held now: a
static sample whose brake held would have a counter that never moves), its PCIe
link trained at x4 of x16, and a T.Limit margin; the MIG card's 0/mig0 counts an
uncorrectable SRAM error of its own, and its clocks idle (gpu_idle). Its kernel log (``samples/demo-kmsg.txt``,
on the clock of ``DEMO_BOOT_SECONDS``) has XIDs 13, 79 and 94 with their pids. ``nvidia-smi pmon -c 1 -s u``
(``samples/demo-pmon.txt``) gives the whole A100's processes their activity: the training job busy at the
card's 63 % SM and 41 % memory, the Vulkan llama-server beside it holding 20 GiB and computing nothing
(memory held idle); the MIG card's processes print ``-`` there, as a real card in MIG mode does.
Beside them, the host's processes (``samples/demo-proc.json``, /proc's own file
contents) show the engine metrics, including a llama-server that runs on the CPU.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from mig_exporter.core.deadline import Deadline
from mig_exporter.host.procfs import PidNamespace, ProcTable, parse_process
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from mig_exporter.nvidia_smi.pmon import parse_pmon, with_process_activity

# When the demo's machine booted, as its kernel log (samples/demo-kmsg.txt) counts: 5 minutes
# before demo.xml's <timestamp>, so its XIDs came in the minutes before the sample was taken.
# Fixed, not this machine's boot: the demo's XID times are the same on every machine and in
# every process (read --demo and serve --demo give the same bytes).
DEMO_BOOT_SECONDS = 1718114557.0 - 300.0  # Tue Jun 11 14:02:37 2024 UTC, less 5 minutes


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
        snapshot = snapshot_from_smi(sample_bytes("demo.xml"), sample_bytes("demo.L.txt"))
        return with_process_activity(snapshot, parse_pmon(sample_bytes("demo-pmon.txt")))


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
