"""What every GPU read path is: a name, a read under a deadline, readiness."""

from __future__ import annotations

from collections.abc import Callable
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


def read_telling_start(source: Source, deadline: Deadline | None, started: Callable[[], None] | None) -> Snapshot:
    """``source.read``, calling ``started`` once the read's commands are running: what runs
    beside the read may start then, and not hold the interpreter while they are started. A
    source that starts no command (NVML, the demo) says so at once."""
    if getattr(source, "tells_start", False):
        return source.read(deadline, started=started)  # type: ignore[call-arg]
    if started is not None:
        started()
    return source.read(deadline)
