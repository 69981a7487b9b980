"""What every benchmark report prints: Markdown tables, figures as text, the machine line.

Imports nothing of benchmarks/: the reports of run.py, procscan.py, podresources.py and
fleet.py import this.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the first column left-aligned, the figures right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))) + " |"

    rule = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def f(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None or value != value else f"{value:.{digits}f}"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = []
    for dist in ("lxml", "prometheus-client", "nvidia-ml-py", "nvitop-exporter", "nvitop"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist} -")
    return (f"{cpu}, {os.cpu_count()} CPU(s), Linux {platform.release()}, "
            f"Python {platform.python_version()}; " + ", ".join(versions))
