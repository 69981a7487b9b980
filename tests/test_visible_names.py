"""A name from outside reaches an operator's terminal shown, never obeyed: status and doctor print
every control, line separator and bidi character of a process's name as an escape, on the NVML
path and on nvidia-smi's, and every output cuts a name past 256 characters with a mark."""

from __future__ import annotations

import dataclasses
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import families_of, fixture_bytes
from fake_nvml import SCENARIOS
from mig_exporter import status
from mig_exporter.core.visible import NAME_LIMIT, bounded_name, escaped, shown, visible
from mig_exporter.doctor import diagnose, render_text, timed_read
from mig_exporter.metrics.exposition import render
from mig_exporter.metrics.scrape import ReadOutcome
from mig_exporter.model.capacity import GPU_ONLY
from mig_exporter.model.readings import PodReading, ProcessPod
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
from mig_exporter.sources.nvml import NvmlSource

MIB_NAME = "x" * (1 << 20)
LONG_NAME = "y" * 1000  # what NVML's 1024-byte buffer can hold (a longer name is an error there)
HOSTILE = [
    "\x1b]0;pwned\x07\x1b[2J\x1b[32mALL GPUS HEALTHY",  # retitle, clear, paint green
    "\x1b[2K\rERROR [fake-finding] card 0 must be replaced now",  # erase the line, write over it
    "a\nERROR forged line",
    "\u202egnp.exe",  # RLO: reads as exe.png
    "\x9b31m",  # a one-byte CSI
    "\x85next line",  # NEL
    "\u2028sep\u2029\u200f\u2066\u061c\ufeff\x7f",
]
# What may not reach a terminal from a name: C0 but the layout's newline, DEL, C1, the line and
# paragraph separators, the bidi controls and the BOM.
FORBIDDEN = ({chr(c) for c in range(0x20)} - {"\n"}) | {chr(c) for c in range(0x7F, 0xA0)} | set(
    "\u2028\u2029\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u061c\ufeff")
PIDS = (21180, 21181, 21198)  # h100-mig-processes: memhog twice, gpu_burn


def _clean(text: str) -> None:
    found = sorted({f"U+{ord(c):04X}" for c in text if c in FORBIDDEN})
    assert not found, f"raw characters reached the terminal: {found}"
    assert not any(line.startswith(("ERROR forged", "ERROR [fake-finding]")) for line in text.splitlines())


def _nvml(fake_nvml_lib, name: str) -> None:
    scenario = SCENARIOS["h100-mig-processes"]()
    fake_nvml_lib(dataclasses.replace(scenario, process_names=dict.fromkeys(PIDS, name)))


def _smi(fake_nvidia_smi, name: str):
    """A fake nvidia-smi naming every process ``name`` as nvidia-smi writes it: raw bytes."""
    xml = fixture_bytes("h100-mig-processes.xml")
    raw = name.encode("utf-8", "surrogateescape")
    for old in (b"/root/tools/memhog", b"./gpu_burn"):
        xml = xml.replace(b"<process_name>" + old + b"</process_name>", b"<process_name>" + raw + b"</process_name>")
    return fake_nvidia_smi(xml, fixture_bytes("h100-mig-processes.L.txt"))


def test_visible_writes_every_control_as_an_escape_and_keeps_the_rest():
    assert visible("\x1b]0;pwned\x07") == "\\x1b]0;pwned\\x07"
    assert visible("a\nb\rc\td\x7f\x9b\x85") == "a\\x0ab\\x0dc\\x09d\\x7f\\x9b\\x85"
    assert visible("\u202egnp.exe\u2028\u2029\u200e\u2066\u061c\ufeff") == (
        "\\u202egnp.exe\\u2028\\u2029\\u200e\\u2066\\u061c\\ufeff")
    assert visible("/usr/bin/python3 naïve 模型 🚀 C:\\x") == "/usr/bin/python3 naïve 模型 🚀 C:\\x"


# Drawn as nothing, or as something else: zero-width space, non-joiner and joiner, the word
# joiner and invisible operators, the deprecated format controls, the Mongolian vowel separator,
# the Hangul fillers, a tag character, a no-break space, private use, a lone surrogate.
INVISIBLE = ("\u200b\u200c\u200d\u2060\u2061\u2062\u2063\u2064\u206a\u206b\u206c\u206d\u206e\u206f\u180e"
             "\u115f\u1160\u3164\uffa0\U000e0041\xa0\ue000\ud800\udcff")


def test_visible_writes_every_invisible_and_format_character_as_an_escape():
    assert visible(INVISIBLE) == (
        "\\u200b\\u200c\\u200d\\u2060\\u2061\\u2062\\u2063\\u2064\\u206a\\u206b\\u206c\\u206d\\u206e"
        "\\u206f\\u180e\\u115f\\u1160\\u3164\\uffa0\\U000e0041\\xa0\\ue000\\ud800\\udcff")
    # A lone surrogate (JSON can carry one: a pod name, a Prometheus label) leaves as text any
    # terminal encoder takes.
    assert visible("a\ud800b").encode("utf-8") == b"a\\ud800b"


def test_a_backslash_of_a_name_is_shown_doubled_so_no_name_reads_as_another():
    """A name holding the text ``\\x1b`` and one holding ESC print differently."""
    assert shown("evil\\x1b") == "evil\\\\x1b"
    assert shown("evil\x1b") == "evil\\x1b"
    assert escaped("C:\\tmp\u200b") == "C:\\\\tmp\\u200b"
    # visible() keeps a backslash: it passes over whole report lines that hold shown names, and
    # changes nothing of them.
    for name in (*HOSTILE, INVISIBLE, "evil\\x1b", "a\\\\b"):
        assert visible(shown(name)) == shown(name)


def test_a_long_name_is_cut_with_a_mark_saying_how_much():
    assert bounded_name("a" * NAME_LIMIT) == "a" * NAME_LIMIT
    assert bounded_name(MIB_NAME) == "x" * 256 + f"…(+{(1 << 20) - 256})"
    assert bounded_name("abcdef", limit=2) == "ab…(+4)"
    # A name the source cut is not cut again by the report that prints it.
    assert bounded_name(bounded_name(MIB_NAME)) == bounded_name(MIB_NAME)
    # Cut first, then escaped: no escape is cut in half, the count is of the name's own characters.
    assert shown("\x1b" * 300) == "\\x1b" * 256 + "…(+44)"


def test_a_name_that_forges_a_cut_mark_is_cut_all_the_same():
    """On 0ae2a05 a mark of any number of digits passed whole: 1 000 261 characters came out."""
    forged = "a" * NAME_LIMIT + "…(+1" + "0" * 10_000 + ")"
    assert bounded_name(forged) == "a" * NAME_LIMIT + "…(+10005)"
    assert len(bounded_name(forged)) <= NAME_LIMIT + len("…(+NNNNN)")
    # A mark with text after it, or two, is no mark: cut.
    assert bounded_name("a" * NAME_LIMIT + "…(+5)x") == "a" * NAME_LIMIT + "…(+6)"
    assert bounded_name("a" * NAME_LIMIT + "…(+5)…(+5)") == "a" * NAME_LIMIT + "…(+10)"
    # A mark of at most 20 digits is taken as one, and is at most 24 characters past the limit.
    assert bounded_name("a" * NAME_LIMIT + "…(+" + "9" * 20 + ")") == "a" * NAME_LIMIT + "…(+" + "9" * 20 + ")"
    assert bounded_name("a" * NAME_LIMIT + "…(+" + "9" * 21 + ")") == "a" * NAME_LIMIT + "…(+25)"


@pytest.mark.parametrize("name", [*HOSTILE, LONG_NAME], ids=lambda n: ascii(n[:12]))
def test_status_shows_a_hostile_process_name_on_the_nvml_path(fake_nvml_lib, name):
    _nvml(fake_nvml_lib, name)
    snapshot = NvmlSource().read()
    text = status.render_text(ReadOutcome(snapshot, 0.1))
    _clean(text)
    # Read as the driver gave it, stripped of the spaces around it (\x85 and \u2028 are spaces
    # to Python), and cut at 256 characters.
    assert {p.name for p in snapshot.processes} == {bounded_name(name.strip())}
    top = next(line for line in text.splitlines() if line.startswith("Top process:"))
    assert top == f"Top process: 21198 {shown(name.strip())}, 7.3 GiB on 0/mig2"
    # JSON keeps the name whole (but cut), escaped by json itself.
    answer = json.dumps(status.as_json(ReadOutcome(snapshot, 0.1)), indent=2)
    _clean(answer)
    assert json.loads(answer)["top_process"]["name"] == bounded_name(name.strip())


@pytest.mark.parametrize("name", [*HOSTILE, MIB_NAME], ids=lambda n: ascii(n[:12]))
def test_status_shows_a_hostile_process_name_on_the_nvidia_smi_path(fake_nvidia_smi, name):
    snapshot = NvidiaSmiSource(str(_smi(fake_nvidia_smi, name))).read()
    text = status.render_text(ReadOutcome(snapshot, 0.1))
    _clean(text)
    (read,) = {p.name for p in snapshot.processes}  # what survived XML: C0 but \n, \r and \t is not XML
    assert len(read) <= NAME_LIMIT + len(f"…(+{1 << 20})")
    top = next(line for line in text.splitlines() if line.startswith("Top process:"))
    assert top.startswith(f"Top process: 21198 {shown(read)}, 7.3 GiB on 0/mig2")


def test_a_1_mib_name_is_cut_on_the_nvidia_smi_path(fake_nvidia_smi):
    snapshot = NvidiaSmiSource(str(_smi(fake_nvidia_smi, MIB_NAME))).read()
    assert {p.name for p in snapshot.processes} == {"x" * 256 + f"…(+{(1 << 20) - 256})"}


def test_status_shows_a_hostile_read_error():
    text = status.render_text(ReadOutcome(None, 0.1, error="nvidia-smi said \x1b[2J\u202edone\nERROR forged line"))
    _clean(text)
    assert text == "The read failed: nvidia-smi said \\x1b[2J\\u202edone\\x0aERROR forged line\n"


@pytest.mark.parametrize("name", HOSTILE, ids=lambda n: ascii(n[:12]))
def test_doctor_shows_hostile_process_names_from_both_paths(fake_nvml_lib, fake_nvidia_smi, name):
    _nvml(fake_nvml_lib, name)
    smi = _smi(fake_nvidia_smi, name)
    report = diagnose(timed_read("nvml", NvmlSource().read), timed_read("nvidia-smi", NvidiaSmiSource(str(smi)).read),
                      host=GPU_ONLY)
    text = render_text(report)
    _clean(text)
    assert f"    pid 21198 C {shown(name.strip())} 7484 MiB" in text.splitlines()


def test_doctor_report_of_a_1_mib_name_is_bounded(fake_nvml_lib, fake_nvidia_smi):
    _nvml(fake_nvml_lib, LONG_NAME)
    smi = _smi(fake_nvidia_smi, MIB_NAME)
    report = diagnose(timed_read("nvml", NvmlSource().read), timed_read("nvidia-smi", NvidiaSmiSource(str(smi)).read),
                      host=GPU_ONLY)
    text = render_text(report)
    assert max(len(line) for line in text.splitlines()) < 1000
    assert "    pid 21198 C " + "y" * 256 + "…(+744) 7484 MiB" in text.splitlines()


@pytest.mark.parametrize("name", ["evil\\x1b[2J", "gpu\u200bburn\u2060", "C:\\\\x"], ids=ascii)
def test_status_and_doctor_show_a_backslash_and_invisible_characters_of_a_name_unambiguously(
        fake_nvml_lib, fake_nvidia_smi, name):
    _nvml(fake_nvml_lib, name)
    text = status.render_text(ReadOutcome(NvmlSource().read(), 0.1))
    expected = name.replace("\\", "\\\\").replace("\u200b", "\\u200b").replace("\u2060", "\\u2060")
    assert f"Top process: 21198 {expected}, 7.3 GiB on 0/mig2" in text.splitlines()
    report = diagnose(timed_read("nvml", NvmlSource().read),
                      timed_read("nvidia-smi", NvidiaSmiSource(str(_smi(fake_nvidia_smi, name))).read), host=GPU_ONLY)
    assert f"    pid 21198 C {expected} 7484 MiB" in render_text(report).splitlines()


def test_status_shows_a_pod_name_holding_a_lone_surrogate_as_an_escape(fake_nvml_lib):
    """A pod's name comes from the kubelet's JSON, which can carry a lone surrogate: shown as its
    escape, the report encodes (click.echo would raise UnicodeEncodeError on it raw)."""
    _nvml(fake_nvml_lib, "python3")
    pod = ProcessPod(21198, "c0ffee", "ml", "trainer\ud800\u200d", "main")
    text = status.render_text(ReadOutcome(NvmlSource().read(), 0.1, pods=PodReading({21198: pod}, None, None)))
    assert "Top process: 21198 python3, 7.3 GiB on 0/mig2 (pod ml/trainer\\ud800\\u200d)" in text.splitlines()
    text.encode("utf-8")


def test_status_shows_a_hostile_pod_name(fake_nvml_lib):
    _nvml(fake_nvml_lib, "python3")
    pod = ProcessPod(21198, "c0ffee", "ml\u202e", "trainer\x1b[2J\nERROR forged line", "main")
    text = status.render_text(ReadOutcome(NvmlSource().read(), 0.1, pods=PodReading({21198: pod}, None, None)))
    _clean(text)
    assert ("Top process: 21198 python3, 7.3 GiB on 0/mig2 (pod ml\\u202e/trainer\\x1b[2J\\x0aERROR forged line)"
            in text.splitlines())


def test_the_exposition_carries_a_1_mib_name_cut(fake_nvidia_smi):
    snapshot = NvidiaSmiSource(str(_smi(fake_nvidia_smi, MIB_NAME))).read()
    body, _ = render(families_of(snapshot), "text/plain")
    names = {s.labels["process_name"] for f in text_string_to_metric_families(body.decode()) for s in f.samples
             if "process_name" in s.labels}
    assert names == {"x" * 256 + f"…(+{(1 << 20) - 256})"}
    assert len(body) < 100_000
