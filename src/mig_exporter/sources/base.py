"""What every GPU read path is: a name, a read under a deadline, readiness."""

from __future__ import annotations

from typing import Protocol

from mig_exporter.model.snapshot import Snapshot


class Source(Protocol):
    """A read path: nvidia-smi, NVML or the demo."""

    @property
    def name(self) -> str: ...

    def read(self, timeout_s: float | None = None) -> Snapshot: ...

    def ready(self) -> tuple[bool, str]: ...

    def describe(self) -> str: ...
