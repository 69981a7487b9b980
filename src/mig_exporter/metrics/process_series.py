"""Which per-process series ``/metrics`` writes (``--collector.processes``): a pid label
makes new series at every restart of a job, and a Prometheus scraping many busy nodes pays
for each of them (docs/scale.md).

- ``all``: every process (the default);
- ``top=N``: the N processes holding the most memory on each device, and one ``pid="other"``
  series holding the memory of the rest, so that a sum over a device's processes still
  holds. A process whose memory the driver does not give is never folded into ``other``
  (its memory is unknown, not small): it keeps its own ``process_info``;
- ``none``: no per-process series.

The engine families follow the same setting (``select_engines``): under ``top=N`` the N engine
processes holding the most memory on each device, and under ``none`` none of them, keep their
own ``engine_memory_used_bytes`` and ``engine_info``; the rest are summed per engine into one
``pid="other"`` memory series and one ``pid="other"`` info series per device they are on. An
engine process on no GPU's list (``engine_info{index=""}``, what ``EngineHoldsNoGPUMemory``
reads by its pid) always keeps its own series.

The device families (``device_processes`` counts every process) and the families summed over
processes (pods, Slurm jobs, systemd units; the memory of an engine summed over its series) are
computed from every process, always.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mig_exporter.model.readings import EngineProcess
from mig_exporter.model.snapshot import Process

OTHER_PID = "other"  # the pid label of the series that holds a device's folded processes


@dataclass(frozen=True, slots=True)
class ProcessSeries:
    """``top`` is N of ``top=N`` (``None``: no limit); ``enabled`` is False for ``none``."""

    top: int | None = None
    enabled: bool = True

    @classmethod
    def parse(cls, text: str) -> ProcessSeries:
        """``all``, ``none`` or ``top=N`` (N ≥ 1); anything else is a ``ValueError`` saying so."""
        word = text.strip().lower()
        if word == "all":
            return ALL_PROCESSES
        if word == "none":
            return cls(enabled=False)
        if word.startswith("top="):
            number = word[4:]
            if number.isdigit() and int(number) >= 1:
                return cls(top=int(number))
        raise ValueError(f"{text!r} is not all, none or top=N with N a whole number of 1 or more")

    def __str__(self) -> str:
        if not self.enabled:
            return "none"
        return "all" if self.top is None else f"top={self.top}"

    def select(self, processes: Sequence[Process]) -> tuple[list[Process], dict[int, int]]:
        """The processes written one by one, in their order, and per device (placement index)
        the memory, in bytes, of the processes folded into ``other`` (only devices with some)."""
        if not self.enabled:
            return [], {}
        top = self.top
        if top is None:
            return list(processes), {}
        by_device: dict[int, list[int]] = {}  # positions in ``processes`` of those with known memory
        for position, p in enumerate(processes):
            if p.used_bytes is not None:
                by_device.setdefault(p.device_index, []).append(position)
        folded: set[int] = set()
        other: dict[int, int] = {}
        for device, known in by_device.items():
            if len(known) <= top:
                continue
            # The most memory first; among equals the lower pid, so the choice is stable.
            ranked = sorted(known, key=lambda i: (-(processes[i].used_bytes or 0), processes[i].pid))
            folded.update(ranked[top:])
            other[device] = sum(processes[i].used_bytes or 0 for i in ranked[top:])
        if not folded:
            return list(processes), {}
        return [p for position, p in enumerate(processes) if position not in folded], other

    def select_engines(self, engines: Sequence[EngineProcess]) -> tuple[list[EngineProcess], list[EngineProcess]]:
        """The engine processes written one by one, in their order, and those summed into their
        engine's ``pid="other"`` series (in their order).

        - An engine on no GPU's list (no device) is always written by itself: it is what
          EngineHoldsNoGPUMemory names by its pid.
        - Under ``top=N`` one whose memory is unknown is written by itself too, as a process of
          unknown memory is (its memory is unknown, not small), and does not count towards N.
        - The others are taken by memory (the most first; among equals the lower pid), each while
          every device it is on has fewer than N taken: at most N a device. Under ``none`` none.
        """
        if self.enabled and self.top is None:
            return list(engines), []
        top = self.top if self.enabled else 0
        taken = [not e.device_indexes or (self.enabled and e.used_bytes is None) for e in engines]
        if top:
            on_device: dict[int, int] = {}
            ranked = sorted((i for i, e in enumerate(engines) if not taken[i]),
                            key=lambda i: (-(engines[i].used_bytes or 0), engines[i].pid))
            for i in ranked:
                devices = engines[i].device_indexes
                if all(on_device.get(d, 0) < top for d in devices):
                    taken[i] = True
                    for d in devices:
                        on_device[d] = on_device.get(d, 0) + 1
        return ([e for e, t in zip(engines, taken, strict=True) if t],
                [e for e, t in zip(engines, taken, strict=True) if not t])


ALL_PROCESSES = ProcessSeries()
