"""XID errors: the listener's thread over the real pynvml and the Python fake's events, the
families a scrape gets from it, and ``serve --source nvml`` over the C fake library.

The fake delivers the XIDs a test queues (``FakeNvml.emit_xid``) to the listener's next wait;
``XidListener(wait_ms=...)`` keeps each wait short so that the tests stay quick.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from conftest import SAMPLES
from fake_nvml import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    FakeNvml,
    FakeNvmlScenario,
    demo,
)
from fake_nvml_c import SCENARIO_VARIABLE, SONAME, xid_lines
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.sources.kmsg import KmsgReader
from mig_exporter.sources.nvml import NvmlSource
from mig_exporter.sources.xid import NO_PERMISSION_REASON, XidListener, XidWatch, xid_watch_status
from test_cli import cli_env, serving
from test_fake_libnvml import PACKAGE_ROOT, _layouts

Install = Callable[[FakeNvmlScenario | str], FakeNvml]
XID_FAMILIES = ("mig_exporter_xid_errors", "mig_exporter_xid_last_timestamp_seconds")


def two_cards() -> FakeNvmlScenario:
    """The demo's cards swapped: card 0 a whole A100, card 1 an A100 in MIG mode with instances in
    slots 0, 1, 2 (GPU instances 2, 3, 9; compute instance 0 each): 1/mig2 is placement index 1102."""
    scenario = demo()
    return dataclasses.replace(scenario, cards=(scenario.cards[1], scenario.cards[0]))


def with_errors(scenario: FakeNvmlScenario, errors: dict[int, dict[str, int]]) -> FakeNvmlScenario:
    cards = tuple(dataclasses.replace(c, errors={**c.errors, **errors.get(i, {})})
                  for i, c in enumerate(scenario.cards))
    return dataclasses.replace(scenario, cards=cards)


def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.01)


@pytest.fixture
def listen() -> Iterator[Callable[..., XidListener]]:
    """``listen(**options)``: a started listener (short waits), stopped when the test ends."""
    started: list[XidListener] = []

    def start(**options: float) -> XidListener:
        listener = XidListener(wait_ms=int(options.pop("wait_ms", 50)), **options)
        listener.start()
        started.append(listener)
        return listener

    yield start
    for listener in started:
        assert listener.stop(timeout=5.0)


def xid_samples(scraper: Scraper) -> dict[tuple[str, str, str, str], float]:
    """(sample name, card, index, xid) -> value, for one scrape's XID families."""
    return {(s.name, s.labels["card"], s.labels["index"], s.labels["xid"]): s.value
            for f in scraper.families() if f.name in XID_FAMILIES for s in f.samples}


def counts(scraper: Scraper) -> dict[tuple[str, str, str], float]:
    return {key[1:]: v for key, v in xid_samples(scraper).items() if key[0] == "mig_exporter_xid_errors_total"}


def watched(listener: XidListener, cards: int) -> None:
    eventually(lambda: listener.status() == XidWatch(True, cards, None))


# -- placing the events ---------------------------------------------------------------------------


def test_an_xid_on_a_whole_card_is_on_its_index_and_one_on_a_mig_instance_on_the_instance(
        fake_nvml_lib: Install, listen: Callable[..., XidListener]) -> None:
    fake = fake_nvml_lib(two_cards())
    listener = listen()
    scraper = Scraper(NvmlSource())
    scraper.xids = listener
    watched(listener, 2)
    before = time.time()
    fake.emit_xid(0, 79)
    fake.emit_xid(1, 43, gpu_instance_id=9, compute_instance_id=0)  # 1/mig2
    fake.emit_xid(1, 43, gpu_instance_id=9, compute_instance_id=0)
    fake.emit_xid(1, 43, gpu_instance_id=3, compute_instance_id=0)  # 1/mig1, its neighbour
    eventually(lambda: fake.called("nvmlEventSetWait_v2") >= 5)  # the four delivered, and one more wait

    samples = xid_samples(scraper)
    after = time.time()

    assert counts(scraper) == {("0", "0", "79"): 1, ("1", "1102", "43"): 2, ("1", "1101", "43"): 1}
    last = {k[1:]: v for k, v in samples.items() if k[0] == "mig_exporter_xid_last_timestamp_seconds"}
    assert set(last) == {("0", "0", "79"), ("1", "1102", "43"), ("1", "1101", "43")}
    assert all(before <= v <= after for v in last.values())
    assert fake.exceptions == []


def test_the_first_xid_shows_as_a_series_of_count_one(fake_nvml_lib: Install,
                                                      listen: Callable[..., XidListener]) -> None:
    fake = fake_nvml_lib(two_cards())
    listener = listen()
    scraper = Scraper(NvmlSource())
    scraper.xids = listener
    watched(listener, 2)
    assert counts(scraper) == {}  # the families, with no series yet

    fake.emit_xid(0, 48)
    eventually(lambda: bool(counts(scraper)))

    assert counts(scraper) == {("0", "0", "48"): 1}
    fake.emit_xid(0, 48)
    eventually(lambda: counts(scraper) == {("0", "0", "48"): 2})


def test_an_xid_stays_on_its_instance_once_the_instance_is_destroyed(fake_nvml_lib: Install,
                                                                     listen: Callable[..., XidListener]) -> None:
    scenario = two_cards()
    fake = fake_nvml_lib(scenario)
    listener = listen()
    scraper = Scraper(NvmlSource())
    scraper.xids = listener
    watched(listener, 2)
    assert counts(scraper) == {}  # a scrape that saw 1/mig2 (GPU instance 9)
    fake.emit_xid(1, 43, gpu_instance_id=9, compute_instance_id=0)
    eventually(lambda: fake.called("nvmlEventSetWait_v2") >= 3)
    card = scenario.cards[1]
    fake.set_scenario(dataclasses.replace(scenario, cards=(scenario.cards[0], dataclasses.replace(
        card, mig_devices=tuple(m for m in card.mig_devices if m.index != 2)))))

    assert counts(scraper) == {("1", "1102", "43"): 1}  # placed as the last snapshot that had it
    assert counts(scraper) == {("1", "1102", "43"): 1}


def test_an_event_on_a_gpu_instance_alone_is_on_its_one_compute_instance(
        fake_nvml_lib: Install, listen: Callable[..., XidListener]) -> None:
    fake = fake_nvml_lib(two_cards())
    listener = listen()
    scraper = Scraper(NvmlSource())
    scraper.xids = listener
    watched(listener, 2)
    fake.emit_xid(1, 31, gpu_instance_id=2)  # no compute instance named
    fake.emit_xid(1, 31, gpu_instance_id=77, compute_instance_id=0)  # an instance no read ever saw
    eventually(lambda: fake.called("nvmlEventSetWait_v2") >= 3)

    assert counts(scraper) == {("1", "1100", "31"): 1, ("1", "1", "31"): 1}


def test_the_nvidia_smi_path_has_the_kernel_logs_xids_and_no_nvml_events(tmp_path: Path) -> None:
    # serve starts no listener there (cli.py); the kernel's log is read on every path (test_kmsg.py).
    scraper = Scraper(DemoSource())  # not NVML: the demo, as nvidia-smi
    scraper.kmsg = KmsgReader(str(SAMPLES / "demo-kmsg.txt"))

    assert counts(scraper) == {("0", "1000", "94"): 1, ("1", "1", "13"): 2, ("1", "1", "79"): 1}
    families = {f.name: f for f in scraper.families()}
    assert [(s.labels, s.value) for s in families["mig_exporter_xid_source_readable"].samples] == [
        ({"source": "kmsg"}, 1)]


# -- what it survives -----------------------------------------------------------------------------


def test_no_permission_is_said_and_the_exporter_still_serves_without_xids(
        fake_nvml_lib: Install, listen: Callable[..., XidListener]) -> None:
    refused = {"nvmlDeviceRegisterEvents": NVML_ERROR_NO_PERMISSION}
    fake = fake_nvml_lib(with_errors(two_cards(), {0: refused, 1: refused}))

    assert xid_watch_status() == XidWatch(False, 0, NO_PERMISSION_REASON)
    assert fake.init_count == 0  # what it opened, it shut
    asked, started = fake.called("nvmlDeviceRegisterEvents"), time.monotonic()
    listener = listen(retry_s=0.2)
    scraper = Scraper(NvmlSource())
    scraper.xids = listener
    eventually(lambda: listener.status().reason == NO_PERMISSION_REASON)
    time.sleep(0.5)

    assert listener.status() == XidWatch(False, 0, NO_PERMISSION_REASON)
    families = {f.name: f for f in scraper.families()}
    assert [s.value for s in families["mig_exporter_read_success"].samples] == [1]
    assert families["mig_exporter_xid_errors"].samples == []
    assert fake.called("nvmlEventSetWait_v2") == 0  # nothing registered: nothing waited on
    tries = (fake.called("nvmlDeviceRegisterEvents") - asked) / 2  # each try asks both cards
    assert tries <= 1 + (time.monotonic() - started) / 0.2  # tried again each retry_s, not in a loop
    assert "run as root" in NO_PERMISSION_REASON and "13, 31, 43" in NO_PERMISSION_REASON


def test_a_card_without_xid_events_is_named_and_the_others_watched(fake_nvml_lib: Install) -> None:
    fake_nvml_lib(with_errors(two_cards(), {1: {"nvmlDeviceGetSupportedEventTypes": NVML_ERROR_NOT_SUPPORTED,
                                                "nvmlDeviceRegisterEvents": NVML_ERROR_NOT_SUPPORTED}}))

    assert xid_watch_status() == XidWatch(True, 1, "the driver does not report XID events on this card (card 1)")


def test_a_card_lost_on_register_is_left_out_and_the_others_still_watched(
        fake_nvml_lib: Install, listen: Callable[..., XidListener]) -> None:
    scenario = two_cards()
    fake = fake_nvml_lib(with_errors(scenario, {0: {"*": NVML_ERROR_GPU_IS_LOST}}))
    listener = listen(retry_s=0.3)
    scraper = Scraper(NvmlSource())
    scraper.xids = listener
    eventually(lambda: listener.status().cards == 1)

    assert listener.status().watching
    assert "fell off the bus" in str(listener.status().reason) and "(card 0)" in str(listener.status().reason)
    fake.emit_xid(1, 43, gpu_instance_id=9, compute_instance_id=0)
    eventually(lambda: counts(scraper) == {("1", "1102", "43"): 1})

    fake.set_scenario(scenario)  # card 0 back: registered again at the next retry
    watched(listener, 2)
    fake.emit_xid(0, 79)
    eventually(lambda: ("0", "0", "79") in counts(scraper))


def test_a_card_lost_while_waiting_is_dropped_and_the_others_go_on(
        fake_nvml_lib: Install, listen: Callable[..., XidListener]) -> None:
    scenario = two_cards()
    fake = fake_nvml_lib(scenario)
    listener = listen()
    scraper = Scraper(NvmlSource())
    scraper.xids = listener
    watched(listener, 2)

    fake.set_scenario(with_errors(scenario, {1: {"*": NVML_ERROR_GPU_IS_LOST}}))
    eventually(lambda: listener.status().cards == 1)
    fake.emit_xid(0, 79)
    eventually(lambda: ("0", "0", "79") in counts(scraper))

    assert listener.status().watching and "(card 1)" in str(listener.status().reason)
    assert fake.exceptions == []


def test_no_nvml_is_said_without_a_crash(fake_nvml_lib: Install, listen: Callable[..., XidListener]) -> None:
    fake_nvml_lib(dataclasses.replace(two_cards(), init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))

    status = xid_watch_status()
    listener = listen()
    eventually(lambda: listener.status().reason not in ("not started", "starting"))

    assert status == listener.status()
    assert status.reason is not None and status.reason.startswith("NVML cannot be initialised: ")
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in status.reason
    assert not status.watching


def test_stop_ends_the_thread_within_its_timeout(fake_nvml_lib: Install) -> None:
    fake = fake_nvml_lib(two_cards())
    listener = XidListener()  # the real wait: a second
    listener.start()
    watched(listener, 2)
    thread = listener._thread
    time.sleep(0.2)  # inside a wait

    started = time.monotonic()
    assert listener.stop(timeout=2.0)
    assert time.monotonic() - started < 1.5
    assert thread is not None and not thread.is_alive()
    assert listener.status() == XidWatch(False, 0, "stopped")
    assert fake.init_count == 0  # its NVML shut down, its set freed
    assert fake.called("nvmlEventSetFree") == fake.called("nvmlEventSetCreate") == 1


def test_the_thread_never_spins(fake_nvml_lib: Install, listen: Callable[..., XidListener]) -> None:
    fake = fake_nvml_lib(two_cards())
    listener = listen(wait_ms=100)
    watched(listener, 2)
    before = fake.called("nvmlEventSetWait_v2")
    time.sleep(1.0)

    assert fake.called("nvmlEventSetWait_v2") - before <= 12  # a wait each 100 ms, no more


def test_a_wait_that_fails_at_once_does_not_spin(fake_nvml_lib: Install, listen: Callable[..., XidListener]) -> None:
    scenario = two_cards()
    fake = fake_nvml_lib(scenario)
    listener = listen(wait_ms=100)
    watched(listener, 2)
    fake.set_scenario(with_errors(scenario, {0: {"nvmlEventSetWait_v2": pynvml.NVML_ERROR_UNKNOWN}}))
    time.sleep(0.2)
    before = fake.called("nvmlEventSetWait_v2")
    time.sleep(1.0)

    assert fake.called("nvmlEventSetWait_v2") - before <= 12


# -- the C fake: its event struct, and serve over it ----------------------------------------------


def test_the_c_fake_event_struct_has_pynvml_layout(fake_libnvml_dir: Path) -> None:
    cls = pynvml.c_nvmlEventData_t
    expected = {"nvmlEventData_t": ctypes.sizeof(cls)}
    expected |= {f"nvmlEventData_t.{name}": getattr(cls, name).offset for name, *_ in cls._fields_}
    assert _layouts(fake_libnvml_dir / SONAME, list(expected)) == expected


def test_serve_over_the_c_library_counts_a_queued_xid(fake_libnvml_env: Callable[..., dict[str, str]]) -> None:
    env = fake_libnvml_env("demo")  # card 0 in MIG mode (1/mig2 of the brief is 0/mig2 here: GI 9), card 1 whole
    with open(env[SCENARIO_VARIABLE], "a") as scenario:
        scenario.write(xid_lines((1, 79, None, None, 300), (0, 43, 9, 0, 300)))
    env = cli_env(**{k: v for k, v in env.items() if not k.startswith("MIG_EXPORTER_")})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)

    with serving("--source", "nvml", "--web.listen-address", "127.0.0.1:0", "--collector.xid.kmsg", "",
                 env=env) as server:
        deadline = time.monotonic() + 15
        while True:
            status, body = server.get("/metrics")
            if 'mig_exporter_xid_errors_total{card="0",index="1002",xid="43"} 1.0' in body:
                break
            assert time.monotonic() < deadline, (body, server.log)
            time.sleep(0.1)
        assert status == 200
        assert 'mig_exporter_xid_errors_total{card="1",index="1",xid="79"} 1.0' in body
        assert 'mig_exporter_xid_last_timestamp_seconds{card="1",index="1",xid="79"}' in body
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=10) == 0
    assert any("watching XID events on 2 card(s)" in line for line in server.log), server.log
