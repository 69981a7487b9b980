"""Our renderer writes exactly what prometheus_client's encoders write, for
every Accept header Prometheus sends, and hands them what it does not cover.

The reference is the installed prometheus_client itself: the same families
go through its ``choose_encoder`` and through ``exposition.render``, and the
bodies and Content-Types must be equal byte for byte.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client import generate_latest as text_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from conftest import FIXTURES, REPO, SAMPLES, families_of, fixture_bytes, require_real_corpus
from mig_exporter.metrics import exposition
from mig_exporter.metrics.exposition import CounterColumns, GaugeColumns, render
from mig_exporter.metrics.families import read_families
from mig_exporter.metrics.scrape import ReadOutcome, Scraper
from mig_exporter.model.readings import OwnerReading, PodReading, ProcessOwner, ProcessPod
from mig_exporter.model.snapshot import Memory, Process, Snapshot
from mig_exporter.nvidia_smi.build import snapshot_from_smi

sys.path.insert(0, str(REPO))
from benchmarks import scenarios

ACCEPT_HEADERS = [
    "",
    # Prometheus 2.x (Debian's 2.42, which the Prometheus tests run)
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    # Prometheus 3.x with UTF-8 names allowed
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "text/plain;version=0.0.4",
    "text/plain;version=1.0.0;escaping=underscores",
    "application/openmetrics-text",
    "application/openmetrics-text;version=1.0.0;escaping=values",
    "application/openmetrics-text;version=1.0.0;escaping=dots",
    "text/plain;version=1.0.0;escaping=dots",
    "text/html",
]


class _Families:
    def __init__(self, families) -> None:
        self.families = families

    def collect(self):
        return self.families


def _reference(families, accept: str) -> tuple[bytes, str]:
    """prometheus_client's own encoding, of the families that have samples (render leaves the others out)."""
    encoder, content_type = choose_encoder(accept)
    return encoder(_Families([f for f in families if f.samples])), content_type


@pytest.mark.parametrize("accept", ACCEPT_HEADERS)
def test_a_family_without_samples_is_not_printed(accept):
    empty = GaugeMetricFamily("mig_exporter_pod_memory_used_bytes", "Pods.", labels=["pod"])
    full = GaugeMetricFamily("mig_exporter_card_mig_instances", "Instances.", labels=["card"])
    full.add_metric(["0"], 3)
    body, _ = render([empty, full], accept)
    assert b"pod" not in body  # (some escaping schemes double the underscores)
    assert b'instances{card="0"} 3.0\n' in body


def _scenarios():
    yield "demo", snapshot_from_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes())
    for xml in sorted(FIXTURES.glob("*.xml")):
        yield xml.stem, snapshot_from_smi(xml.read_bytes(), fixture_bytes(f"{xml.stem}.L.txt"))


@pytest.mark.parametrize("accept", ACCEPT_HEADERS)
def test_every_fixture_renders_as_prometheus_client_renders_it(accept):
    for name, snapshot in _scenarios():
        families = [*families_of(snapshot), *read_families("nvidia-smi", success=True, duration_s=0.123,
                                                           errors_total=4, problems=2, version="0.1.0")]
        assert render(families, accept) == _reference(families, accept), name


def test_the_real_corpus_renders_as_prometheus_client_renders_it():
    accept = ACCEPT_HEADERS[1]
    files = sorted(require_real_corpus().glob("*.xml"))
    assert files
    for path in files:
        families = families_of(snapshot_from_smi(path.read_bytes(), None))
        assert render(families, accept) == _reference(families, accept), path.name


def test_the_fast_path_is_taken_for_what_prometheus_asks():
    # Not merely equal output: these are the scrapes the renderer exists for.
    encoder, _ = choose_encoder(ACCEPT_HEADERS[1])
    assert exposition._fast_encoder(encoder) is exposition._open_metrics
    encoder, _ = choose_encoder("")
    assert exposition._fast_encoder(encoder) is exposition._text
    encoder, _ = choose_encoder(ACCEPT_HEADERS[2])
    assert exposition._fast_encoder(encoder) is exposition._open_metrics
    encoder, _ = choose_encoder("application/openmetrics-text;version=1.0.0;escaping=dots")
    assert exposition._fast_encoder(encoder) is None


label_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from('\\"\n%{}=,'),
    max_size=20,
)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.tuples(label_text, label_text, st.floats(allow_nan=False) | st.integers(-2**62, 2**62)),
                       min_size=1, max_size=8),
       help_text=label_text)
def test_any_label_value_and_number_renders_as_prometheus_client_renders_it(values, help_text):
    gauge = GaugeMetricFamily("mig_exporter_test_value", help_text or "help", labels=["process_name", "card"])
    counter = CounterMetricFamily("mig_exporter_test_events", help_text or "help", labels=["card"])
    for name, card, number in values:
        gauge.add_metric([name, card], number)
        counter.add_metric([card], abs(number))
    unlabelled = GaugeMetricFamily("mig_exporter_test_plain", "no labels", value=7)
    families = [gauge, counter, unlabelled]
    for accept in ACCEPT_HEADERS[:6]:
        assert render(families, accept) == _reference(families, accept)


def test_special_values_render_as_prometheus_client_renders_them():
    gauge = GaugeMetricFamily("mig_exporter_test_value", "h", labels=["i"])
    for i, number in enumerate([float("inf"), float("-inf"), float("nan"), 0, -0.0, 1e-300, 12229541888, 1.5e21, True]):
        gauge.add_metric([str(i)], number)
    for accept in ACCEPT_HEADERS[:6]:
        assert render([gauge], accept) == _reference([gauge], accept)


def test_samples_with_differing_label_names_in_one_family_render_correctly():
    # A family built by hand may vary its label names from sample to sample.
    gauge = GaugeMetricFamily("mig_exporter_test_value", "h")
    gauge.samples += [
        Sample("mig_exporter_test_value", {"b": "1", "a": "2"}, 1),
        Sample("mig_exporter_test_value", {"a": "3", "c": "4"}, 2),
        Sample("mig_exporter_test_value", {"a": "5", "b": "6"}, 3),
        Sample("mig_exporter_test_value", {}, 4),
        Sample("mig_exporter_test_value", {"z": "7"}, 5),
    ]
    for accept in ACCEPT_HEADERS[:6]:
        assert render([gauge], accept) == _reference([gauge], accept)
    text = render([gauge], "")[0].decode()
    assert 'mig_exporter_test_value{a="3",c="4"} 2.0\n' in text
    assert "mig_exporter_test_value 4.0\n" in text


@pytest.mark.parametrize("family", [
    pytest.param(InfoMetricFamily("mig_exporter_test", "an info family", value={"a": "b"}), id="info type"),
    pytest.param(CounterMetricFamily("mig_exporter_test", "with created", value=3, created=1700000000.0),
                 id="counter with _created"),
    pytest.param(GaugeMetricFamily("mig_exporter_test_bytes", "with a unit", value=1, unit="bytes"), id="unit"),
    pytest.param(GaugeMetricFamily("mig:exporter_test", "a colon", value=1), id="name needing escaping"),
])
def test_what_is_not_plain_is_left_to_prometheus_client(family):
    plain = GaugeMetricFamily("mig_exporter_plain", "plain", labels=["a"])
    plain.add_metric(['x"y'], 1)
    families = [plain, family]
    for accept in ACCEPT_HEADERS:
        assert render(families, accept) == _reference(families, accept)


def test_timestamps_and_exemplars_are_left_to_prometheus_client():
    gauge = GaugeMetricFamily("mig_exporter_test_value", "h", labels=["a"])
    gauge.add_metric(["x"], 1, timestamp=1700000000.5)
    for accept in ACCEPT_HEADERS[:6]:
        assert render([gauge], accept) == _reference([gauge], accept)


def test_a_real_scrape_reads_back_with_its_values():
    snapshot = snapshot_from_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"))
    body, content_type = render(families_of(snapshot), "")
    assert content_type.startswith("text/plain; version=0.0.4")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    key = ("mig_exporter_process_memory_used_bytes",
           (("card", "0"), ("index", "1000"), ("mig_profile", "3g.40gb"), ("pid", "21180")))
    assert samples[key] == 2296 * 1024 * 1024


def test_an_accept_header_prometheus_client_cannot_read_gets_the_text_format():
    """Found by the raw-request fuzzing: choose_encoder raises TypeError on some version= values."""
    full = GaugeMetricFamily("mig_exporter_card_mig_instances", "Instances.", labels=["card"])
    full.add_metric(["0"], 3)
    body, content_type = render([full], "application/openmetrics-text;version=a.b.c")
    assert content_type.startswith("text/plain") and b'instances{card="0"} 3.0\n' in body


@pytest.mark.parametrize(("accept", "media_type"), [
    # q=0 refuses a format (RFC 9110; expfmt.Negotiate, goautoneg): OpenMetrics refused is text.
    ("application/openmetrics-text;q=0, text/plain;q=1", "text/plain"),
    ("application/openmetrics-text;version=1.0.0;q=0", "text/plain"),
    ("application/openmetrics-text; Q=0.0, text/plain", "text/plain"),
    ("application/openmetrics-text;q=nonsense, text/plain", "text/plain"),
    # The higher q wins, wherever it stands; among equals, prometheus_client's own preference.
    ("text/plain;version=0.0.4;q=0.5,application/openmetrics-text;version=1.0.0;q=0.4", "text/plain"),
    ("text/plain;q=0.3,application/openmetrics-text;version=1.0.0;q=0.5", "application/openmetrics-text"),
    ("text/plain, application/openmetrics-text", "application/openmetrics-text"),
    ("text/plain;q=0, application/openmetrics-text;q=0.1", "application/openmetrics-text"),
])
def test_accept_q_ranks_and_q_0_refuses_a_format(accept, media_type):
    full = GaugeMetricFamily("mig_exporter_card_mig_instances", "Instances.", labels=["card"])
    full.add_metric(["0"], 3)
    body, content_type = render([full], accept)
    assert content_type.split(";")[0] == media_type
    assert body.endswith(b"# EOF\n") == (media_type == "application/openmetrics-text")


# -- the families held as columns (GaugeColumns) --------------------------------------------------------------

PROMETHEUS_ACCEPT = ACCEPT_HEADERS[1]


class _Named:
    name = "nvidia-smi"


class _Collector:
    """The scrape's families for ``outcome`` as another program's registry collects them: built
    afresh at each collect, their samples read (those without any left out, as render does)."""

    def __init__(self, outcome: ReadOutcome) -> None:
        self.outcome = outcome

    def collect(self):
        return [f for f in Scraper(_Named()).families_for(self.outcome) if f.samples]


def _assert_rendered_as_prometheus_client_renders(outcome: ReadOutcome, what: str) -> None:
    """Our render of fresh families, both formats, equals prometheus_client's generate_latest of a
    registry holding the collector: the columns written straight, and the samples built from them."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(outcome))
    for accept, reference in (("", text_latest), (PROMETHEUS_ACCEPT, openmetrics_latest)):
        families = list(Scraper(_Named()).families_for(outcome))
        columns = [f for f in families if isinstance(f, GaugeColumns)]
        assert {f.name for f in columns} >= {"mig_exporter_process_info", "mig_exporter_device_info"}, what
        body, _ = render(families, accept)
        assert all(f.unread for f in columns), f"{what}: render read the samples"
        assert body == reference(registry), f"{what} ({accept or 'text'})"


def _odd(snapshot: Snapshot) -> ReadOutcome:
    """``snapshot`` with what needs care: pods, owners and process names whose label values need
    escaping (a quote, a backslash, a newline), unknown values (None: left out) in the processes'
    memory, the devices' memory and the owners' fields, and a percent sign in a template's way."""
    processes = tuple(
        Process(pid=p.pid, type=p.type, name=(p.name, 'py"thon', "C:\\x", "two\nlines", "100%s")[i % 5],
                used_bytes=None if i % 7 == 3 else p.used_bytes, device_index=p.device_index)
        for i, p in enumerate(snapshot.processes)
    )
    devices = tuple(dataclasses.replace(d, memory=Memory(d.memory.total_bytes, None, d.memory.free_bytes, None))
                    if i % 2 else d for i, d in enumerate(snapshot.devices))
    pods = {p.pid: ProcessPod(p.pid, f"containerd://{p.pid:064x}", ("llm", 'q"a', "n\\s")[i % 3], f"pod-{i % 4}",
                              "server\n2" if i % 2 else "server")
            for i, p in enumerate(processes) if i % 3}
    owners = {p.pid: ProcessOwner(p.pid, str(4000 + i % 3) if i % 2 else None, "0" if i % 4 == 1 else None,
                                  None if i % 2 else 'unit"x.service', ("alice", "b\\ob", None)[i % 3])
              for i, p in enumerate(processes) if i % 5}
    return ReadOutcome(dataclasses.replace(snapshot, processes=processes, devices=devices), 0.25,
                       pods=PodReading(pods, None, True), owners=OwnerReading(owners))


def _benchmark_snapshots():
    for shape in scenarios.MAIN_SHAPES:
        yield shape.name, snapshot_from_smi(scenarios.query_xml(shape), scenarios.listing(shape))


@pytest.mark.parametrize("name,snapshot", list(_benchmark_snapshots()), ids=lambda x: x if isinstance(x, str) else "")
def test_each_benchmark_scenario_renders_as_prometheus_client_renders_it(name, snapshot):
    _assert_rendered_as_prometheus_client_renders(ReadOutcome(snapshot, 0.01), name)
    pods = PodReading({p.pid: ProcessPod(p.pid, "containerd://1", "llm", "llama-0", "server")
                       for p in snapshot.processes}, None, True)
    _assert_rendered_as_prometheus_client_renders(ReadOutcome(snapshot, 0.01, pods=pods), f"{name}, one pod")
    _assert_rendered_as_prometheus_client_renders(_odd(snapshot), f"{name}, escaped and unknown values")


def test_the_fixtures_and_real_corpus_render_as_prometheus_client_renders_them():
    files = sorted(require_real_corpus().glob("*.xml"))
    assert files
    for path in files:
        snapshot = snapshot_from_smi(path.read_bytes(), None)
        _assert_rendered_as_prometheus_client_renders(ReadOutcome(snapshot, 0.01), path.name)
        if snapshot.processes:
            _assert_rendered_as_prometheus_client_renders(_odd(snapshot), f"{path.name}, escaped and unknown values")
    for name, snapshot in _scenarios():
        _assert_rendered_as_prometheus_client_renders(ReadOutcome(snapshot, 0.01), name)
        _assert_rendered_as_prometheus_client_renders(_odd(snapshot), f"{name}, escaped and unknown values")


def test_a_column_family_reads_as_the_family_add_metric_makes():
    # A column of one value goes into the line's template: its % must stay a %.
    columns = GaugeColumns("mig_exporter_test_value", "h", labels=["b", "a", "c"],
                           columns=[["1", "2", "3"], "100%s", ['q"', "r\\", "s\n"]], values=[3, 4.5, 0], count=3)
    reference = GaugeMetricFamily("mig_exporter_test_value", "h", labels=["b", "a", "c"])
    for row, value in ((["1", "100%s", 'q"'], 3), (["2", "100%s", "r\\"], 4.5), (["3", "100%s", "s\n"], 0)):
        reference.add_metric(row, value)
    for accept in ACCEPT_HEADERS[:6]:  # (the dots and values escaping schemes go to prometheus_client's)
        assert render([columns], accept) == _reference([reference], accept)
    assert columns.unread  # written from the columns
    assert columns == reference  # name, help, type, unit and samples (Metric.__eq__)
    assert [list(s.labels) for s in columns.samples] == [["b", "a", "c"]] * 3  # add_metric's label order
    assert not columns.unread


def test_a_counter_held_as_columns_reads_and_renders_as_counter_metric_family_makes_it():
    columns = CounterColumns("mig_exporter_test_errors", "h", labels=["card", "type"],
                             columns=[["0", "0", "1"], ["correctable", "uncorrectable", "correctable"]],
                             values=[12, 0, 3], count=3)
    reference = CounterMetricFamily("mig_exporter_test_errors", "h", labels=["card", "type"])
    for row, value in ((["0", "correctable"], 12), (["0", "uncorrectable"], 0), (["1", "correctable"], 3)):
        reference.add_metric(row, value)
    for accept in ACCEPT_HEADERS[:6]:
        assert render([columns], accept) == _reference([reference], accept)
    assert b'mig_exporter_test_errors_total{card="1",type="correctable"} 3.0\n' in render([columns], "")[0]
    assert columns.unread
    assert columns == reference  # type counter, samples named _total
    assert [s.name for s in columns.samples] == ["mig_exporter_test_errors_total"] * 3


def test_a_column_family_is_written_once_however_often_it_is_rendered():
    family = GaugeColumns("mig_exporter_test_value", "h", labels=["a"], columns=[["x", "y"]], values=[1, 2], count=2)
    assert family.lines is None
    text = render([family], "")[0]
    assert family.lines == 'mig_exporter_test_value{a="x"} 1.0\nmig_exporter_test_value{a="y"} 2.0\n'
    family.columns = (["changed", "not read"],)  # (a family is never changed; this shows the lines are kept)
    assert render([family], "")[0] == text
    assert render([family], ACCEPT_HEADERS[1])[0].endswith(family.lines.encode() + b"# EOF\n")


def test_zero_kept_from_one_scrape_is_never_the_text_of_a_negative_zero_in_the_next():
    # 0 and -0.0 are one dict key: the text kept for 0 must not be written for -0.0, in either path.
    for values in ([0, 5], [-0.0, 5], [0.0, 0.0], [-0.0, -0.0], [0, 0]):
        family = GaugeColumns("mig_exporter_test_value", "h", labels=["a"], columns=[["x", "y"]], values=values,
                              count=2)
        reference = GaugeMetricFamily("mig_exporter_test_value", "h", labels=["a"])
        reference.add_metric(["x"], values[0])
        reference.add_metric(["y"], values[1])
        assert render([family], "") == _reference([reference], ""), values
        assert render([reference], "") == _reference([reference], ""), values  # the samples' path
    one = GaugeColumns("mig_exporter_test_value", "h", labels=["a"], columns=[["x"]], values=-0.0, count=1)
    assert render([one], "")[0].endswith(b'{a="x"} -0.0\n')


def test_a_column_family_whose_samples_were_read_renders_from_them():
    # What a reader did to the samples (one more here) is what is written.
    family = GaugeColumns("mig_exporter_test_value", "h", labels=["a"], columns=[["x", "y"]], values=1, count=2)
    family.samples.append(Sample("mig_exporter_test_value", {"a": "z"}, 2))
    body = render([family], "")[0].decode()
    assert body.endswith('mig_exporter_test_value{a="x"} 1.0\nmig_exporter_test_value{a="y"} 1.0\n'
                         'mig_exporter_test_value{a="z"} 2.0\n')


@pytest.mark.parametrize("values", [
    [0, -0.0, 0.0, 1, True, 1.0],
    [math.nan, math.nan],
    [-0.0, -0.0],
    [0, 0],
    [math.inf, -math.inf, 1e-300, 1.5e21, 2**53, 2**53 + 1, -5, 12229541888],
    [7, 7, 7],
])
def test_column_values_render_as_prometheus_client_renders_them(values):
    for labels, columns in (([], []), (["i"], [[str(i) for i in range(len(values))]]), (["k"], ["one"])):
        family = GaugeColumns("mig_exporter_test_value", "h", labels=labels, columns=columns, values=values,
                              count=len(values))
        reference = GaugeMetricFamily("mig_exporter_test_value", "h", labels=labels)
        for i, value in enumerate(values):
            reference.add_metric([str(i)] if labels == ["i"] else ["one"] * len(labels), value)
        for accept in ACCEPT_HEADERS[:6]:
            assert render([family], accept) == _reference([reference], accept), (labels, accept)


def test_a_column_family_without_rows_is_not_printed_and_wrong_lengths_are_refused():
    empty = GaugeColumns("mig_exporter_test_value", "h", labels=["a"], columns=[[]], values=[], count=0)
    assert render([empty], "") == (b"", choose_encoder("")[1])
    with pytest.raises(ValueError, match="a column of 1 rows, not 2"):
        GaugeColumns("mig_exporter_test_value", "h", labels=["a"], columns=[["x"]], values=1, count=2)
    with pytest.raises(ValueError, match="1 labels, 2 columns"):
        GaugeColumns("mig_exporter_test_value", "h", labels=["a"], columns=["x", "y"], values=1, count=2)


@settings(max_examples=500, deadline=None)
@given(value=st.integers(0, 2**53 - 1) | st.sampled_from([0, 999_999, 1_000_000, 10**15, 2**53 - 1, 2**31 * 10]))
def test_an_int_value_is_written_as_float_to_go_string_writes_it(value):
    # Byte counts skip float's repr where the installed prometheus_client agrees (0.20 and later).
    assert exposition._INT_TEXT_AGREES
    assert exposition._int_text(value) == floatToGoString(value)
    assert exposition._Numbers()[value] == floatToGoString(value)
