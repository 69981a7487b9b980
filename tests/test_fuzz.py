"""Fuzzing the two parsers and the server with hypothesis: mutations of the real corpus and of our
own fixtures, random bytes, and truncations.

- Only ``ParseError`` (the documented parse error) ever escapes ``parse_query_xml``, ``parse_list``
  and ``snapshot_from_smi``; whatever they accept maps to an exposition Prometheus takes (no
  duplicate series, no value that is not finite).
- The server never answers 500 (nor 503): every fuzzed nvidia-smi output gets 200, with
  ``read_success`` 1 or 0, and no read ends in an unexpected error.

The default run is fast (a few hundred cases). The runs marked ``fuzz`` try 10 000 cases each
(the server through the fake nvidia-smi binary, two processes a case: 1 000); pytest deselects them
unless given ``--fuzz``, which ``scripts/test`` adds under CI (CI=true).
"""

from __future__ import annotations

import logging
import math
import re
import shlex
import stat
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import FIXTURES, REAL_CORPUS, SAMPLES
from mig_exporter.core.errors import ParseError
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.families import snapshot_families
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from mig_exporter.nvidia_smi.listing import parse_list
from mig_exporter.nvidia_smi.query_xml import parse_query_xml
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
from mig_exporter.web.server import ExporterServer

FAST = 200
FULL = 10_000
QUICK_SERVER = 40


def _seeds(pattern: str) -> list[bytes]:
    files = sorted(FIXTURES.glob(pattern)) + sorted(SAMPLES.glob(pattern.replace("*", "demo")))
    if REAL_CORPUS.is_dir():
        files += sorted(REAL_CORPUS.glob(pattern))
    return [f.read_bytes() for f in files]


XML_SEEDS = _seeds("*.xml")
LIST_SEEDS = _seeds("*.L.txt")
assert len(XML_SEEDS) >= 6 and len(LIST_SEEDS) >= 6

# Values a driver might print, or a broken one: units, markers, out-of-range numbers, markup.
ODD_TEXTS = [
    "N/A", "[N/A]", "Not Supported", "Unknown Error", "", " ", "0", "-1", "-1 MiB", "1.5 MiB",
    "99999999999999999999999 MiB", "4194304", "4194303", "2147483648", "1e308 W", "nan", "inf", "-0 C",
    "Enabled", "Disabled", "enabled", "Pending", "C", "G", "C+G", "M+C", "GPU-", "MIG-", "0x1F",
    "&amp;", "&lt;gpu&gt;", "<gpu/>", "]]>", "\u00e9\u4e2d", "\ufffd", "1000", "99", "100", "-100", "7",
]
TAGS = [
    "gpu", "mig_devices", "mig_device", "index", "gpu_instance_id", "compute_instance_id", "processes",
    "process_info", "pid", "type", "process_name", "used_memory", "fb_memory_usage", "total", "used", "free",
    "reserved", "mig_mode", "current_mig", "pending_mig", "uuid", "product_name", "minor_number",
    "nvidia_smi_log", "driver_version", "cuda_version", "power_draw", "gpu_temp", "gpu_util",
]
_TEXT_NODE = re.compile(rb">([^<>]*)<")
_TAG_NAME = re.compile(rb"</?([a-z_]+)")
_CARD = re.compile(rb"<gpu[ >].*?</gpu>", re.S)


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes], structured: bool) -> bytes:
    """A seed with one to four mutations: cut, overwrite, insert, delete or repeat bytes, and for
    XML, change a value or rename an element."""
    data = bytearray(draw(st.sampled_from(seeds)))
    ops = ["truncate", "overwrite", "insert", "delete", "repeat"] + (["text", "text", "tag", "card"] if structured
                                                                   else ["line"])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(ops))
        n = len(data)
        if op == "truncate":
            del data[draw(st.integers(0, n)):]
        elif op == "overwrite" and n:
            i = draw(st.integers(0, n - 1))
            data[i:i + 4] = draw(st.binary(min_size=1, max_size=4))
        elif op == "insert":
            i = draw(st.integers(0, n))
            data[i:i] = draw(st.binary(max_size=32))
        elif op in ("delete", "repeat") and n:
            i = draw(st.integers(0, n - 1))
            j = draw(st.integers(i, min(n, i + 4096)))
            if op == "delete":
                del data[i:j]
            else:
                data[j:j] = data[i:j] * draw(st.integers(1, 3))
        elif op == "text":
            nodes = list(_TEXT_NODE.finditer(data))
            if nodes:
                m = draw(st.sampled_from(nodes))
                value = draw(st.one_of(st.sampled_from(ODD_TEXTS), st.text(max_size=24)))
                data[m.start(1):m.end(1)] = value.encode("utf-8", errors="surrogatepass")
        elif op == "card":  # one more card: a copy of one already there, so two cards in MIG mode
            cards = list(_CARD.finditer(data))
            if cards:
                m = draw(st.sampled_from(cards))
                data[m.end():m.end()] = m.group(0)
        elif op == "tag":
            names = list(_TAG_NAME.finditer(data))
            if names:
                m = draw(st.sampled_from(names))
                data[m.start(1):m.end(1)] = draw(st.sampled_from(TAGS)).encode()
        elif op == "line":
            lines = bytes(data).split(b"\n")
            i = draw(st.integers(0, len(lines)))
            lines.insert(i, draw(st.one_of(
                st.sampled_from([b"GPU 9: X (UUID: GPU-x)", b"  MIG 1g.10gb Device 99: (UUID: MIG-y)",
                                 b"  MIG 1g.10gb Device -1: (UUID: MIG-z)", b"No devices were found",
                                 b"Unable to determine the device handle for GPU0000:41:00.0: Unknown Error"]),
                st.binary(max_size=60))))
            data = bytearray(b"\n".join(lines))
    return bytes(data)


def truncations(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    return st.sampled_from(seeds).flatmap(lambda seed: st.integers(0, len(seed)).map(lambda i: seed[:i]))


XML_INPUTS = st.one_of(mutated(XML_SEEDS, structured=True), truncations(XML_SEEDS), st.binary(max_size=2048),
                       st.text(max_size=512).map(lambda t: t.encode("utf-8", errors="surrogatepass")))
LIST_INPUTS = st.one_of(mutated(LIST_SEEDS, structured=False), truncations(LIST_SEEDS), st.binary(max_size=1024),
                        st.text(max_size=512))
PAIRS = st.tuples(XML_INPUTS, st.one_of(st.none(), LIST_INPUTS))

FUZZ_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


# --- the parsers ---------------------------------------------------------------------------------

def check_xml(data: bytes) -> None:
    try:
        report = parse_query_xml(data)
    except ParseError as e:
        assert "\n" not in str(e)
        return
    assert all(card.index == i for i, card in enumerate(report.cards))


def check_list(data: str | bytes) -> None:
    try:
        listing = parse_list(data)
    except ParseError as e:
        assert "\n" not in str(e)
        return
    assert all(isinstance(g.index, int) for g in listing.gpus)


def check_pair(pair: tuple[bytes, str | bytes | None]) -> None:
    """The whole pure path: both outputs to a snapshot, to the families, to the text format."""
    xml, listing = pair
    try:
        snapshot = snapshot_from_smi(xml, listing)
    except ParseError:
        return
    check_exposition(snapshot)


def check_exposition(snapshot) -> None:
    text = generate_latest(_Families(snapshot_families(snapshot))).decode()
    seen = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in seen, f"duplicate series {key}: Prometheus would refuse the whole scrape"
            seen.add(key)
            assert math.isfinite(s.value), f"{key} = {s.value}"


class _Families:
    def __init__(self, families) -> None:
        self.families = list(families)

    def collect(self):
        return self.families


@settings(max_examples=FAST, **FUZZ_SETTINGS)
@given(XML_INPUTS)
def test_xml_parser_raises_nothing_but_parse_error(data):
    check_xml(data)


@settings(max_examples=FAST, **FUZZ_SETTINGS)
@given(LIST_INPUTS)
def test_list_parser_raises_nothing_but_parse_error(data):
    check_list(data)


@settings(max_examples=FAST, **FUZZ_SETTINGS)
@given(PAIRS)
def test_what_the_parsers_accept_is_an_exposition_prometheus_takes(pair):
    check_pair(pair)


@pytest.mark.fuzz
@settings(max_examples=FULL, **FUZZ_SETTINGS)
@given(XML_INPUTS)
def test_xml_parser_fuzz_10000(data):
    check_xml(data)


@pytest.mark.fuzz
@settings(max_examples=FULL, **FUZZ_SETTINGS)
@given(LIST_INPUTS)
def test_list_parser_fuzz_10000(data):
    check_list(data)


@pytest.mark.fuzz
@settings(max_examples=FULL, **FUZZ_SETTINGS)
@given(PAIRS)
def test_parsers_to_exposition_fuzz_10000(pair):
    check_pair(pair)


# --- the server ----------------------------------------------------------------------------------

class _Outputs:
    """What the fake nvidia-smi prints next: the test writes it before each scrape."""

    def __init__(self, directory: Path) -> None:
        self.xml = directory / "q.xml"
        self.listing = directory / "L.txt"
        self.binary = directory / "nvidia-smi"
        self.binary.write_text(
            "#!/bin/sh\n"
            'case "$1" in\n'
            f"  -q) cat {shlex.quote(str(self.xml))} ;;\n"
            f"  -L) if [ -e {shlex.quote(str(self.listing))} ]; then cat {shlex.quote(str(self.listing))}; "
            "else echo 'Failed to initialize NVML: Unknown Error' >&2; exit 9; fi ;;\n"
            "esac\n")
        self.binary.chmod(self.binary.stat().st_mode | stat.S_IXUSR)

    def set(self, xml: bytes, listing: str | bytes | None) -> None:
        self.xml.write_bytes(xml)
        if listing is None:
            self.listing.unlink(missing_ok=True)
        else:
            self.listing.write_bytes(listing.encode("utf-8", errors="surrogatepass")
                                     if isinstance(listing, str) else listing)


class _Fed:
    """A source that hands the fuzzed outputs straight to the parsers: everything from the
    parsers to the HTTP answer is the real path, without two processes per case."""

    name = "nvidia-smi"

    def __init__(self) -> None:
        self.pair: tuple[bytes, str | bytes | None] = (b"", None)

    def read(self, deadline=None):
        xml, listing = self.pair
        return snapshot_from_smi(xml, listing, None if listing is not None else "nvidia-smi -L failed")

    def ready(self):
        return True, "fed by the test"

    def describe(self):
        return "fuzzed nvidia-smi output"


class _Bugs(logging.Handler):
    """Log records that say a read or a request failed unexpectedly: a bug, not a bad input."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """One server over the fake nvidia-smi and one over the fed source, for every case."""
    outputs = _Outputs(tmp_path_factory.mktemp("fuzz-smi"))
    fed = _Fed()
    servers = [ExporterServer(("127.0.0.1", 0), Exporter(Scraper(source), timeout_s=10))
               for source in (NvidiaSmiSource(str(outputs.binary), timeout_s=10), fed)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    bugs = _Bugs()
    logging.getLogger("mig_exporter").addHandler(bugs)
    yield outputs, fed, servers[0].url, servers[1].url, bugs
    logging.getLogger("mig_exporter").removeHandler(bugs)
    for server in servers:
        server.shutdown()
        server.server_close()


def scrape(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def check_answer(status: int, body: bytes, bugs: _Bugs) -> None:
    assert status == 200, f"answered {status}: {body[:300]!r}"
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert samples["mig_exporter_read_success"] in (0.0, 1.0)
    assert bugs.records == [], bugs.records


@settings(max_examples=QUICK_SERVER, **FUZZ_SETTINGS)
@given(PAIRS)
def test_the_server_answers_every_output_of_the_fake_nvidia_smi_with_200(fuzz_server, pair):
    outputs, _, url, _, bugs = fuzz_server
    outputs.set(*pair)
    check_answer(*scrape(url), bugs)


@settings(max_examples=FAST, **FUZZ_SETTINGS)
@given(PAIRS)
def test_the_server_answers_every_fuzzed_output_with_200(fuzz_server, pair):
    _, fed, _, url, bugs = fuzz_server
    fed.pair = pair
    check_answer(*scrape(url), bugs)


@pytest.mark.fuzz
@settings(max_examples=FULL, **FUZZ_SETTINGS)
@given(PAIRS)
def test_the_server_fuzz_10000(fuzz_server, pair):
    _, fed, _, url, bugs = fuzz_server
    fed.pair = pair
    check_answer(*scrape(url), bugs)


@pytest.mark.fuzz
@settings(max_examples=FULL // 10, **FUZZ_SETTINGS)
@given(PAIRS)
def test_the_server_through_the_fake_nvidia_smi_fuzz_1000(fuzz_server, pair):
    outputs, _, url, _, bugs = fuzz_server
    outputs.set(*pair)
    check_answer(*scrape(url), bugs)


def test_the_fuzz_checks_can_fail():
    """The properties are not vacuous: a snapshot holding one device twice is caught, and so is
    an answer that is not 200 and a read that failed unexpectedly."""
    import dataclasses

    from conftest import scenario

    snapshot = scenario("h100-mig-processes")
    twice = dataclasses.replace(snapshot, devices=snapshot.devices + snapshot.devices[:1])
    with pytest.raises(AssertionError, match="duplicate series"):
        check_exposition(twice)
    with pytest.raises(AssertionError, match="answered 503"):
        check_answer(503, b"Request failed", _Bugs())
    bugs = _Bugs()
    bugs.records.append("read from nvidia-smi failed unexpectedly")
    with pytest.raises(AssertionError, match="unexpectedly"):
        check_answer(200, b"mig_exporter_read_success 0\n", bugs)


# --- raw request bytes against a live server ---------------------------------------------------

_REQUESTS = [
    b"GET /metrics HTTP/1.1\r\nHost: node:10064\r\nAccept: application/openmetrics-text;version=1.0.0\r\n"
    b"Accept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n",
    b"HEAD /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /-/ready HTTP/1.0\r\n\r\n",
    b"POST /-/reload HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
    b"GET /probe?target=node&module=x HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Basic cHJvbWV0aGV1czpzZWNyZXQ=\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
]
_ODD = [b"\xc2\xb2", b"-1", b"99999999999999999999", b"0, 7", b"\xff\xfe", b"\x00", b"\r", b"\n", b" ", b"\t",
        b":", b"HTTP/0.9", b"HTTP/2.0", b"HTTP/1.1 HTTP/1.1", b"%", b"?" * 3, b"/" * 300, b"Content-Length: 3\r\n",
        b"//[", b"[", b"]",
        b"Authorization: Basic eDp5\r\n"]


@st.composite
def raw_requests(draw) -> bytes:
    """A request a client might send, mutated: bytes replaced, inserted and cut, odd values
    spliced in, headers repeated; or bytes at random."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(min_size=1, max_size=600))
    data = bytearray(draw(st.sampled_from(_REQUESTS)))
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.integers(0, 3))
        if kind == 0 and data:
            data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
        elif kind == 1:
            data[at:at] = draw(st.sampled_from(_ODD))
        elif kind == 2:
            del data[at:at + draw(st.integers(1, 40))]
        else:
            data[at:at] = b"Content-Length: " + draw(st.sampled_from(_ODD)) + b"\r\n"
    return bytes(data)


@pytest.fixture(scope="module")
def raw_server():
    server = ExporterServer(("127.0.0.1", 0), Exporter(Scraper(_Fed()), timeout_s=5))
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    bugs = _Bugs()
    logging.getLogger("mig_exporter").addHandler(bugs)
    yield server.server_address[:2], bugs, loop
    logging.getLogger("mig_exporter").removeHandler(bugs)
    server.shutdown()
    server.server_close()


def check_raw_answer(address: tuple[str, int], data: bytes, bugs: _Bugs, loop: threading.Thread) -> None:
    """Send ``data``, half-close, read what comes back: nothing (closed), or answers whose
    status lines are none of them 500; and nothing logged at ERROR (a traceback)."""
    import socket

    with socket.create_connection(address, timeout=10) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # closed on us mid-send: a refusal
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    statuses = re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer)
    assert not answer or (answer.startswith(b"HTTP/1.") and statuses), answer[:300]
    assert b"500" not in statuses, answer[:300]
    assert bugs.records == [], bugs.records
    assert loop.is_alive(), "the connection loop died"


@settings(max_examples=FAST, **FUZZ_SETTINGS)
@given(raw_requests())
def test_no_request_bytes_make_a_traceback_or_a_500(raw_server, data):
    check_raw_answer(raw_server[0], data, raw_server[1], raw_server[2])


@pytest.mark.fuzz
@settings(max_examples=FULL, **FUZZ_SETTINGS)
@given(raw_requests())
def test_raw_requests_fuzz_10000(raw_server, data):
    check_raw_answer(raw_server[0], data, raw_server[1], raw_server[2])
