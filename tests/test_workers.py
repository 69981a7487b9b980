"""The exporter's daemon threads (core/workers.py): a call takes an idle worker when there is
one, a new thread when every worker is busy (so a hung call never queues the next), a worker
idle for its idle time ends, and a bug in a call is logged without killing the worker."""

from __future__ import annotations

import threading
import time

import pytest

from mig_exporter.core.workers import IDLE_NAME, Workers

pytestmark = pytest.mark.timeout(30)


def run_and_wait(workers: Workers, name: str, call=lambda: None) -> threading.Thread:
    """Start ``call`` in ``workers`` and wait for it: the thread it ran in."""
    ran: list[threading.Thread] = []
    done = threading.Event()

    def traced() -> None:
        ran.append(threading.current_thread())
        try:
            call()
        finally:
            done.set()

    workers.start(traced, name)
    assert done.wait(10)
    return ran[0]


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    until = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > until:
            return False
        time.sleep(0.01)
    return True


def test_a_call_after_another_takes_the_same_idle_thread() -> None:
    workers = Workers(idle_s=30)
    first = run_and_wait(workers, "scrape")
    assert wait_until(lambda: first.name == IDLE_NAME)
    names: list[str] = []
    second = run_and_wait(workers, "probe", lambda: names.append(threading.current_thread().name))
    assert second is first and first.daemon
    assert names == ["probe"]  # a worker takes its call's name while it runs
    assert workers.threads == 1


def test_a_hung_call_does_not_hold_up_the_next() -> None:
    workers = Workers(idle_s=30)
    hung = threading.Event()
    workers.start(hung.wait, "nvml-read")
    try:
        other = run_and_wait(workers, "scrape")
        assert other.name in ("scrape", IDLE_NAME)
        assert workers.threads == 2
    finally:
        hung.set()


def test_an_idle_worker_ends_after_its_idle_time() -> None:
    workers = Workers(idle_s=0.05)
    thread = run_and_wait(workers, "scrape")
    thread.join(10)
    assert not thread.is_alive() and workers.threads == 0
    # and a later call starts a new one
    assert run_and_wait(workers, "scrape") is not thread


def test_a_bug_in_a_call_is_logged_and_the_worker_goes_on(caplog) -> None:
    caplog.set_level("ERROR", logger="mig_exporter")
    workers = Workers(idle_s=30)

    def bug() -> None:
        raise ZeroDivisionError("a bug")

    first = run_and_wait(workers, "scrape", bug)
    # Only this pool's records: a daemon thread another test left may log meanwhile.
    mine = lambda: [r for r in caplog.records if r.getMessage().startswith("a call in")]  # noqa: E731
    assert wait_until(lambda: any(r.exc_info for r in mine()))
    assert [r.getMessage() for r in mine()] == ["a call in the scrape thread failed"]
    assert run_and_wait(workers, "scrape") is first


def test_a_thread_that_cannot_start_leaves_nothing_counted(monkeypatch) -> None:
    workers = Workers(idle_s=30)

    def fail(thread: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", fail)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        workers.start(lambda: None, "scrape")
    assert workers.threads == 0


def test_many_calls_at_once_each_run() -> None:
    workers = Workers(idle_s=30)
    gate = threading.Barrier(9)  # 8 calls and this test: all must run at the same time
    for _ in range(8):
        workers.start(lambda: gate.wait(10), "probe")
    gate.wait(10)
    assert workers.threads == 8
