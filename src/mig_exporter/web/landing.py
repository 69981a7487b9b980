"""The landing page (``/``): how the node's cards are carved and used, drawn
from one read.

A pure function of the read's outcome: server-rendered HTML with inline SVG
bars and inline CSS, no JavaScript and nothing fetched from elsewhere, so it
works on a node with no internet and under a Content-Security-Policy that
forbids scripts. Every string from the driver (process names above all: any
user picks them) is escaped, and each name stands in a ``<bdi>`` of its own, so
a bidi override in it turns only the name, never the page's text around it.

Per card: its mode (MIG on or off, and a pending change), its product name,
then one row per GPU instance (MIG) or one for the whole card, with a bar
sized by the memory total (one scale for the page) and filled to the used
memory, the display name (``1/mig2``), the profile, used/total in MiB and the
top processes, each with the pod, else the Slurm job, else the systemd unit it
runs in. Under its heading, the card's identity (UUID, PCI address, board
serial: what a ticket to the vendor or a cabling check asks for) and its health
mark (ok, warning, needs reset, replace: ``Card.verdict``, the grade made once
per read by ``model/placement.py``, as ``mig_exporter_card_health`` has it) with
every reason; a card that could not be read has none, its health being unknown.
A MIG instance with volatile uncorrectable ECC errors of its own is marked on
its row: that is the work the error hit. Compute instances of one GPU instance
share its memory: they are one row, naming each of their devices, not several
full bars. The page names the node (its host name) it describes. Above the
cards, the inference engines on no GPU's process list (running on the CPU),
counted as EngineHoldsNoGPUMemory counts them.

Where the hardware measures activity, a row says how busy its engines were over the last window
(GPM: graphics and SM activity, the GPU instance's for its compute instances) and each process on a
whole card its share of the SMs; memory held under 1% activity is marked idle, as
GPUMemoryHeldIdle judges it (the alert waits 2 hours; the page shows one window). Where activity
is not measured the page says nothing of it (``mig-exporter doctor`` says why): never a 0.
"""

from __future__ import annotations

import html
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

from mig_exporter.metrics.scrape import ReadOutcome
from mig_exporter.model.capacity import count_by_class
from mig_exporter.model.health import Verdict, instance_uncorrectable
from mig_exporter.model.readings import EngineReading, ProcessOwner, ProcessPod
from mig_exporter.model.snapshot import MIB, Activity, Card, Device, Memory, PlacedProcessActivity, Process

BAR_WIDTH = 360  # px: the widest row on the page (the largest card) spans this
BAR_HEIGHT = 22
TOP_PROCESSES = 3
# A reason comes from a command's stderr and the like: shown, but bounded.
_REASON_CHARS = 300
# GPUMemoryHeldIdle's defaults (deploy/prometheus/alerts.yml): held above this, active under that.
IDLE_HELD_BYTES = 1024 * MIB
IDLE_RATIO = 0.01
CONTENT_SECURITY_POLICY = ("default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")


@dataclass(frozen=True, slots=True)
class ProbeLinks:
    """The probe targets the config file names, linked from the page."""

    config_source: str
    targets: tuple[str, ...]
    max_concurrent: int


@dataclass(frozen=True, slots=True)
class Row:
    """One bar: a whole card, a MIG device, or the compute instances sharing one GPU instance."""

    devices: tuple[Device, ...]
    memory: Memory
    processes: tuple[Process, ...]

    @property
    def shared(self) -> bool:
        return len(self.devices) > 1


def rows(devices: Iterable[Device], processes: Sequence[Process]) -> list[Row]:
    """A card's devices as bars, in placement order: compute instances of one GPU
    instance together (they report the same memory: one bar, not one each)."""
    groups: dict[tuple[str, int], list[Device]] = {}
    for device in sorted(devices, key=lambda d: d.index):
        key = ("gi", device.gpu_instance_id) if device.is_mig and device.gpu_instance_id is not None \
            else ("device", device.index)
        groups.setdefault(key, []).append(device)
    out = []
    for members in groups.values():
        indexes = {d.index for d in members}
        out.append(Row(tuple(members), members[0].memory,
                       tuple(p for p in processes if p.device_index in indexes)))
    return out


def page(outcome: ReadOutcome, *, version: str, source: str, probes: ProbeLinks | None = None,
         node: str | None = None) -> str:
    """The whole page for one read. ``node``: the name of the node it describes; this host's
    name (``socket.gethostname()``) when not given."""
    node = socket.gethostname() if node is None else node
    parts = [_HEAD.format(bar_col=BAR_WIDTH + 16),
             f"<header>\n<h1>mig-exporter {_e(version)} <span class=\"node\">on node "
             f"<strong>{_n(_short(node))}</strong></span></h1>\n"
             "<p>NVIDIA GPU memory per card, per MIG instance and per process, read at every scrape "
             "(and at every load of this page).</p>\n"
             f"<p class=\"source\">Source: {_e(source)}</p>\n{_links()}</header>\n<main>\n"]
    parts.append(_read_summary(outcome))
    if outcome.snapshot is not None and outcome.snapshot.devices:
        parts.append(_classes(outcome))
    parts.append(_engines_on_the_cpu(outcome.engines))
    snapshot = outcome.snapshot
    if snapshot is not None:
        cards = {c.index: c for c in snapshot.cards}
        by_card: dict[int, list[Device]] = {index: [] for index in cards}
        for device in snapshot.devices:
            by_card.setdefault(device.card, []).append(device)
        card_rows = {index: rows(devices, snapshot.processes) for index, devices in by_card.items()}
        # One scale for the page: the card with the most memory in its rows spans BAR_WIDTH.
        scale_bytes = max((sum(r.memory.total_bytes or 0 for r in rs) for rs in card_rows.values()), default=0)
        work = _work(outcome.pods.processes if outcome.pods is not None else {},
                     outcome.owners.processes if outcome.owners is not None else {})
        shares = {(a.device_index, a.pid): a for a in snapshot.process_activity}
        for index in sorted(card_rows):
            parts.append(_card(index, cards.get(index), card_rows[index], scale_bytes, work, shares))
        if not card_rows:
            parts.append("<p class=\"empty\">The driver lists no cards.</p>\n")
    if outcome.problems:
        items = "".join(f"<li>{_n(_short(p))}</li>\n" for p in outcome.problems)
        parts.append(f"<section class=\"problems\"><h2>Problems in this read</h2>\n<ul>\n{items}</ul>\n</section>\n")
    parts.append("</main>\n")
    if probes is not None:
        parts.append(_probes(probes))
    parts.append("</body>\n</html>\n")
    return "".join(parts)


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _n(text: str) -> str:
    """A name from outside as page text: escaped, and isolated in a ``<bdi>``, so a bidi
    override in it (``\\u202e``: RLO) turns only the name, never the page's own text after it."""
    return f"<bdi>{_e(text)}</bdi>"


def _short(reason: str) -> str:
    one_line = " ".join(reason.split())
    return one_line if len(one_line) <= _REASON_CHARS else one_line[:_REASON_CHARS - 1] + "…"


def _mib(value: int | None) -> str:
    return "N/A" if value is None else str(value // MIB)


def _links() -> str:
    return ("<nav><a href=\"/metrics\">/metrics</a> <a href=\"/-/healthy\">/-/healthy</a> "
            "<a href=\"/-/ready\">/-/ready</a></nav>\n")


def _read_summary(outcome: ReadOutcome) -> str:
    snapshot = outcome.snapshot
    if snapshot is None:
        return ("<p class=\"read failed\"><strong>The read failed</strong> "
                f"after {outcome.duration_s:.2f}s: {_n(_short(outcome.error or 'no reason given'))}</p>\n")
    versions = "".join(f" · {label} {_n(value)}" for label, value in
                       (("driver", snapshot.driver_version), ("CUDA", snapshot.cuda_version)) if value)
    return (f"<p class=\"read ok\">Read in {outcome.duration_s:.2f}s{versions} · {len(snapshot.cards)} "
            f"card{'s' if len(snapshot.cards) != 1 else ''}, {len(snapshot.devices)} "
            f"device{'s' if len(snapshot.devices) != 1 else ''}. Reload the page to read again.</p>\n")


def _classes(outcome: ReadOutcome) -> str:
    """A line per device class on this node: 7 x h100-80g-mig-1g.10gb (2 free), free counted as
    every view counts it (model/capacity.py)."""
    assert outcome.snapshot is not None
    items = "".join(f"<li data-class=\"{_e(c.device_class)}\" data-devices=\"{c.devices}\" data-free=\"{c.free}\" "
                    f"data-unknown=\"{c.unknown}\">{_n(c.describe())}</li>\n"
                    for c in count_by_class(outcome.snapshot, outcome.host))
    return f"<section class=\"classes\"><h2>Devices by class</h2>\n<ul>\n{items}</ul>\n</section>\n"


def _engines_on_the_cpu(engines: EngineReading | None) -> str:
    """The engines holding nothing on any device: what the exporter exists to
    show. Nothing when that cannot be known (a failed read, not the host's PID
    namespace); an engine the driver lists with 0 bytes is on a GPU."""
    if engines is None or not engines.placed or engines.processes is None:
        return ""
    on_cpu = [e for e in engines.processes if e.used_bytes == 0 and not e.device_indexes]
    if not on_cpu:
        return ""
    items = "".join(
        f"<li><strong>{_n(e.engine)}</strong> <span class=\"pid\">{e.pid}</span> {_n(e.comm)}</li>\n"
        for e in sorted(on_cpu, key=lambda e: (e.engine, e.pid))
    )
    return ("<section class=\"engines-cpu\"><h2>Engines on no GPU's process list: running on the CPU</h2>\n"
            f"<ul>\n{items}</ul>\n<p>Their GPU backend did not load, or they were given no GPU; "
            "see docs/engines.md.</p>\n</section>\n")


def _mode(card: Card) -> str:
    modes = {True: "MIG on", False: "MIG off", None: "no MIG"}
    current = f"<span class=\"mode {'mig' if card.mig_current else 'whole'}\">{modes[card.mig_current]}</span>"
    if card.mig_pending is not None and card.mig_pending != card.mig_current:
        current += f" <span class=\"mode pending\">pending: {modes[card.mig_pending]} after the next GPU reset</span>"
    return current


def _work(pods: dict[int, ProcessPod], owners: dict[int, ProcessOwner]) -> dict[int, tuple[str, str]]:
    """Each process's work as (kind, name), by pid: its pod (namespace/pod), else its Slurm
    job, else its systemd unit, as the metrics' process labels name them; pids in none left out."""
    out: dict[int, tuple[str, str]] = {}
    for pid, owner in owners.items():
        if owner.slurm_job:
            out[pid] = ("job", f"job {owner.slurm_job}")
        elif owner.systemd_unit:
            out[pid] = ("unit", owner.systemd_unit)
    for pid, pod in pods.items():
        if pod.pod:
            out[pid] = ("pod", f"{pod.namespace}/{pod.pod}")
    return out


def _identity(card: Card) -> str:
    """The card's UUID, PCI address and board serial, those the driver gave."""
    items = " ".join(f"<span class=\"{cls}\">{label} <code>{_n(_short(value))}</code></span>"
                    for cls, label, value in (("uuid", "UUID", card.uuid), ("pci", "PCI", card.pci_bus_id),
                                              ("serial", "serial", card.serial)) if value)
    return f"<p class=\"identity\">{items}</p>\n" if items else ""


def _health(found: Verdict | None) -> str:
    if found is None:
        return ""
    reasons = "".join(f"<li>{_n(r)}</li>" for r in found.reasons)
    listed = f"<ul class=\"reasons\">{reasons}</ul>" if reasons else ""
    return (f"<div class=\"health {found.state}\" data-state=\"{found.state}\">"
            f"<span class=\"mark\">{_e(found.label)}</span>{listed}</div>\n")


def _card(index: int, card: Card | None, card_rows: list[Row], scale_bytes: int,
          work: dict[int, tuple[str, str]], shares: dict[tuple[int, int], PlacedProcessActivity]) -> str:
    name = card.name if card is not None and card.name else "unknown card"
    head = (f"<section class=\"card\" id=\"card-{index}\">\n<h2><span class=\"index\">GPU {index}</span> "
            f"<span class=\"product\">{_n(name)}</span>{' ' + _mode(card) if card is not None else ''}</h2>\n")
    if card is not None:
        head += _identity(card)
        # The read's grade; an unreadable card has none (its health is unknown, not ok).
        head += _health(card.verdict if card.error is None else None)
    notes = []
    if card is not None and card.error:
        notes.append(f"<p class=\"card-error\">This card could not be read: {_n(_short(card.error))}</p>\n")
    if card is not None and card.mig_current and not card_rows:
        notes.append("<p class=\"empty\">MIG is on and nothing is carved: no MIG instances.</p>\n")
    table = ""
    if card_rows:
        body = "".join(_row(r, scale_bytes, work, shares) for r in card_rows)
        table = ("<table class=\"devices\">\n<colgroup><col class=\"c-name\"><col class=\"c-profile\">"
                 "<col class=\"c-bar\"><col class=\"c-used\"><col class=\"c-processes\"></colgroup>\n"
                 "<thead><tr><th>Device</th><th>Profile</th><th>Memory</th>"
                 f"<th>Used / total</th><th>Top processes</th></tr></thead>\n<tbody>\n{body}</tbody>\n</table>\n")
    return head + "".join(notes) + table + "</section>\n"


def _ecc_mark(devices: Iterable[Device]) -> str:
    """The MIG instance's own volatile uncorrectable ECC errors: the work on it was hit."""
    errors = sum(instance_uncorrectable(d.ecc_errors) for d in devices if d.is_mig)
    if not errors:
        return ""
    return (f"<div class=\"ecc\" data-errors=\"{errors}\" title=\"volatile uncorrectable ECC errors this MIG "
            f"instance counts on its own: the work on it read bad memory\">{errors} uncorrectable ECC "
            f"error{'s' if errors != 1 else ''}</div>")


def _activity(row: Row) -> str:
    """How busy the row's engines were over the last window (GPM: its GPU instance's, which its
    compute instances share), and an idle mark where it holds memory under 1% activity. Nothing
    where activity is not measured: unknown is not idle."""
    activity: Activity | None = row.devices[0].activity
    if activity is None:
        return ""
    measured = [(label, v) for label, v in (("graphics", activity.graphics_ratio), ("SM", activity.sm_ratio))
                if v is not None]
    if not measured:
        return ""
    window = f"over the last {activity.window_seconds:.0f} s"
    shown = " · ".join(f"{label} {100 * v:.0f}%" for label, v in measured)
    used = row.memory.used_bytes
    if max(v for _, v in measured) < IDLE_RATIO and used is not None and used > IDLE_HELD_BYTES:
        return (f"<div class=\"activity idle\" data-idle-mib=\"{used // MIB}\" title=\"{_e(shown)} {window}: memory "
                f"held by work that computes nothing (GPUMemoryHeldIdle fires after 2 hours)\">idle: "
                f"{used // MIB} MiB held, under 1% activity {window}</div>")
    return f"<div class=\"activity\" title=\"GPM activity {window}\">{shown}</div>"


def _row(row: Row, scale_bytes: int, work: dict[int, tuple[str, str]],
         shares: dict[tuple[int, int], PlacedProcessActivity]) -> str:
    names = [d.display_name for d in row.devices]
    profiles = [d.profile or "" for d in row.devices]
    shown_profiles = "<br>".join(_n(p) for p in profiles if p) or ("whole card" if not row.devices[0].is_mig else "")
    shared = ""
    if row.shared:
        shared = (f"<div class=\"shared\">{len(row.devices)} compute instances share GPU instance "
                  f"{row.devices[0].gpu_instance_id} and its memory</div>")
    memory = row.memory
    used_total = ("N/A" if memory.used_bytes is None and memory.total_bytes is None
                  else f"{_mib(memory.used_bytes)} / {_mib(memory.total_bytes)} MiB")
    if memory.used_bytes is not None and memory.total_bytes:
        used_total += f" <span class=\"ratio\">({100 * memory.used_bytes / memory.total_bytes:.0f}%)</span>"
    ecc = _ecc_mark(row.devices)
    activity = _activity(row)
    idle = " idle" if "activity idle" in activity else ""
    return (f"<tr class=\"device{' ecc-error' if ecc else ''}{idle}\" data-devices=\"{_e(' '.join(names))}\">"
            f"<td class=\"name\">{'<br>'.join(_n(n) for n in names)}{ecc}</td>"
            f"<td class=\"profile\">{shown_profiles}</td>"
            f"<td class=\"bar\">{_bar(row, names, scale_bytes)}{shared}{activity}</td>"
            f"<td class=\"used-total\">{used_total}</td>"
            f"<td class=\"processes\">{_processes(row, work, shares)}</td></tr>\n")


def _bar(row: Row, names: list[str], scale_bytes: int) -> str:
    total, used = row.memory.total_bytes, row.memory.used_bytes
    label = " + ".join(names)
    if not total or not scale_bytes:
        return f"<span class=\"unknown\" title=\"{_e(label)}\">memory not reported</span>"
    # At least 2 px, so a small instance beside a large card is still seen.
    width = max(BAR_WIDTH * total / scale_bytes, 2.0)
    ratio = None if used is None else min(max(used / total, 0.0), 1.0)
    fill = "#9aa5b1" if ratio is None else "#2f9e6e" if ratio < 0.7 else "#e0a526" if ratio < 0.9 else "#d64545"
    used_width = 0.0 if ratio is None else width * ratio
    title = f"{label}: {_mib(used)} of {_mib(total)} MiB used"
    return (f"<svg class=\"bar\" width=\"{BAR_WIDTH}\" height=\"{BAR_HEIGHT}\" "
            f"viewBox=\"0 0 {BAR_WIDTH} {BAR_HEIGHT}\" role=\"img\" aria-label=\"{_e(title)}\">"
            f"<title>{_e(title)}</title>"
            f"<rect class=\"total\" x=\"0.5\" y=\"0.5\" width=\"{width - 1:.1f}\" height=\"{BAR_HEIGHT - 1}\" rx=\"3\" "
            f"fill=\"#e8edf3\" stroke=\"#7b8794\" data-mib=\"{total // MIB}\"/>"
            f"<rect class=\"used\" x=\"0.5\" y=\"0.5\" width=\"{max(used_width - 1, 0):.1f}\" "
            f"height=\"{BAR_HEIGHT - 1}\" rx=\"3\" fill=\"{fill}\" data-mib=\"{_mib(used)}\"/></svg>")


def _share(process: Process, shares: dict[tuple[int, int], PlacedProcessActivity]) -> str:
    """A process's share of a whole card's SMs since the previous read, marked idle where it holds
    memory under 1% of both SMs and memory; nothing where it was not measured (MIG, no sample row)."""
    found = shares.get((process.device_index, process.pid))
    if found is None or found.sm_ratio is None:
        return ""
    busiest = max(v for v in (found.sm_ratio, found.memory_ratio) if v is not None)
    if busiest < IDLE_RATIO and process.used_bytes is not None and process.used_bytes > IDLE_HELD_BYTES:
        return (" <span class=\"share idle\" title=\"under 1% of the card's SMs and memory since the previous "
                "read\">idle</span>")
    return (f" <span class=\"share\" title=\"its share of the card's SMs since the previous read\">"
            f"SM {100 * found.sm_ratio:.0f}%</span>")


def _processes(row: Row, work: dict[int, tuple[str, str]],
               shares: dict[tuple[int, int], PlacedProcessActivity]) -> str:
    if not row.processes:
        return "<span class=\"none\">none</span>"
    ranked = sorted(row.processes, key=lambda p: (-(p.used_bytes if p.used_bytes is not None else -1), p.pid))
    names = {d.index: d.display_name for d in row.devices}
    items = []
    for p in ranked[:TOP_PROCESSES]:
        where = f" <span class=\"on\">on {_n(names[p.device_index])}</span>" if row.shared else ""
        kind, name = work.get(p.pid, ("", ""))
        of = f" <span class=\"{kind}\">{_n(_short(name))}</span>" if name else ""
        held = "N/A" if p.used_bytes is None else f"{p.used_bytes // MIB} MiB"
        items.append(f"<li><span class=\"pid\">{p.pid}</span> <span class=\"pname\">{_n(p.name)}</span> "
                     f"<span class=\"pmem\">{held}</span>{_share(p, shares)}{where}{of}</li>")
    if len(ranked) > TOP_PROCESSES:
        items.append(f"<li class=\"more\">+{len(ranked) - TOP_PROCESSES} more</li>")
    return "<ul>" + "".join(items) + "</ul>"


def _probes(probes: ProbeLinks) -> str:
    links = "".join(f"<li><a href=\"/probe?{_e(urlencode({'target': name}))}\">/probe?target={_n(name)}</a></li>\n"
                    for name in probes.targets)
    return (f"<footer>\n<p>Probe targets from {_n(probes.config_source)} (at most {probes.max_concurrent} probes "
            f"at once):</p>\n<ul>\n{links or '<li>none</li>'}\n</ul>\n</footer>\n")


_HEAD = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mig-exporter</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; padding: 16px 24px;
  max-width: 1280px; color: #1f2933; background: #fff; }}
h1 {{ font-size: 22px; margin: 0 0 4px; }}
header p {{ margin: 2px 0; }} .source {{ color: #52606d; }}
nav a {{ margin-right: 12px; }}
.read {{ padding: 6px 10px; border-radius: 4px; background: #f0f4f8; }}
.read.failed, .card-error {{ background: #fde8e8; color: #8a1c1c; padding: 6px 10px; border-radius: 4px; }}
.card {{ margin: 18px 0; border-top: 1px solid #d9e2ec; }}
.card h2 {{ font-size: 17px; margin: 12px 0 8px; }}
.card h2 .product {{ font-weight: normal; }}
.mode {{ font-size: 12px; font-weight: 600; padding: 2px 8px; border-radius: 10px; margin-left: 6px;
  vertical-align: middle; }}
.mode.mig {{ background: #d5e8ff; color: #0b4f9c; }} .mode.whole {{ background: #e4e7eb; color: #3e4c59; }}
.mode.pending {{ background: #fff3c4; color: #8d5b00; }}
/* Fixed columns: every card's bars start at the same x, so their lengths compare across cards. */
table.devices {{ border-collapse: collapse; width: 100%; table-layout: fixed; }}
col.c-name {{ width: 100px; }} col.c-profile {{ width: 120px; }} col.c-bar {{ width: {bar_col}px; }}
col.c-used {{ width: 210px; }}
.devices th {{ text-align: left; font-weight: 600; color: #52606d; font-size: 12px; padding: 2px 8px; }}
.devices td {{ padding: 5px 8px; vertical-align: top; border-top: 1px solid #eef2f6; }}
td.name {{ font-weight: 600; white-space: nowrap; font-family: ui-monospace, monospace; }}
td.profile, td.used-total {{ white-space: nowrap; font-family: ui-monospace, monospace; }}
svg.bar {{ display: block; }}
.shared {{ font-size: 12px; color: #8d5b00; }} .ratio {{ color: #616e7c; }}
.processes ul {{ list-style: none; margin: 0; padding: 0; }}
.processes li {{ white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }}
bdi {{ unicode-bidi: isolate; }}
.pid {{ font-family: ui-monospace, monospace; color: #52606d; }} .pmem {{ font-weight: 600; }}
.on, .pod, .job, .unit, .more, .none, .unknown, .empty {{ color: #616e7c; }}
h1 .node {{ font-weight: normal; }} .node strong {{ font-family: ui-monospace, monospace; }}
.identity {{ margin: 0 0 6px; color: #52606d; font-size: 12px; }} .identity span {{ margin-right: 14px; }}
tr.ecc-error td.name {{ color: #8a1c1c; }}
.ecc {{ font-size: 11px; font-weight: 600; color: #8a1c1c; background: #fde8e8; border-radius: 6px; padding: 1px 6px;
  margin-top: 3px; display: block; white-space: normal; line-height: 1.25; font-family: system-ui, sans-serif; }}
.problems li {{ color: #8a1c1c; }}
.activity {{ font-size: 12px; color: #52606d; }}
.activity.idle {{ color: #8d5b00; background: #fff3c4; border-radius: 6px; padding: 1px 6px; display: inline-block;
  font-weight: 600; margin-top: 2px; }}
.share {{ font-size: 12px; color: #52606d; }}
.share.idle {{ color: #8d5b00; background: #fff3c4; border-radius: 6px; padding: 0 6px; font-weight: 600; }}
.health {{ margin: 0 0 8px; display: flex; align-items: baseline; gap: 10px; }}
.health .mark {{ font-size: 12px; font-weight: 700; padding: 2px 10px; border-radius: 10px; white-space: nowrap;
  text-transform: uppercase; letter-spacing: 0.03em; }}
.health ul.reasons {{ margin: 0; padding: 0; list-style: none; }}
.health.ok .mark {{ background: #d7f5e3; color: #146c43; }}
.health.warning .mark {{ background: #fff3c4; color: #8d5b00; }} .health.warning .reasons {{ color: #8d5b00; }}
.health.reset .mark {{ background: #d64545; color: #fff; }} .health.reset .reasons {{ color: #8a1c1c; }}
.health.replace .mark {{ background: #610404; color: #fff; }} .health.replace .reasons {{ color: #610404; }}
.classes {{ margin: 12px 0; }} .classes h2 {{ font-size: 15px; margin: 4px 0; }}
.classes ul {{ margin: 4px 0; padding-left: 18px; columns: 2; }}
.engines-cpu {{ margin: 12px 0; padding: 6px 12px; border-left: 4px solid #c81e1e; background: #fde8e8; }}
.engines-cpu h2 {{ font-size: 15px; margin: 4px 0; color: #8a1c1c; }}
.engines-cpu ul {{ margin: 4px 0; padding-left: 18px; }} .engines-cpu p {{ margin: 4px 0; color: #52606d; }}
footer {{ margin-top: 24px; border-top: 1px solid #d9e2ec; }}
</style></head>
<body>
"""
