"""``mig-exporter status``: this node at a glance, for a person at a terminal (or, as JSON,
for a script). One read's outcome in, text or a JSON-ready dict out; nothing here reads.

    DEVICE  CLASS                 STATE   MEMORY USED / TOTAL  PROCESSES
    0/mig0  a100-80g-mig-3g.40gb  in use     11.2 / 39.5 GiB          1
    1       a100-80g              in use     21.6 / 80.0 GiB          2

    Top process: 50102 python3, 20.0 GiB on 1 (pod ml/trainer-0)
    By class: 1 x a100-80g-mig-3g.40gb (in use), 1 x a100-80g (in use)   (x: a multiplication sign)
"""

from __future__ import annotations

from typing import Any

from mig_exporter.core.visible import shown, visible
from mig_exporter.metrics.scrape import ReadOutcome
from mig_exporter.model.capacity import FREE, count_by_class, device_states, processes_per_device
from mig_exporter.model.snapshot import Process, Snapshot

_GIB = 1024**3


def as_json(outcome: ReadOutcome) -> dict[str, Any]:
    """``devices`` (each with its name, placement index, class, UUID (what CUDA_VISIBLE_DEVICES
    takes), GPU and compute instance ids, state and why, memory used, free and total in bytes,
    and its process count, ``None`` where unknown), ``classes`` (class, devices, free, in use,
    unknown, memory free) and the ``top_process``; ``error`` when the read failed."""
    snapshot = outcome.snapshot
    if snapshot is None:
        return {"error": outcome.error, "devices": [], "classes": [], "top_process": None}
    on = processes_per_device(snapshot)
    states = device_states(snapshot, outcome.host)
    return {
        "devices": [{
            "device": d.display_name,
            "index": d.index,
            "class": d.device_class,
            "uuid": d.uuid,
            "gpu_instance": d.gpu_instance_id,
            "compute_instance": d.compute_instance_id,
            "state": states[d.index].state,
            "reason": states[d.index].reason,
            "memory_used_bytes": d.memory.used_bytes,
            "memory_free_bytes": d.memory.free_bytes,
            "memory_total_bytes": d.memory.total_bytes,
            "processes": on[d.index] if d.processes_known else None,
        } for d in snapshot.devices],
        "classes": [c.as_json() for c in count_by_class(snapshot, states=states)],
        "top_process": _top_json(outcome),
    }


def render_text(outcome: ReadOutcome) -> str:
    """The report for a terminal. Every name in it came from outside (a process names itself, a
    pod's name is its owner's choice): each line is made visible whole (core/visible.py), so an
    escape sequence, a carriage return, a newline or a bidi override in a name is shown, never
    obeyed, and the only line breaks are the report's own."""
    return "".join(visible(line) + "\n" for line in _lines(outcome))


def _lines(outcome: ReadOutcome) -> list[str]:
    snapshot = outcome.snapshot
    if snapshot is None:
        return [f"The read failed: {outcome.error}"]
    if not snapshot.devices:
        return ["No GPU devices: the driver lists no cards, or none could be read.", *_problems(snapshot)]
    on = processes_per_device(snapshot)
    states = device_states(snapshot, outcome.host)
    table = [("DEVICE", "CLASS", "STATE", "MEMORY USED / TOTAL", "PROCESSES")]
    for d in snapshot.devices:
        count = str(on[d.index]) if d.processes_known else "unknown"
        # Cells made visible before the widths are taken, so the columns line up as printed.
        table.append((shown(d.display_name), shown(d.device_class or "-"), states[d.index].state.replace("_", " "),
                      _used_total(d.memory.used_bytes, d.memory.total_bytes), count))
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    lines = [f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]:>{widths[3]}}  "
             f"{row[4]:>{widths[4]}}".rstrip() for row in table]
    top = _top(snapshot)
    lines.append("")
    lines.append(f"Top process: {_describe_top(outcome, top)}" if top is not None else "Top process: none")
    lines.append("By class: " + ", ".join(c.describe() for c in count_by_class(snapshot, states=states)))
    # Why a device with no process listed is not free: what a person acts on.
    not_free = [f"  {shown(d.display_name)}: {states[d.index].state.replace('_', ' ')}: {states[d.index].reason}"
                for d in snapshot.devices if states[d.index].state != FREE and not on[d.index]]
    if not_free:
        lines.append("Not free, with no process listed:")
        lines.extend(not_free)
    return lines + _problems(snapshot)


def _top(snapshot: Snapshot) -> Process | None:
    """The process holding the most memory on one device (the lower pid among equals);
    one of unknown memory only when no other is listed."""
    if not snapshot.processes:
        return None
    return min(snapshot.processes, key=lambda p: (p.used_bytes is None, -(p.used_bytes or 0), p.pid))


def _work(outcome: ReadOutcome, pid: int) -> str | None:
    """Whose the process is, as a person names it: its pod, else its Slurm job, else its systemd unit."""
    pod = outcome.pods.processes.get(pid) if outcome.pods is not None else None
    if pod is not None:
        return f"pod {shown(pod.namespace)}/{shown(pod.pod)}"
    owner = outcome.owners.processes.get(pid) if outcome.owners is not None else None
    if owner is not None and owner.slurm_job:
        return f"Slurm job {shown(owner.slurm_job)}"
    if owner is not None and owner.systemd_unit:
        return f"unit {shown(owner.systemd_unit)}"
    return None


def _describe_top(outcome: ReadOutcome, top: Process) -> str:
    assert outcome.snapshot is not None
    device = outcome.snapshot.device(top.device_index)
    where = shown(device.display_name) if device is not None else str(top.device_index)
    memory = "memory unknown" if top.used_bytes is None else f"{top.used_bytes / _GIB:.1f} GiB"
    work = _work(outcome, top.pid)
    return f"{top.pid} {shown(top.name) or '?'}, {memory} on {where}" + (f" ({work})" if work else "")


def _top_json(outcome: ReadOutcome) -> dict[str, Any] | None:
    assert outcome.snapshot is not None
    top = _top(outcome.snapshot)
    if top is None:
        return None
    device = outcome.snapshot.device(top.device_index)
    return {"pid": top.pid, "name": top.name, "device": device.display_name if device else None,
            "index": top.device_index, "memory_used_bytes": top.used_bytes, "work": _work(outcome, top.pid)}


def _used_total(used: int | None, total: int | None) -> str:
    def gib(value: int | None) -> str:
        return "?" if value is None else f"{value / _GIB:.1f}"

    return f"{gib(used)} / {gib(total)} GiB"


def _problems(snapshot: Snapshot) -> list[str]:
    if not snapshot.problems:
        return []
    return ["Problems in this read:", *(f"  - {problem}" for problem in snapshot.problems)]
