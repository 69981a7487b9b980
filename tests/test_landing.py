"""The landing page ``/``: the cards' live MIG layout from the same shared scrape as
``/metrics`` (one read for both), behind the same auth, escaped, and drawn by a real
browser (headless Chromium) into the DOM and pixels the tests assert on."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import bcrypt
import pytest

from conftest import MIB, calls, fixture_bytes, left_behind, require_tool
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.scrape import ReadOutcome, Scraper
from mig_exporter.model.readings import EngineProcess, EngineReading
from mig_exporter.model.snapshot import Process
from mig_exporter.sources.demo import DemoSource
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
from mig_exporter.web import landing
from mig_exporter.web.server import ExporterServer
from mig_exporter.web.webconfig import WebSettings

pytestmark = pytest.mark.timeout(120)


# --- a small DOM, from our HTML or from the browser's ------------------------------------------

_VOID = {"br", "meta", "col", "link", "img", "hr", "input", "source", "wbr", "area", "base", "embed", "track"}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The text of this element and all below it, whitespace collapsed."""
        return " ".join("".join(self._texts()).split())

    def _texts(self):
        yield from self.text_parts
        for child in self.children:
            yield " " if child.tag in ("br", "li") else ""
            yield from child._texts()

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def find_all(self, tag: str, cls: str | None = None) -> list[Node]:
        found = []
        for child in self.children:
            if child.tag == tag and (cls is None or cls in child.classes):
                found.append(child)
            found.extend(child.find_all(tag, cls))
        return found

    def find(self, tag: str, cls: str | None = None) -> Node:
        (only,) = self.find_all(tag, cls)
        return only


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        # A text node of its own, so that text keeps its order among the elements.
        self.stack[-1].children.append(Node("#text", {}, text_parts=[data]))


def dom(page: str) -> Node:
    builder = _Builder()
    builder.feed(page)
    builder.close()
    return builder.root


@dataclass(frozen=True)
class Bar:
    """One row of a card's table, as the page shows it."""

    devices: str
    name: str
    profile: str
    used_total: str
    processes: list[str]
    total_width: float | None
    used_width: float | None
    total_mib: int | None
    used_mib: int | None


def bars(root: Node) -> dict[str, list[Bar]]:
    """Each card's rows, by the card's heading."""
    out = {}
    for section in root.find_all("section", "card"):
        rows = []
        for tr in section.find_all("tr", "device"):
            cells = {next(iter(td.classes)): td for td in tr.find_all("td")}
            rects = {next(iter(r.classes)): r for r in tr.find_all("rect")}
            total, used = rects.get("total"), rects.get("used")
            rows.append(Bar(
                devices=tr.attrs["data-devices"], name=cells["name"].text, profile=cells["profile"].text,
                used_total=cells["used-total"].text, processes=[li.text for li in cells["processes"].find_all("li")],
                total_width=float(total.attrs["width"]) if total else None,
                used_width=float(used.attrs["width"]) if used else None,
                total_mib=int(total.attrs["data-mib"]) if total else None,
                used_mib=int(used.attrs["data-mib"]) if used and used.attrs["data-mib"] != "N/A" else None,
            ))
        out[section.find("h2").text] = rows
    return out


# --- HTTP ---------------------------------------------------------------------------------------

def get(url: str, headers: dict[str, str] | None = None, method: str = "GET"):
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def smi(fake_nvidia_smi, name: str, **kwargs) -> Path:
    return fake_nvidia_smi(fixture_bytes(f"{name}.xml"), fixture_bytes(f"{name}.L.txt"), **kwargs)


def test_each_gpu_instance_is_a_bar_with_its_name_profile_memory_and_processes(serve, fake_nvidia_smi):
    url = serve(NvidiaSmiSource(str(smi(fake_nvidia_smi, "h100-mig-processes"))))
    status, headers, page = get(url + "/")
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    cards = bars(dom(page))
    assert list(cards) == ["GPU 0 NVIDIA H100 80GB HBM3 MIG on"]
    (rows,) = cards.values()
    assert [(r.devices, r.name, r.profile, r.used_total) for r in rows] == [
        ("0/mig0", "0/mig0", "3g.40gb", "3594 / 40448 MiB (9%)"),
        ("0/mig1", "0/mig1", "2g.20gb", "17 / 20096 MiB (0%)"),
        ("0/mig2", "0/mig2", "1g.10gb", "7493 / 9984 MiB (75%)"),
        ("0/mig3", "0/mig3", "1g.10gb", "9 / 9984 MiB (0%)"),
    ]
    assert [r.processes for r in rows] == [
        ["21180 /root/tools/memhog 2296 MiB", "21181 /root/tools/memhog 1272 MiB"], [],
        ["21198 ./gpu_burn 7484 MiB"], [],
    ]
    assert [(r.total_mib, r.used_mib) for r in rows] == [(40448, 3594), (20096, 17), (9984, 7493), (9984, 9)]
    # One scale: the card's instances together span the bar's full width, each by its memory.
    scale = landing.BAR_WIDTH / (40448 + 20096 + 9984 + 9984)
    for r in rows:
        assert r.total_width == pytest.approx(r.total_mib * scale - 1, abs=0.06)
        assert r.used_width == pytest.approx(max(r.total_mib * scale * r.used_mib / r.total_mib - 1, 0), abs=0.06)
    assert 'href="/metrics"' in page and 'href="/-/healthy"' in page and 'href="/-/ready"' in page


def test_compute_instances_sharing_a_gpu_instance_are_one_bar(serve, fake_nvidia_smi):
    url = serve(NvidiaSmiSource(str(smi(fake_nvidia_smi, "h200-shared-gpu-instance"))))
    (rows,) = bars(dom(get(url + "/")[2])).values()
    assert [(r.devices, r.profile, r.used_total) for r in rows] == [
        ("0/mig0 0/mig1", "1c.3g.71gb 2c.3g.71gb", "30210 / 71424 MiB (42%)"),
        ("0/mig2", "2g.35gb", "4113 / 33280 MiB (12%)"),
        ("0/mig3", "1g.18gb", "13 / 16384 MiB (0%)"),
        ("0/mig4", "1g.18gb", "13 / 16384 MiB (0%)"),
    ]
    # The shared memory is drawn once, not once per compute instance; each process says where it runs.
    assert rows[0].processes == ["7001 /usr/bin/python3 20480 MiB on 0/mig0",
                                 "7002 /usr/bin/python3 9600 MiB on 0/mig1"]
    scale = landing.BAR_WIDTH / (71424 + 33280 + 16384 + 16384)
    assert rows[0].total_width == pytest.approx(71424 * scale - 1, abs=0.06)
    page = get(url + "/")[2]
    assert "2 compute instances share GPU instance 1 and its memory" in page


def test_mode_pending_change_whole_cards_nothing_carved_and_unknown_memory():
    def drawn(name: str) -> tuple[dict[str, list[Bar]], str]:
        from conftest import scenario

        page = landing.page(ReadOutcome(scenario(name), 0.25), version="0.1.0", source="nvidia-smi")
        return bars(dom(page)), page

    cards, page = drawn("a100-mig-pending")
    assert list(cards) == ["GPU 0 NVIDIA A100-SXM4-80GB MIG off pending: MIG on after the next GPU reset"]
    (row,) = cards["GPU 0 NVIDIA A100-SXM4-80GB MIG off pending: MIG on after the next GPU reset"]
    assert (row.devices, row.profile, row.used_total, row.processes) == (
        "0", "whole card", "5123 / 81920 MiB (6%)", ["900 /usr/bin/python3 5100 MiB"])
    assert row.total_width == landing.BAR_WIDTH - 1
    assert ("Read in 0.25s · driver <bdi>550.90.07</bdi> · CUDA <bdi>12.4</bdi> · 1 card, 1 device."
            in page)

    cards, page = drawn("a100-mig-nothing-carved")
    assert cards["GPU 0 NVIDIA A100-SXM4-40GB MIG on"] == []
    assert "MIG is on and nothing is carved" in page
    assert [r.devices for r in cards["GPU 1 NVIDIA A100-SXM4-40GB MIG on"]] == ["1/mig0"]

    cards, _ = drawn("na-memory")
    (a10g,) = cards["GPU 0 NVIDIA A10G no MIG"]
    assert (a10g.used_total, a10g.total_width, a10g.processes) == (
        "N/A", None, ["4242 /usr/bin/python3 N/A", "4243 /usr/lib/xorg/Xorg N/A"])
    (t4,) = cards["GPU 1 Tesla T4 no MIG"]
    assert (t4.used_total, t4.total_width) == ("2 / 15360 MiB (0%)", landing.BAR_WIDTH - 1)


def test_top_processes_and_how_many_more():
    from conftest import scenario

    snapshot = scenario("a100-mig-pending")
    extra = tuple(Process(1000 + i, "C", f"worker-{i}", (i + 1) * MIB, 0) for i in range(5))
    snapshot = dataclasses.replace(snapshot, processes=snapshot.processes + extra)
    page = landing.page(ReadOutcome(snapshot, 0.1), version="0.1.0", source="x")
    ((row,),) = bars(dom(page)).values()
    assert row.processes == ["900 /usr/bin/python3 5100 MiB", "1004 worker-4 5 MiB", "1003 worker-3 4 MiB",
                             "+3 more"]


def test_engines_on_no_gpu_list_are_named_above_the_cards_as_the_alert_counts_them():
    from conftest import scenario

    processes = (
        EngineProcess("llama.cpp", 52040, "llama-server", 0, ()),  # on no list: the CPU
        EngineProcess("llama.cpp", 50102, "llama-server", 20480 * MIB, (1,)),
        EngineProcess("vllm", 7, "<vllm>", 0, (1002,)),  # listed with 0 bytes: on a GPU
        EngineProcess("ollama", 9, "ollama", None, ()),  # unknown: not claimed
    )

    def page(placed: bool = True, host: bool | None = True) -> str:
        engines = EngineReading(("llama.cpp", "vllm", "ollama"), host, processes if host else None, placed)
        return landing.page(ReadOutcome(scenario("h100-mig-processes"), 0.1, engines=engines), version="0",
                            source="x")

    text = page()
    assert "Engines on no GPU's process list: running on the CPU" in text
    section = text.split('<section class="engines-cpu">')[1].split("</section>")[0]
    assert section.count("<li>") == 1
    assert '<strong><bdi>llama.cpp</bdi></strong> <span class="pid">52040</span> <bdi>llama-server</bdi>' in section
    # Where it cannot be known, nothing is claimed.
    assert "engines-cpu\"" not in page(placed=False) and "engines-cpu\"" not in page(host=False)


def test_a_process_name_cannot_inject_markup(serve, fake_nvidia_smi):
    hostile = b"&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;"
    xml = fixture_bytes("h100-mig-processes.xml").replace(b"./gpu_burn", hostile)
    url = serve(NvidiaSmiSource(str(fake_nvidia_smi(xml, fixture_bytes("h100-mig-processes.L.txt")))))
    status, headers, page = get(url + "/")
    assert status == 200
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in page
    (rows,) = bars(dom(page)).values()
    assert rows[2].processes == ['21198 <script>alert("x")</script><img src=x onerror=alert(1)> 7484 MiB']
    # And were one to slip through, the browser would run no script on this page.
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert "script-src" not in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_a_failed_read_is_a_page_that_says_why_not_an_error(serve, fake_nvidia_smi):
    url = serve(NvidiaSmiSource(str(fake_nvidia_smi(mode="fail", stderr="NVIDIA-SMI has failed <driver>"))))
    status, _, page = get(url + "/")
    assert status == 200
    read = dom(page).find("p", "read")
    assert "failed" in read.classes
    assert read.text.startswith("The read failed after ")
    assert read.text.endswith("exit status 9: NVIDIA-SMI has failed <driver>")
    assert "&lt;driver&gt;" in page and "Traceback" not in page
    assert bars(dom(page)) == {}
    assert 'href="/metrics"' in page


def test_a_hung_read_is_cut_at_the_deadline_metrics_would_have(serve, fake_nvidia_smi):
    # Prometheus' header gives 2 s, less the 1 s offset: the page answers at 1 s, as a scrape would;
    # the read itself goes on under --timeout (issue 38: no request shortens a shared read).
    fake = smi(fake_nvidia_smi, "h100-mig-processes", mode="hang")
    url = serve(NvidiaSmiSource(str(fake), timeout_s=30), timeout_s=30, offset_s=1.0)
    status, _, page = get(url + "/", {"X-Prometheus-Scrape-Timeout-Seconds": "2"})
    assert status == 200
    assert dom(page).find("p", "read").text.endswith(
        "this request's own deadline of 1.0s passed while the scrape went on within --timeout")


def test_head_answers_the_headers_alone(serve):
    url = serve(DemoSource())
    status, headers, body = get(url + "/", method="HEAD")
    assert status == 200 and body == "" and int(headers["Content-Length"]) > 1000
    assert headers["Content-Type"] == "text/html; charset=utf-8"


@pytest.mark.parametrize("first", ["/metrics", "/"])
def test_the_page_and_metrics_at_once_are_one_read(serve, fake_nvidia_smi, first):
    fake = smi(fake_nvidia_smi, "h100-mig-processes", delay_s=1.5)
    url = serve(NvidiaSmiSource(str(fake)))
    server = serve.servers[0]
    second = "/" if first == "/metrics" else "/metrics"
    with ThreadPoolExecutor(max_workers=2) as pool:
        leading = pool.submit(get, url + first)
        _wait(lambda: len(calls(fake)) >= 1)  # the first request's read has begun
        joining = pool.submit(get, url + second)
        _wait(lambda: server.exporter.joined() == 1 or leading.done())
        answers = {first: leading.result(), second: joining.result()}
    assert sorted(args for _, args in calls(fake)) == ["-L", "-q -x"], "one read for both"
    assert answers["/metrics"][0] == 200 and answers["/"][0] == 200
    assert "mig_exporter_device_memory_used_bytes" in answers["/metrics"][2]
    (rows,) = bars(dom(answers["/"][2])).values()
    assert rows[0].used_total == "3594 / 40448 MiB (9%)"


def _wait(condition, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_the_page_needs_the_same_credentials_as_metrics(tmp_path, fake_nvidia_smi):
    password = "correct horse"
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: {bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()}\n")
    fake = smi(fake_nvidia_smi, "h100-mig-processes")
    server = ExporterServer(("127.0.0.1", 0), Exporter(Scraper(NvidiaSmiSource(str(fake))), timeout_s=10),
                            web=WebSettings(str(web), check_interval_s=0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        status, headers, page = get(server.url + "/")
        assert status == 401 and headers["WWW-Authenticate"] == 'Basic realm="mig-exporter"'
        assert "0/mig0" not in page
        assert calls(fake) == [], "no read for a request without credentials"
        auth = {"Authorization": "Basic " + base64.b64encode(f"prometheus:{password}".encode()).decode()}
        status, _, page = get(server.url + "/", auth)
        (rows,) = bars(dom(page)).values()
        assert status == 200 and rows[0].devices == "0/mig0"
    finally:
        server.shutdown()
        server.server_close()


def test_probe_targets_are_still_linked():
    # Config names are letters, digits, "_", "." and "-"; one that were not is still one parameter.
    probes = landing.ProbeLinks("mig.yml", ("gpu-a", "driver.root_1", "a&b=<c>"), 4)
    page = landing.page(ReadOutcome(None, 0.1, "x"), version="0.1.0", source="x", probes=probes)
    assert 'href="/probe?target=gpu-a"' in page and 'href="/probe?target=driver.root_1"' in page
    assert 'href="/probe?target=a%26b%3D%3Cc%3E">/probe?target=<bdi>a&amp;b=&lt;c&gt;</bdi></a>' in page
    assert "Probe targets from <bdi>mig.yml</bdi> (at most 4 probes at once)" in page


# --- a real browser -----------------------------------------------------------------------------

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--force-device-scale-factor=1")


def chromium(tmp_path: Path, url: str, *args: str) -> bytes:
    """Run headless Chromium on ``url`` with a profile and home of its own; its stdout.
    Every process it started is gone, and its files removed, when this returns."""
    exe = require_tool("chromium")
    home = tmp_path / "chromium-home"
    home.mkdir(exist_ok=True)
    # HOME and XDG too: Chromium writes caches and crash reports there, beside the profile.
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_CACHE_HOME": str(home / ".cache")}
    proc = subprocess.Popen([exe, *CHROMIUM_FLAGS, f"--user-data-dir={home / 'profile'}", *args, url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        # Its helpers (zygotes, crashpad) are in its process group: none may outlive the test.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(home, ignore_errors=True)
    assert left_behind([proc.pid]) == ([], [])
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out


@pytest.mark.browser
def test_chromium_builds_the_bars_from_the_page(serve, fake_nvidia_smi, tmp_path):
    url = serve(NvidiaSmiSource(str(smi(fake_nvidia_smi, "h100-mig-processes"))))
    built = dom(chromium(tmp_path, url + "/", "--dump-dom").decode())
    (rows,) = bars(built).values()
    assert [(r.devices, r.profile, r.used_total) for r in rows] == [
        ("0/mig0", "3g.40gb", "3594 / 40448 MiB (9%)"),
        ("0/mig1", "2g.20gb", "17 / 20096 MiB (0%)"),
        ("0/mig2", "1g.10gb", "7493 / 9984 MiB (75%)"),
        ("0/mig3", "1g.10gb", "9 / 9984 MiB (0%)"),
    ]
    # The browser parsed each bar as SVG: two rects, widths in proportion to the instances' memory.
    widths = [r.total_width + 1 for r in rows]
    assert [w / widths[0] for w in widths] == pytest.approx([1, 20096 / 40448, 9984 / 40448, 9984 / 40448], abs=0.01)
    assert sum(widths) == pytest.approx(landing.BAR_WIDTH, abs=0.2)
    assert len(built.find_all("svg")) == 4 and len(built.find_all("rect")) == 8
    assert rows[0].processes == ["21180 /root/tools/memhog 2296 MiB", "21181 /root/tools/memhog 1272 MiB"]


@pytest.mark.browser
def test_chromium_draws_the_page_with_its_bars_in_colour(serve, fake_nvidia_smi, tmp_path):
    url = serve(NvidiaSmiSource(str(smi(fake_nvidia_smi, "h100-mig-processes"))))
    shot = tmp_path / "landing.png"
    chromium(tmp_path, url + "/", f"--screenshot={shot}", "--window-size=1280,480")
    width, height, pixels = decode_png(shot.read_bytes())
    assert (width, height) == (1280, 480)
    colours = {}
    for pixel in pixels:
        colours[pixel] = colours.get(pixel, 0) + 1
    # Text, bars, badges and their anti-aliased edges: hundreds of colours, not a blank page.
    assert len(colours) > 200
    assert colours[(255, 255, 255)] < 0.95 * width * height
    # Each used bar is filled with its level's colour, over about its own area (rounded corners, edges).
    scale = landing.BAR_WIDTH / (40448 + 20096 + 9984 + 9984)
    height_px = landing.BAR_HEIGHT - 1
    green = sum((40448 * scale) * used / total - 1 for used, total in ((3594, 40448), (17, 20096), (9, 9984)))
    amber = (9984 * scale) * 7493 / 9984 - 1
    assert colours.get((0x2F, 0x9E, 0x6E), 0) == pytest.approx(green * height_px, rel=0.25)
    assert colours.get((0xE0, 0xA5, 0x26), 0) == pytest.approx(amber * height_px, rel=0.25)


def decode_png(data: bytes) -> tuple[int, int, list[tuple[int, ...]]]:
    """A PNG's width, height and RGB pixels (8-bit RGB or RGBA, not interlaced): zlib and
    the five row filters, as the PNG spec has them."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert header is not None
    width, height, depth, colour_type, _, _, interlace = header
    assert (depth, interlace) == (8, 0) and colour_type in (2, 6), header
    channels = 3 if colour_type == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        row = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if kind == 1:
            for i in range(channels, stride):
                row[i] = (row[i] + row[i - channels]) & 0xFF
        elif kind == 2:
            row = bytearray((a + b) & 0xFF for a, b in zip(row, previous, strict=True))
        elif kind == 3:
            for i in range(stride):
                left = row[i - channels] if i >= channels else 0
                row[i] = (row[i] + (left + previous[i]) // 2) & 0xFF
        elif kind == 4:
            for i in range(stride):
                a = row[i - channels] if i >= channels else 0
                b, c = previous[i], previous[i - channels] if i >= channels else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(row)
        previous = row
    return width, height, [tuple(row[x:x + 3]) for row in rows for x in range(0, stride, channels)]


def test_a_card_that_could_not_be_read_shows_its_error_beside_the_others():
    from conftest import scenario

    snapshot = scenario("na-memory")
    broken = dataclasses.replace(snapshot.cards[1], error="section unreadable: <minor_number> missing")
    snapshot = dataclasses.replace(snapshot, cards=(snapshot.cards[0], broken), problems=("card 1: <unreadable>",))
    root = dom(landing.page(ReadOutcome(snapshot, 0.1), version="0.1.0", source="x"))
    (card_0, card_1) = root.find_all("section", "card")
    assert card_0.find_all("p", "card-error") == []
    assert card_1.find("p", "card-error").text == \
        "This card could not be read: section unreadable: <minor_number> missing"
    assert root.find("section", "problems").find("li").text == "card 1: <unreadable>"


# --- each card's health mark --------------------------------------------------------------------

@dataclass(frozen=True)
class Mark:
    """A card's health mark as the page shows it: its state, its words and its reasons."""

    state: str
    label: str
    reasons: list[str]


def marks(root: Node) -> dict[str, Mark | None]:
    """Each card's health mark by the card's heading; None where the card shows none."""
    out: dict[str, Mark | None] = {}
    for section in root.find_all("section", "card"):
        found = section.find_all("div", "health")
        out[section.find("h2").text] = None if not found else Mark(
            found[0].attrs["data-state"], found[0].find("span", "mark").text,
            [li.text for li in found[0].find_all("li")])
    return out


def graded(snapshot):
    """``snapshot`` with each card's verdict made again from its (edited) health, as placement
    makes it once per read: the page shows ``Card.verdict`` and grades nothing itself."""
    from mig_exporter.model.health import grade, instance_uncorrectable

    cards = tuple(dataclasses.replace(c, verdict=None if c.error else grade(
        c.health, sum(instance_uncorrectable(d.ecc_errors) for d in snapshot.devices if d.card == c.index)))
        for c in snapshot.cards)
    return dataclasses.replace(snapshot, cards=cards)


def test_each_card_shows_its_health_mark_and_every_reason():
    """The grade of model/health.py, as mig_exporter_card_health has it: an ok card says ok and
    nothing more, a worse one its state's words and every reason, worst first; a MIG instance's
    own uncorrectable SRAM error counts where its card gives no count of its own; a card that
    could not be read has no mark at all (its health is unknown, not ok)."""
    from conftest import scenario
    from mig_exporter.model.health import CardHealth, EccCount

    base = scenario("h100-mig-processes")
    sram = EccCount("volatile", "sram", "uncorrectable", 1)
    card = dataclasses.replace(base.cards[0], health=CardHealth())
    devices = tuple(dataclasses.replace(d, ecc_errors=(sram,) if d.index == 1002 else ()) for d in base.devices)

    def shown(card, devices=base.devices) -> Mark | None:
        snapshot = graded(dataclasses.replace(base, cards=(card,), devices=devices))
        (mark,) = marks(dom(landing.page(ReadOutcome(snapshot, 0.1), version="0", source="x"))).values()
        return mark

    assert shown(card) == Mark("ok", "ok", [])
    assert shown(card, devices) == Mark("warning", "warning", ["1 uncorrectable ECC error(s) since the driver loaded"])
    pending = dataclasses.replace(card, health=CardHealth(row_remap_pending=True, recovery_action=1,
                                                          clock_events_active=(("hw_thermal_slowdown", True),)))
    assert shown(pending) == Mark("reset", "needs reset", [
        "a row remap is pending: reset the card to apply it", "the driver advises a GPU reset",
        "clocks held down: hw thermal slowdown"])
    failed = dataclasses.replace(card, health=CardHealth(row_remap_failure=True, row_remap_pending=True))
    assert shown(failed) == Mark("replace", "replace", [
        "row remapping failed: the card has no spare rows left for a failing bank",
        "a row remap is pending: reset the card to apply it"])
    assert shown(dataclasses.replace(failed, error="GPU is lost")) is None


def test_a_health_reason_is_escaped():
    from conftest import scenario
    from mig_exporter.model.health import CardHealth

    snapshot = scenario("h100-mig-processes")
    odd = dataclasses.replace(snapshot.cards[0], health=CardHealth(repair_pending=(("<b>tpc</b>", True),)))
    page = landing.page(ReadOutcome(graded(dataclasses.replace(snapshot, cards=(odd,))), 0.1), version="0",
                        source="x")
    assert "<b>" not in page and "a &lt;b&gt;tpc&lt;/b&gt; repair is pending" in page


def test_each_name_on_the_page_is_isolated_so_an_rlo_turns_only_itself():
    """A process named ``\\u202egnp.exe`` (RLO) would, left in the page's own bidi run, turn the
    text after it (its memory, the next process) around: each name stands in a <bdi>."""
    from conftest import scenario

    snapshot = scenario("h100-mig-processes")
    named = dataclasses.replace(snapshot, processes=tuple(
        p._replace(name="\u202egnp.exe") for p in snapshot.processes))
    page = landing.page(ReadOutcome(named, 0.1), version="0", source="x", node="node\u202e")
    assert page.count('<span class="pname"><bdi>\u202egnp.exe</bdi></span>') == 3
    assert "<strong><bdi>node\u202e</bdi></strong>" in page
    # No RLO outside a <bdi>: strip every isolated name and none is left.
    assert "\u202e" not in re.sub(r"<bdi>.*?</bdi>", "", page)


# --- which node, which card, whose work ----------------------------------------------------------

def test_the_page_names_its_node_and_each_card_by_uuid_pci_address_and_serial():
    """What a ticket to the vendor or a walk to the rack needs: the node, and each card's UUID,
    PCI address and board serial (demo.xml's <uuid>, <pci_bus_id>, <serial>); the host's own
    name where the caller gives none."""
    page = landing.page(ReadOutcome(DemoSource().read(), 0.1), version="0", source="x", node="gpu-node-7")
    root = dom(page)
    assert root.find("span", "node").text == "on node gpu-node-7"
    assert [p.text for p in root.find_all("p", "identity")] == [
        "UUID GPU-a84bba07-931d-b925-306a-0799dc6ebd71 PCI 00000000:07:00.0 serial 1653922034781",
        "UUID GPU-975dcb6d-e070-3b4a-b7ed-013e50181d96 PCI 00000000:0F:00.0 serial 1653922034512",
    ]
    default = dom(landing.page(ReadOutcome(DemoSource().read(), 0.1), version="0", source="x"))
    assert default.find("span", "node").text == f"on node {socket.gethostname()}"
    # A card the driver names only in part shows what it gave, and nothing for the rest.
    snapshot = DemoSource().read()
    bare = dataclasses.replace(snapshot.cards[0], serial=None, uuid="<GPU-x>")
    root = dom(landing.page(ReadOutcome(dataclasses.replace(snapshot, cards=(bare,)), 0.1), version="0", source="x",
                            node="<n>"))
    assert root.find("p", "identity").text == "UUID <GPU-x> PCI 00000000:07:00.0"
    assert root.find("span", "node").text == "on node <n>"



def test_serve_names_the_node_it_is_given_not_the_pod_s_host_name(tmp_path):
    """In a pod the host name is the pod's: serve takes the node's from --web.node-name (the chart
    sets MIG_EXPORTER_WEB_NODE_NAME from spec.nodeName), and the page names it."""
    from test_prometheus import exporter

    env_named = dict(os.environ, MIG_EXPORTER_WEB_NODE_NAME="gpu-node-7")
    with exporter(None, tmp_path, "--web.node-name", "gpu-node-9") as exp:
        _, _, page = get(f"http://{exp.address}/")
    assert dom(page).find("span", "node").text == "on node gpu-node-9"
    process = subprocess.run([sys.executable, "-m", "mig_exporter", "serve", "--help"], env=env_named,
                             capture_output=True, text=True, timeout=60)
    assert "MIG_EXPORTER_WEB_NODE_NAME" in process.stdout


def test_the_mig_instance_with_an_uncorrectable_ecc_error_is_marked_on_its_row():
    """The demo's 0/mig0 counts 1 volatile uncorrectable SRAM error of its own: the work on it is
    what the error hit, so its row says so; its siblings (0 errors) and the whole card 1 (its
    DRAM error is the card's, on no instance) are not marked."""
    root = dom(landing.page(ReadOutcome(DemoSource().read(), 0.1), version="0", source="x"))
    marked = {tr.attrs["data-devices"]: tr.find("div", "ecc").text
              for tr in root.find_all("tr", "device") if "ecc-error" in tr.classes}
    assert marked == {"0/mig0": "1 uncorrectable ECC error"}
    assert [tr.find("div", "ecc").attrs["data-errors"] for tr in root.find_all("tr", "ecc-error")] == ["1"]


def test_each_top_process_names_its_pod_else_its_slurm_job_else_its_unit():
    from conftest import scenario
    from mig_exporter.model.readings import OwnerReading, PodReading, ProcessOwner, ProcessPod

    snapshot = scenario("h100-mig-processes")  # pids 21180, 21181 on 0/mig0; 21198 on 0/mig2
    pods = PodReading({21180: ProcessPod(21180, "c0ffee", "llm", "<b>llama-0</b>", "server")}, None, None)
    owners = OwnerReading({
        21180: ProcessOwner(21180, "9001", "0", None, "alice"),  # a pod's process: the pod is named
        21181: ProcessOwner(21181, "4242", "batch", None, "bob"),
        21198: ProcessOwner(21198, None, None, "gpu-burn.service", "root"),
    })
    (rows,) = bars(dom(landing.page(ReadOutcome(snapshot, 0.1, pods=pods, owners=owners), version="0",
                                    source="x"))).values()
    assert [r.processes for r in rows if r.processes] == [
        ["21180 /root/tools/memhog 2296 MiB llm/<b>llama-0</b>", "21181 /root/tools/memhog 1272 MiB job 4242"],
        ["21198 ./gpu_burn 7484 MiB gpu-burn.service"],
    ]
    page = landing.page(ReadOutcome(snapshot, 0.1, pods=pods, owners=owners), version="0", source="x")
    assert "<b>llama" not in page and "llm/&lt;b&gt;llama-0&lt;/b&gt;" in page


@pytest.mark.browser
def test_chromium_shows_the_demo_card_that_needs_a_reset_in_red(serve, tmp_path):
    """The demo: card 1, the sick card, has a pending row remap (and a DRAM error and
    a PCIe link at x4 of x16), card 0 an uncorrectable SRAM error on its instance 0/mig0. The
    browser's DOM has both marks and their reasons, and the reset mark is drawn in its red (no bar
    of the demo is that full)."""
    url = serve(DemoSource())
    built = marks(dom(chromium(tmp_path, url + "/", "--dump-dom").decode()))
    assert built == {
        "GPU 0 NVIDIA A100-SXM4-80GB MIG on": Mark(
            "warning", "warning", ["1 uncorrectable ECC error(s) since the driver loaded"]),
        "GPU 1 NVIDIA A100-SXM4-80GB MIG off": Mark(
            "reset", "needs reset", ["a row remap is pending: reset the card to apply it",
                                     "1 uncorrectable ECC error(s) since the driver loaded",
                                     "PCIe link at x4 of x16"]),
    }
    shot = tmp_path / "demo.png"
    chromium(tmp_path, url + "/", f"--screenshot={shot}", "--window-size=1280,1000")
    _, _, pixels = decode_png(shot.read_bytes())
    red = sum(1 for p in pixels if p == (0xD6, 0x45, 0x45))
    # The mark's pill: about 100 x 20 px of red behind its white letters.
    assert 600 < red < 4000, red
    assert (0xFF, 0xF3, 0xC4) in set(pixels), "the warning mark's amber"
