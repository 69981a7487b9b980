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
        raises ``ReadError``. A read no deadline reaches (an NVML call hung in the driver) is
        cut short for its caller by the flight it runs in (``core/flight.py``)."""
        ...

    def ready(self) -> tuple[bool, str]: ...

    def describe(self) -> str: ...
