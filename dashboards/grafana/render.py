#!/usr/bin/env python3
"""Draw the Grafana dashboards' main panels as PNGs, for the README and docs.

    python dashboards/grafana/render.py [--out docs/images] [--collect 75]

Not a test, and not part of pytest: a script to rerun whenever the dashboards
change. It brings up, all on 127.0.0.1 and under one temporary directory:

- ``python -m mig_exporter serve`` (this checkout's src/) over a fake
  nvidia-smi that answers with the demo sample (samples/demo.xml) with its
  memory, temperature, power and utilisation changing over time (a variant of
  the sample per second, the memory totals kept), and the demo host's
  processes as a fabricated /proc (samples/demo-proc.json), so the engine
  panels have their engines;
- a real Prometheus (``prometheus`` on PATH) scraping it every second, with
  the target's ``instance`` relabelled to a node name a reader recognises;

lets it collect for ``--collect`` seconds, then for each picture reads the
panels' own queries from overview.json and node.json (at run time: the
dashboards are the source of truth), fills in the variables (``$node`` the
exporter's instance, ``$card`` all), asks Prometheus (query_range for a time
series, an instant query for a stat) and draws the answers as plain SVG made
here: no JavaScript, no web fonts, nothing fetched. Time series are line charts
with axes and the panel's legend (its ``legendFormat``, its table of
calculations), values in the panel's unit as Grafana writes it; stat panels
are the number in the colour of the panel's thresholds. Headless Chromium
(Debian's ``chromium``) turns each page into a PNG. Everything it started is
stopped and its temporary directory removed, whatever happens.
"""

from __future__ import annotations

import argparse
import copy
import html
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lxml import etree

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "dashboards" / "grafana"
SAMPLES = REPO / "src" / "mig_exporter" / "samples"
HOST = "127.0.0.1"
STARTUP_S = 30.0
STOP_S = 10.0
LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")

# --- the pictures ---------------------------------------------------------------------------------

# Each picture: the dashboard, then rows of panels (by title; stat and time series
# panels only), each row with its height in CSS pixels. Panels of a row share its
# width in the proportions of their gridPos widths in the dashboard.
PICTURES: dict[str, tuple[str, list[tuple[int, list[str]]]]] = {
    "overview.png": ("overview.json", [
        (120, ["Devices", "GPU processes", "Memory used (no double counting)", "Engines holding no GPU memory",
               "Failing reads", "MIG cards with nothing carved"]),
        (300, ["Memory used by card and GPU instance"]),
        (300, ["Memory used by device"]),
    ]),
    "node.png": ("node.json", [
        (300, ["Memory used by device"]),
        (300, ["Memory free by device"]),
        (250, ["Temperature", "Power draw", "Utilisation (whole cards)"]),
    ]),
    "health.png": ("health.json", [
        (460, ["Temperature and thresholds", "Power and limits"]),
        (420, ["Clocks", "ECC errors since the driver loaded"]),
        (260, ["Remapped rows", "Row remap availability (banks)", "Retired pages and recovery action"]),
    ]),
}
WIDTH = 1200  # CSS pixels; the PNG has --scale times as many

# --- changing values: the demo sample, one variant per second ---------------------------------------


def _ramp(t: float, start: float, end: float) -> float:
    """0 before start, 1 after end, smooth between."""
    x = min(1.0, max(0.0, (t - start) / (end - start)))
    return x * x * (3 - 2 * x)


@dataclass
class Moment:
    """What the demo host does at t (0 to 1 over the collection), in MiB, °C, W and %."""

    mig_used: list[float]  # card 0's MIG devices, in the sample's order (3g.40gb, 2g.20gb, 1g.10gb)
    llama_mig: float  # pid 48213 on the 3g.40gb
    vllm_mig: float  # pid 51877 (vLLM's EngineCore) on the 2g.20gb
    trainer: float  # pid 50318 (train.py) on card 1
    temperature: tuple[float, float]
    power: tuple[float, float]
    utilisation: float  # card 1 (a MIG card has none)


def moment(t: float) -> Moment:
    # The 3g.40gb's llama-server fills its KV cache as requests arrive.
    llama = 11520 + 15500 * _ramp(t, 0.05, 0.6) + 700 * math.sin(2 * math.pi * 3 * t) * _ramp(t, 0.05, 0.3)
    # vLLM on the 2g.20gb restarts with a larger gpu_memory_utilization and preallocates.
    vllm = 9216 if t < 0.3 else 2048 + 15700 * _ramp(t, 0.3, 0.36)
    # A training run on card 1: three epochs, memory growing within each and freed between.
    epoch = (t * 3) % 1.0
    trainer = 1620 + 12800 * math.sqrt(epoch)
    busy = 0.35 + 0.6 * math.sqrt(epoch)
    mig_used = [llama + 143, vllm + 35, 13.0]
    return Moment(
        mig_used=mig_used, llama_mig=llama, vllm_mig=vllm, trainer=trainer,
        temperature=(34 + 14 * _ramp(t, 0.05, 0.7), 51 + 12 * busy),
        power=(87 + 160 * _ramp(t, 0.05, 0.6) + 20 * math.sin(2 * math.pi * 5 * t), 140 + 250 * busy),
        utilisation=100 * busy,
    )


def _set_memory(usage: etree._Element, used_mib: float) -> None:
    """``used`` to used_mib, ``free`` to what is left of ``total`` (less ``reserved``)."""
    total = int(usage.findtext("total", "0").split()[0])
    reserved = int((usage.findtext("reserved") or "0 MiB").split()[0])
    used = round(used_mib)
    usage.find("used").text = f"{used} MiB"  # type: ignore[union-attr]
    usage.find("free").text = f"{total - reserved - used} MiB"  # type: ignore[union-attr]


def _set(gpu: etree._Element, path: str, text: str) -> None:
    element = gpu.find(path)
    assert element is not None, f"demo.xml has no {path}"
    element.text = text


def variant(sample: etree._ElementTree, m: Moment) -> bytes:
    tree = copy.deepcopy(sample)
    mig_card, whole_card = tree.getroot().findall("gpu")
    migs = mig_card.findall("mig_devices/mig_device")
    carved = [int(mig.findtext("fb_memory_usage/used", "0").split()[0]) for mig in migs]
    card_used = int(mig_card.findtext("fb_memory_usage/used", "0").split()[0])
    for mig, used in zip(migs, m.mig_used, strict=True):
        _set_memory(mig.find("fb_memory_usage"), used)  # type: ignore[arg-type]
    # The card's own count: its MIG devices' and what the driver keeps outside them.
    _set_memory(mig_card.find("fb_memory_usage"), card_used - sum(carved) + sum(m.mig_used))  # type: ignore[arg-type]
    processes = {p.findtext("pid"): p for card in (mig_card, whole_card)
                 for p in card.findall("processes/process_info")}
    llama_whole = int(processes["50102"].findtext("used_memory", "0").split()[0])
    for pid, used in (("48213", m.llama_mig), ("51877", m.vllm_mig), ("50318", m.trainer)):
        _set(processes[pid], "used_memory", f"{round(used)} MiB")
    _set_memory(whole_card.find("fb_memory_usage"), llama_whole + m.trainer + 10)  # type: ignore[arg-type]
    for card, temperature, power in zip((mig_card, whole_card), m.temperature, m.power, strict=True):
        _set(card, "temperature/gpu_temp", f"{round(temperature)} C")
        _set(card, "gpu_power_readings/power_draw", f"{power:.2f} W")
    _set(whole_card, "utilization/gpu_util", f"{round(m.utilisation)} %")
    return etree.tostring(tree, xml_declaration=True, encoding="UTF-8")


def make_fake_smi(root: Path, seconds: int) -> tuple[Path, Path]:
    """A fake nvidia-smi answering ``-q -x`` with the variant for the seconds since
    the time in its ``start`` file (the first variant before that, the last after),
    and ``-L`` with the sample's listing. Returns the script and the start file."""
    root.mkdir()
    sample = etree.parse(str(SAMPLES / "demo.xml"), etree.XMLParser(remove_blank_text=False))
    for i in range(seconds + 1):
        (root / f"q.{i}.xml").write_bytes(variant(sample, moment(i / seconds)))
    (root / "L.txt").write_bytes((SAMPLES / "demo.L.txt").read_bytes())
    start = root / "start"
    start.write_text(f"{int(time.time()) + 10**6}\n")  # the first variant until the collection begins
    script = root / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f"d='{root}'\n"
        'i=$(( $(date +%s) - $(cat "$d/start") ))\n'
        "[ $i -lt 0 ] && i=0\n"
        f"[ $i -gt {seconds} ] && i={seconds}\n"
        'case "$1" in\n'
        '  -q) cat "$d/q.$i.xml" ;;\n'
        '  -L) cat "$d/L.txt" ;;\n'
        '  *) echo "fake nvidia-smi: unknown arguments: $*" >&2; exit 2 ;;\n'
        "esac\n"
    )
    script.chmod(0o755)
    return script, start


def make_proc(root: Path) -> Path:
    """The demo host's processes (samples/demo-proc.json) as a /proc tree."""
    demo = json.loads((SAMPLES / "demo-proc.json").read_text())
    for p in demo["processes"]:
        d = root / p["stat"].split(" ", 1)[0]
        (d / "task").mkdir(parents=True)
        (d / "ns").mkdir()
        (d / "stat").write_text(p["stat"] + "\n")
        (d / "cmdline").write_text(p["cmdline"])
        (d / "cgroup").write_text("0::/system.slice\n")
        if p["exe"] is not None:
            os.symlink(p["exe"], d / "exe")
        os.symlink(demo["self_pid_namespace"], d / "ns" / "pid")
        for tid in p["tasks"]:
            (d / "task" / str(tid)).mkdir()
    os.symlink(str(demo["self"]), root / "self")
    return root


# --- the exporter and Prometheus --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_S)


@contextmanager
def exporter(smi: Path, proc: Path, cwd: Path) -> Iterator[str]:
    """``mig-exporter serve`` from this checkout; its address."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    process = subprocess.Popen(
        [sys.executable, "-m", "mig_exporter", "serve", "--web.listen-address", f"{HOST}:0",
         "--source", "nvidia-smi", "--nvidia-smi", str(smi), "--proc.root", str(proc), "--no-kubernetes"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd, env=env,
    )
    lines: list[str] = []
    found = threading.Event()

    def drain() -> None:
        assert process.stderr is not None
        for raw in iter(process.stderr.readline, b""):
            lines.append(raw.decode(errors="replace").rstrip("\n"))
            if LISTENING.search(lines[-1]):
                found.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        if not found.wait(STARTUP_S):
            raise RuntimeError("the exporter did not start:\n" + "\n".join(lines))
        m = next(m for line in lines if (m := LISTENING.search(line)))
        yield f"{HOST}:{m.group(1)}"
    finally:
        _stop(process)
        reader.join(timeout=STOP_S)
        assert process.stderr is not None
        process.stderr.close()
    if any("Traceback" in line for line in lines):
        raise RuntimeError("the exporter logged a traceback:\n" + "\n".join(lines))


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}?{urllib.parse.urlencode(params)}", timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]


@contextmanager
def prometheus(target: str, instance: str, tmp: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("render.py needs the prometheus binary on PATH (Debian: apt-get install prometheus)")
    config = tmp / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "mig-exporter",
            "static_configs": [{"targets": [target]}],
            # What a reader sees in the legends: a node's name, not a random local port.
            "relabel_configs": [{"target_label": "instance", "replacement": instance}],
        }],
    }))
    port = _free_port()
    log_path = tmp / "prometheus.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address={HOST}:{port}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
        )
    try:
        server = Prometheus(f"http://{HOST}:{port}")
        deadline = time.monotonic() + STARTUP_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"prometheus exited {process.returncode}:\n{log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready after {STARTUP_S}s:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield server
    finally:
        _stop(process)


def wait_for_data(prom: Prometheus, instance: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    query = f'mig_exporter_read_success{{instance="{instance}"}} == 1'
    while not prom.get("/api/v1/query", query=query)["result"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no successful read scraped in {STARTUP_S}s")
        time.sleep(0.5)


# --- queries --------------------------------------------------------------------------------------


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]  # (unix time, value)


def fill_variables(expr: str, variables: dict[str, str]) -> str:
    for name, value in variables.items():
        expr = re.sub(r"\$\{" + name + r"(?::\w+)?\}|\$" + name + r"\b", value.replace("\\", "\\\\"), expr)
    if left := re.search(r"\$(\{|\w+)", expr):
        raise RuntimeError(f"no value for {left.group(0)} in {expr}")
    return expr


def legend_name(target: dict[str, Any], labels: dict[str, str], expr: str) -> str:
    fmt = target.get("legendFormat") or "__auto"
    if fmt != "__auto":
        return re.sub(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    rest = {k: v for k, v in labels.items() if k != "__name__"}
    name = labels.get("__name__", "")
    if not rest:
        return name or expr
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(rest.items())) + "}"


def _number(text: str) -> float:
    return float(text)  # Prometheus writes NaN and ±Inf as float() reads them


def run_queries(prom: Prometheus, panel: dict[str, Any], variables: dict[str, str],
                start: float, end: float, step: float) -> list[Series]:
    series: list[Series] = []
    for target in panel.get("targets", []):
        if target.get("hide"):
            continue
        expr = fill_variables(target["expr"], variables)
        try:
            if panel["type"] == "stat" and target.get("instant"):
                data = prom.get("/api/v1/query", query=expr, time=f"{end:.3f}")
                rows = [(r["metric"], [r["value"]]) for r in data["result"]]
            else:
                data = prom.get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                                step=f"{step:g}")
                rows = [(r["metric"], r["values"]) for r in data["result"]]
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"panel {panel['title']!r}: {expr}: {e.read().decode(errors='replace')}") from e
        for labels, values in rows:
            series.append(Series(legend_name(target, labels, expr), [(float(t), _number(v)) for t, v in values]))
    return series


# --- units, as Grafana writes them ---------------------------------------------------------------------

_IEC = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
_SI = ["B", "kB", "MB", "GB", "TB", "PB"]


def _decimals(x: float) -> int:
    """Three significant digits, as Grafana's auto decimals give for most values."""
    x = abs(x)
    if x == 0 or x >= 100:
        return 0
    return 1 if x >= 10 else 2


def _fixed(x: float, decimals: int | None = None) -> str:
    if decimals is None:
        decimals = 0 if x == int(x) else _decimals(x)  # Grafana writes a whole number without decimals
    d = decimals
    text = f"{x:.{d}f}"
    return "0" if re.fullmatch(r"-?0(\.0*)?", text) else text


@dataclass
class Scale:
    """Values divided by factor, then written with suffix (a space before it unless it is %)."""

    factor: float
    suffix: str

    def text(self, value: float, decimals: int | None = None) -> str:
        number = _fixed(value / self.factor, decimals)
        if not self.suffix:
            return number
        return number + ("" if self.suffix == "%" else " ") + self.suffix


def scale_for(unit: str, magnitude: float) -> Scale:
    """The scale Grafana would pick for values around magnitude."""
    m = abs(magnitude)
    if unit in ("bytes", "decbytes"):
        base, names = (1024, _IEC) if unit == "bytes" else (1000, _SI)
        k = 0
        while k < len(names) - 1 and m >= base ** (k + 1):
            k += 1
        return Scale(float(base**k), names[k])
    if unit == "percentunit":
        return Scale(0.01, "%")
    if unit == "percent":
        return Scale(1, "%")
    if unit == "celsius":
        return Scale(1, "°C")
    if unit == "watt":
        return Scale(1000, "kW") if m >= 1000 else Scale(1, "W")
    if unit == "hertz":
        return next((Scale(f, suffix) for f, suffix in ((1e9, "GHz"), (1e6, "MHz"), (1e3, "kHz")) if m >= f),
                    Scale(1, "Hz"))
    if unit == "s":
        if 0 < m < 1:
            return Scale(0.001, "ms")
        return Scale(60, "min") if m >= 60 else Scale(1, "s")
    if unit == "ms":
        return Scale(1000, "s") if m >= 1000 else Scale(1, "ms")
    # none, short and anything else: plain numbers, with K, Mil, Bil for big ones
    for factor, suffix in ((1e9, "Bil"), (1e6, "Mil"), (1e3, "K")):
        if unit != "none" and m >= factor:
            return Scale(factor, suffix)
    return Scale(1, "")


def format_value(unit: str, value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    s = scale_for(unit, value)
    if unit == "none" and value == int(value):
        return str(int(value))
    return s.text(value)


# --- drawing: Grafana's dark theme in plain SVG ------------------------------------------------------------

BACKGROUND = "#111217"
PANEL = "#181b1f"
BORDER = "#2a2d33"
TEXT = "#ccccdc"
MUTED = "#9fa1ad"
GRID = "#262930"
FONT = "'DejaVu Sans', Verdana, sans-serif"
PALETTE = ["#73BF69", "#F2CC0C", "#8AB8FF", "#FF780A", "#F2495C", "#5794F2", "#B877D9", "#705DA0", "#37872D",
           "#FADE2A"]
NAMED_COLOURS = {
    "green": "#73BF69", "red": "#F2495C", "orange": "#FF9830", "yellow": "#FADE2A", "blue": "#5794F2",
    "purple": "#B877D9", "dark-green": "#37872D", "dark-red": "#C4162A", "dark-orange": "#FA6400",
    "dark-yellow": "#E0B400", "dark-blue": "#1F60C4", "transparent": "transparent", "text": TEXT,
}
CALC_NAMES = {"lastNotNull": "Last *", "last": "Last", "max": "Max", "min": "Min", "mean": "Mean",
              "firstNotNull": "First *", "first": "First", "sum": "Total"}

# Advance widths of DejaVu Sans, in em: enough to lay text out without measuring it.
_NARROW = set(" .,:;!|'il/()[]{}-jtfr")
_WIDE = set("mwMW@%")


def text_width(s: str, size: float) -> float:
    w = 0.0
    for c in s:
        if c in _NARROW:
            w += 0.36
        elif c in _WIDE:
            w += 0.92
        elif c.isdigit():
            w += 0.636
        elif c.isupper():
            w += 0.72
        else:
            w += 0.61
    return w * size


def esc(s: str) -> str:
    return html.escape(s, quote=True)


def text(x: float, y: float, s: str, size: float = 12, fill: str = TEXT, anchor: str = "start",
         weight: int = 400) -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{fill}" text-anchor="{anchor}"'
            f' font-weight="{weight}">{esc(s)}</text>')


def clip(s: str, size: float, width: float) -> str:
    if text_width(s, size) <= width:
        return s
    while s and text_width(s + "…", size) > width:
        s = s[:-1]
    return s + "…"


@dataclass
class Box:
    x: float
    y: float
    w: float
    h: float


def wrap(s: str, size: float, width: float, lines: int) -> list[str]:
    """s in at most lines lines of width, broken between words, the last clipped."""
    out: list[str] = []
    words = s.split()
    while words and len(out) < lines - 1:
        line = words.pop(0)
        while words and text_width(line + " " + words[0], size) <= width:
            line += " " + words.pop(0)
        out.append(line)
    if words:
        out.append(clip(" ".join(words), size, width))
    return out


TITLE = 15.0


def panel_frame(box: Box, title: str, lines: int = 1) -> list[str]:
    """The panel's box and its title (over at most lines lines, where Grafana would clip it)."""
    out = [f'<rect x="{box.x + 0.5:.1f}" y="{box.y + 0.5:.1f}" width="{box.w - 1:.1f}" height="{box.h - 1:.1f}"'
           f' rx="3" fill="{PANEL}" stroke="{BORDER}"/>']
    for i, line in enumerate(wrap(title, TITLE, box.w - 20, lines)):
        out.append(text(box.x + 10, box.y + 22 + i * (TITLE + 3), line, TITLE, TEXT, weight=500))
    return out


def thresholds_colour(panel: dict[str, Any], value: float) -> str:
    steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps") or []
    colour = "green"
    for step in steps:
        if step.get("value") is None or value >= step["value"]:
            colour = step["color"]
    return NAMED_COLOURS.get(colour, colour)


def unit_of(panel: dict[str, Any]) -> str:
    return str(panel.get("fieldConfig", {}).get("defaults", {}).get("unit") or "short")


def draw_stat(panel: dict[str, Any], series: list[Series], box: Box) -> list[str]:
    out = panel_frame(box, panel["title"], lines=2)
    top = 22 + (TITLE + 3) + 8  # room for two lines of title, so the numbers of a row line up
    values = [s.points[-1][1] for s in series if s.points]
    area = Box(box.x + 8, box.y + top, box.w - 16, box.h - top - 8)
    if not values:
        out.append(text(area.x + area.w / 2, area.y + area.h / 2 + 6, "No data", 16, MUTED, "middle"))
        return out
    unit = unit_of(panel)
    cell = area.w / len(values)
    for i, value in enumerate(values):
        label = format_value(unit, value)
        size = min(area.h * 0.72, 0.9 * cell / max(text_width(label, 1), 0.1), 44)
        out.append(text(area.x + cell * (i + 0.5), area.y + area.h / 2 + size * 0.36, label, round(size, 1),
                        thresholds_colour(panel, value), "middle", 500))
    return out


def nice_step(raw: float) -> float:
    exponent = math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * 10**exponent >= raw:
            return float(m * 10**exponent)
    return float(10 ** (exponent + 1))


def y_axis(unit: str, lo: float, hi: float, ticks: int) -> tuple[float, float, list[tuple[float, str]]]:
    """The axis' range and its ticks (value, label), with round numbers in the unit's scale."""
    if unit in ("bytes", "decbytes", "percentunit", "percent", "none", "short", "s", "ms", "watt") and lo >= 0:
        lo = 0.0
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    elif lo > 0:  # a range not from zero: a margin as Grafana leaves
        pad = (hi - lo) * 0.1
        lo, hi = lo - pad, hi + pad
    s = scale_for(unit, max(abs(lo), abs(hi)))
    step = nice_step((hi - lo) / s.factor / ticks)
    first = math.floor(lo / s.factor / step + 1e-9) * step
    last = math.ceil(hi / s.factor / step - 1e-9) * step
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) + (1 if step % 1 and (step * 10) % 1 else 0)
    decimals = max(0, min(decimals, 3))
    values = [first + i * step for i in range(round((last - first) / step) + 1)]
    labels = []
    for v in values:
        label = "0" if abs(v) < step / 1e6 else s.text(v * s.factor, decimals)
        if label == "0" and s.suffix:
            label = s.text(0.0, 0)
        labels.append((v * s.factor, label))
    return first * s.factor, last * s.factor, labels


TIME_STEPS = [1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400]


def time_ticks(t0: float, t1: float, width: float) -> list[tuple[float, str]]:
    step = next((s for s in TIME_STEPS if (t1 - t0) / s * 95 <= width), TIME_STEPS[-1])
    fmt = "%H:%M:%S" if step < 60 else "%H:%M"
    first = math.ceil(t0 / step) * step
    return [(t, time.strftime(fmt, time.localtime(t))) for t in range(int(first), int(t1) + 1, step)]


def _calc(name: str, values: list[float]) -> float | None:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return None
    return {
        "lastNotNull": finite[-1], "last": values[-1], "max": max(finite), "min": min(finite),
        "mean": sum(finite) / len(finite), "firstNotNull": finite[0], "first": values[0], "sum": sum(finite),
    }.get(name)


def draw_timeseries(panel: dict[str, Any], series: list[Series], box: Box, t0: float, t1: float,
                    step: float) -> list[str]:
    out = panel_frame(box, panel["title"])
    inner = Box(box.x + 10, box.y + 36, box.w - 20, box.h - 44)
    if not series:
        out.append(text(inner.x + inner.w / 2, inner.y + inner.h / 2, "No data", 16, MUTED, "middle"))
        return out
    unit = unit_of(panel)
    custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
    legend = panel.get("options", {}).get("legend", {})
    calcs = [c for c in legend.get("calcs", []) if c in CALC_NAMES]
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(series))]

    # The legend: a table of the series with the panel's calculations, right of the
    # chart where the panel puts it and there is room, else under it.
    size, row = 13.5, 22.0
    headers = [CALC_NAMES[c] for c in calcs]
    cells = [[format_value(unit, v) if (v := _calc(c, [p[1] for p in s.points])) is not None else "-"
              for c in calcs] for s in series]
    columns = [max([text_width(h, size)] + [text_width(r[i], size) for r in cells]) + 22 for i, h in enumerate(headers)]
    name_width = max(text_width(s.name, size) for s in series) + 10
    swatch = 24.0
    right = legend.get("placement", "bottom") == "right"
    legend_width = swatch + name_width + sum(columns)
    legend_height = row * (len(series) + (1 if headers else 0)) + 4
    if right and legend_width > inner.w * 0.5:
        right = False
    if right:
        plot_area = Box(inner.x, inner.y, inner.w - legend_width - 16, inner.h)
        lg = Box(inner.x + inner.w - legend_width, inner.y, legend_width, legend_height)
    else:
        plot_area = Box(inner.x, inner.y, inner.w, inner.h - legend_height - 6)
        lg = Box(inner.x, inner.y + inner.h - legend_height, inner.w, legend_height)
        name_width = lg.w - swatch - sum(columns)
    y = lg.y + 14
    if headers:
        x = lg.x + lg.w
        for h, w in reversed(list(zip(headers, columns, strict=True))):
            out.append(text(x, y, h, size, "#6e9fff", "end", 500))
            x -= w
        y += row
    for s, colour, row_cells in zip(series, colours, cells, strict=True):
        out.append(f'<line x1="{lg.x + 2:.1f}" y1="{y - 4:.1f}" x2="{lg.x + 16:.1f}" y2="{y - 4:.1f}"'
                   f' stroke="{colour}" stroke-width="4" stroke-linecap="round"/>')
        out.append(text(lg.x + swatch, y, clip(s.name, size, name_width - 8), size))
        x = lg.x + lg.w
        for value, w in reversed(list(zip(row_cells, columns, strict=True))):
            out.append(text(x, y, value, size, TEXT, "end"))
            x -= w
        y += row

    # Axes: round numbers in the unit on the left, times below.
    values = [v for s in series for _, v in s.points if math.isfinite(v)]
    if not values:
        values = [0.0]
    ticks_wanted = max(2, int(plot_area.h / 45))
    lo, hi, yticks = y_axis(unit, min(values), max(values), ticks_wanted)
    label_width = max(text_width(label, 12.5) for _, label in yticks) + 8
    plot = Box(plot_area.x + label_width, plot_area.y + 4, plot_area.w - label_width - 4, plot_area.h - 26)

    def px(t: float) -> float:
        return plot.x + (t - t0) / (t1 - t0) * plot.w

    def py(v: float) -> float:
        return plot.y + plot.h - (v - lo) / (hi - lo) * plot.h

    for v, label in yticks:
        out.append(f'<line x1="{plot.x:.1f}" y1="{py(v):.1f}" x2="{plot.x + plot.w:.1f}" y2="{py(v):.1f}"'
                   f' stroke="{GRID}"/>')
        out.append(text(plot.x - 6, py(v) + 4, label, 12.5, MUTED, "end"))
    for t, label in time_ticks(t0, t1, plot.w):
        half = text_width(label, 12.5) / 2
        if px(t) - half < plot.x - label_width + 4 or px(t) + half > box.x + box.w - 6:
            continue  # a label that would run off the panel or into the axis' labels
        out.append(f'<line x1="{px(t):.1f}" y1="{plot.y:.1f}" x2="{px(t):.1f}" y2="{plot.y + plot.h:.1f}"'
                   f' stroke="{GRID}"/>')
        out.append(text(px(t), plot.y + plot.h + 17, label, 12.5, MUTED, "middle"))

    # The series: a line each, filled below as fillOpacity says, broken where samples are missing.
    clip_id = f"plot{panel.get('id', 0)}x{int(box.x)}y{int(box.y)}"
    out.append(f'<clipPath id="{clip_id}"><rect x="{plot.x:.1f}" y="{plot.y - 2:.1f}" width="{plot.w:.1f}"'
               f' height="{plot.h + 4:.1f}"/></clipPath><g clip-path="url(#{clip_id})">')
    line_width = max(1.0, float(custom.get("lineWidth", 1)))
    fill = float(custom.get("fillOpacity", 0)) / 100
    base = py(min(max(0.0, lo), hi))
    for s, colour in zip(series, colours, strict=True):
        runs: list[list[tuple[float, float]]] = [[]]
        previous = None
        for t, v in s.points:
            if not math.isfinite(v):
                runs.append([])
                continue
            if previous is not None and t - previous > 2.5 * step:
                runs.append([])
            runs[-1].append((px(t), py(v)))
            previous = t
        for run in filter(None, runs):
            points = " ".join(f"{x:.1f},{y:.1f}" for x, y in run)
            if fill > 0:
                out.append(f'<polygon points="{run[0][0]:.1f},{base:.1f} {points} {run[-1][0]:.1f},{base:.1f}"'
                           f' fill="{colour}" fill-opacity="{fill:.2f}"/>')
            out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="{line_width}"'
                       ' stroke-linejoin="round"/>')
    out.append("</g>")
    return out


def find_panel(dashboard: dict[str, Any], title: str, name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [p for p in dashboard["panels"]
                                   if p.get("title") == title and p.get("type") in ("stat", "timeseries")]
    if not found:
        raise RuntimeError(f"{name} has no stat or time series panel titled {title!r}")
    return found[0]


def header(dashboard: dict[str, Any], variables: list[tuple[str, str]], t0: float, t1: float) -> list[str]:
    out = [text(12, 27, dashboard["title"], 17, TEXT, weight=500)]
    x = 12.0
    for label, value in variables:
        lw, vw = text_width(label, 12) + 16, text_width(value, 12) + 16
        out.append(f'<rect x="{x}" y="42.5" width="{lw + vw:.1f}" height="25" rx="2" fill="{PANEL}"'
                   f' stroke="{BORDER}"/>')
        out.append(f'<line x1="{x + lw:.1f}" y1="43" x2="{x + lw:.1f}" y2="67" stroke="{BORDER}"/>')
        out.append(text(x + 8, 59, label, 12, "#6e9fff", weight=500))
        out.append(text(x + lw + 8, 59, value, 12))
        x += lw + vw + 8
    span = time.strftime("%H:%M:%S", time.localtime(t0)) + " to " + time.strftime("%H:%M:%S", time.localtime(t1))
    out.append(text(WIDTH - 12, 27, span, 12, MUTED, "end"))
    return out


def picture(name: str, rows: list[tuple[int, list[str]]], prom: Prometheus, instance: str,
            t0: float, t1: float, step: float) -> tuple[str, int, list[str]]:
    """The SVG of one picture, its height, and the titles of the panels drawn."""
    dashboard = json.loads((GRAFANA / name).read_text())
    names = [v["name"] for v in dashboard.get("templating", {}).get("list", [])]
    variables = {"node": re.sub(r"([.+*?()|\[\]{}^$\\])", r"\\\1", instance), "card": ".*"}
    variables = {k: v for k, v in variables.items() if k in names}
    chips = [("Node", instance)] + ([("Card", "All")] if "card" in names else [])
    out = header(dashboard, chips, t0, t1)
    gap, y = 8.0, 78.0
    drawn = []
    for height, titles in rows:
        panels = [find_panel(dashboard, title, name) for title in titles]
        weights = [p.get("gridPos", {}).get("w", 1) for p in panels]
        x = gap
        usable = WIDTH - gap * (len(panels) + 1)
        for panel, weight in zip(panels, weights, strict=True):
            box = Box(x, y, usable * weight / sum(weights), height)
            series = run_queries(prom, panel, {**variables, "__rate_interval": f"{4 * step:g}s",
                                               "__interval": f"{step:g}s", "__range": f"{t1 - t0:.0f}s"},
                                 t0, t1, step)
            series.sort(key=lambda s: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s.name)])
            if panel["type"] == "stat":
                out += draw_stat(panel, series, box)
            else:
                out += draw_timeseries(panel, series, box, t0, t1, step)
            drawn.append(panel["title"])
            x += box.w + gap
        y += height + gap
    height = int(y)
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}"'
           f' viewBox="0 0 {WIDTH} {height}" font-family="{FONT}">'
           f'<rect width="{WIDTH}" height="{height}" fill="{BACKGROUND}"/>' + "".join(out) + "</svg>")
    return svg, height, drawn


# --- the PNGs --------------------------------------------------------------------------------------


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    raise SystemExit("render.py needs headless Chromium (Debian: apt-get install --no-install-recommends chromium)")


def screenshot(svg: str, width: int, height: int, scale: float, png: Path, tmp: Path) -> None:
    page = tmp / (png.stem + ".html")
    page.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><style>html,body{margin:0;padding:0;'
                    f'background:{BACKGROUND};overflow:hidden}}svg{{display:block}}</style></head>'
                    f"<body>{svg}</body></html>")
    profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp)
    shot = tmp / png.name
    command = [chromium_binary(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-extensions", f"--user-data-dir={profile}", "--hide-scrollbars",
               f"--force-device-scale-factor={scale:g}", f"--window-size={width},{height}",
               f"--screenshot={shot}", page.as_uri()]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               cwd=tmp, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=90)
    finally:
        # Its helpers are in its session: none outlives the screenshot.
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    if not shot.exists() or shot.stat().st_size == 0:
        said = output.decode(errors="replace")
        raise RuntimeError(f"chromium made no screenshot (exit {process.returncode}):\n{said}")
    png.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, png)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images", help="where the PNGs go")
    parser.add_argument("--collect", type=int, default=75, help="seconds of data behind the time series")
    parser.add_argument("--instance", default="gpu-node-1:10064", help="the exporter's instance label")
    parser.add_argument("--scale", type=float, default=2.0, help="device pixels per CSS pixel in the PNGs")
    parser.add_argument("--svg", action="store_true", help="also write each picture's SVG beside its PNG")
    parser.add_argument("--only", nargs="+", choices=sorted(PICTURES), metavar="PNG",
                        help=f"draw these pictures alone (of {', '.join(PICTURES)})")
    args = parser.parse_args(argv)
    began = time.monotonic()
    log: Callable[[str], None] = lambda s: print(f"render.py: {s}", file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="mig-exporter-render-") as tmp_name:
        tmp = Path(tmp_name)
        smi, start_file = make_fake_smi(tmp / "smi", args.collect)
        proc = make_proc(tmp / "proc")
        with exporter(smi, proc, tmp) as address, prometheus(address, args.instance, tmp) as prom:
            wait_for_data(prom, args.instance)
            t0 = float(int(time.time()) + 1)
            start_file.write_text(f"{int(t0)}\n")
            t1 = t0 + args.collect
            log(f"exporter {address}, Prometheus {prom.url}: collecting for {args.collect} s")
            while (left := t1 + 2 - time.time()) > 0:
                time.sleep(min(left, 15))
            step = 1.0
            for png_name, (dashboard, rows) in PICTURES.items():
                if args.only and png_name not in args.only:
                    continue
                svg, height, drawn = picture(dashboard, rows, prom, args.instance, t0, t1, step)
                png = args.out / png_name
                screenshot(svg, WIDTH, height, args.scale, png, tmp)
                if args.svg:
                    png.with_suffix(".svg").write_text(svg)
                log(f"{png}: {dashboard}: {', '.join(drawn)}")
    log(f"done in {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
