"""What every GPU read path is: a name, a read under a deadline, readiness."""

from __future__ import annotations

from typing import Protocol

from mig_exporter.core.deadline import Deadline
from mig_exporter.model.snapshot import Snapshot


class Source(Protocol):
    """A read path: nvidia-smi, NVML or the demo."""

    @property
    def name(self) -> str: ...

    def read(self, deadline: Deadline | None = None) -> Snapshot:
        """One read, due at ``deadline`` or at the source's own timeout, whichever comes first;
        raises ``ReadError``, at the deadline too: a command is killed then, and NVML's calls,
        which no deadline reaches, run in a flight of their own (``core/flight.py``) that the
        read leaves at its deadline."""
        ...

    def ready(self) -> tuple[bool, str]: ...

    def describe(self) -> str: ...
