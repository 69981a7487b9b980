"""``--source auto``: NVML where libnvidia-ml loads, nvidia-smi otherwise.

NVML answers in microseconds where ``nvidia-smi -q -x`` takes 0.4-6 s, so it
is preferred. The choice is made at the first read that finds either and then
kept, so the ``source`` label does not flip between scrapes; until then every
read fails with the reasons for both.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import ReadError
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.sources.base import read_telling_start
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
from mig_exporter.sources.nvml import NvmlSource

log = logging.getLogger("mig_exporter")


class AutoSource:
    def __init__(self, nvml: NvmlSource, smi: NvidiaSmiSource) -> None:
        self.nvml = nvml
        self.smi = smi
        self._chosen: NvmlSource | NvidiaSmiSource | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._chosen.name if self._chosen is not None else "auto"

    def choose(self) -> NvmlSource | NvidiaSmiSource:
        """The source to read from; raises ``ReadError`` naming why neither works.

        The checks run outside the lock: each has its own deadline, and a hung
        driver must not hold every other scrape behind it."""
        chosen = self._chosen
        if chosen is not None:
            return chosen
        nvml_ok, nvml_reason = self.nvml.ready()
        if nvml_ok:
            chosen = self.nvml
        else:
            smi_ok, smi_reason = self.smi.ready()
            if not smi_ok:
                raise ReadError(f"no source: {nvml_reason}; {smi_reason}")
            chosen = self.smi
        with self._lock:
            if self._chosen is None:
                if chosen is self.smi:
                    log.info("NVML unavailable (%s); falling back to nvidia-smi", nvml_reason)
                self._chosen = chosen
            return self._chosen

    @property
    def chosen(self) -> NvmlSource | NvidiaSmiSource | None:
        """The source chosen so far, without choosing (None: not yet)."""
        return self._chosen

    def ready(self) -> tuple[bool, str]:
        try:
            return self.choose().ready()
        except ReadError as e:
            return False, str(e)

    def describe(self) -> str:
        if self._chosen is None:
            return "auto (NVML, else nvidia-smi; neither found yet)"
        return f"auto: {self._chosen.describe()}"

    tells_start = True  # whichever is chosen (sources/base.py's read_telling_start)

    def read(self, deadline: Deadline | None = None, started: Callable[[], None] | None = None) -> Snapshot:
        return read_telling_start(self.choose(), deadline, started)
