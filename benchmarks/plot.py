"""Draw how a scrape's cost grows with processes and with MIG instances, from
the figures ``python -m benchmarks --json PATH`` writes::

    python -m benchmarks --json figures.json
    python -m benchmarks.plot figures.json docs/images/scaling.png

Two panels, one per scaling table of the benchmark: each measured point (p50,
ms) of parse, collect+render and their total on the nvidia-smi path, and the
in-process NVML scrape on the Python fake, with a least-squares line through
each; the NVML path through the C library too where benchmarks/nvml_lib.py
gave scaling points. Needs matplotlib (the ``bench`` extra); the series are
made without it (``series``), so the tests can check them.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PANELS = (("process_scaling", "processes", "with processes (1-8 H100 x 7 MIG, 16 or 32 per instance)"),
          ("instance_scaling", "devices", "with MIG instances (1-8 H100 x 7 MIG, no processes)"))
# What is drawn from each scaling point: key, label, colour.
MEASURES = (("parse_ms", "parse (-q -x and -L to snapshot)", "tab:blue"),
            ("render_ms", "collect+render", "tab:orange"),
            ("total_ms", "nvidia-smi path total", "black"),
            ("nvml_ms", "NVML scrape (Python fake)", "tab:green"))
NVML_LIB = ("NVML scrape (C fake libnvidia-ml)", "tab:red")


@dataclass(frozen=True)
class Series:
    label: str
    colour: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    slope: float  # ms per x
    intercept: float  # ms

    @property
    def legend(self) -> str:
        return f"{self.label}: {self.slope * 1000:.1f} µs each {self.intercept:+.2f} ms"


def least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def series(figures: dict, panel: str) -> list[Series]:
    """The lines of one panel: the benchmark's points and a least-squares line through each."""
    key, per, _ = next(p for p in PANELS if p[0] == panel)
    points = figures[key]["points"]
    out = []
    xs = [float(p[per]) for p in points]
    for measure, label, colour in MEASURES:
        ys = [p[measure] for p in points]
        if len(xs) >= 2 and all(isinstance(y, (int, float)) for y in ys):
            out.append(Series(label, colour, tuple(xs), tuple(ys), *least_squares(xs, ys)))
    lib = (figures.get("nvml_lib") or {}).get(key) or []
    lib_points = [(float(p[per]), float(p["ms"])) for p in lib if per in p and "ms" in p]
    if len(lib_points) >= 2:
        lx, ly = zip(*lib_points, strict=True)
        out.append(Series(NVML_LIB[0], NVML_LIB[1], lx, ly, *least_squares(list(lx), list(ly))))
    return out


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files (no display); imported here, so that a benchmark run
    without a picture needs no matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt: Any, fig: Any, output: Path, title: str, title_size: float, footer: str) -> None:
    """The picture's title and its footer (the machine, the load), laid out and written to ``output``."""
    fig.suptitle(title, fontsize=title_size)
    fig.text(0.5, 0.01, footer, ha="center", fontsize=8, color="dimgray", wrap=True)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    plt.close(fig)


def draw(figures: dict, output: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 6.2), dpi=100)
    for ax, (key, per, title) in zip(axes, PANELS, strict=True):
        for s in series(figures, key):
            ax.plot(s.xs, s.ys, "o", color=s.colour, markersize=5)
            ends = (0.0, max(s.xs) * 1.05)
            ax.plot(ends, [s.intercept + s.slope * x for x in ends], "-", color=s.colour, linewidth=1.2,
                    label=s.legend)
        ax.set_title(f"Scrape cost {title}", fontsize=11)
        ax.set_xlabel(f"{per} on the machine")
        ax.set_ylabel("ms of CPU per scrape (p50, in process)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8.5, loc="upper left", title="least-squares line", title_fontsize=8.5)
    load = figures.get("load_average") or {}
    note = "QUICK MODE, not a measurement; " if figures.get("quick") else ""
    save(plt, fig, output,
         "mig-exporter: how a scrape's own cost grows (python -m benchmarks --json; benchmarks/plot.py)", 12,
         f"{note}{figures.get('machine', '')}; load average {load.get('before', 0):.2f} → "
         f"{load.get('after', 0):.2f}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m benchmarks.plot FIGURES.json OUTPUT.png", file=sys.stderr)
        return 2
    draw(json.loads(Path(args[0]).read_text()), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
