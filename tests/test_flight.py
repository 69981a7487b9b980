"""One keyed single-flight (core/flight.py) for every shared read: callers of one key share one
run, each waits only until its own deadline, what the run raised reaches every caller, callers
a run kept past their deadline share one late answer, and a run hung for good neither doubles
nor holds up the interpreter's exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from mig_exporter.core import flight, workers
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import ReadError
from mig_exporter.core.flight import FlightFailed, Flights
from mig_exporter.core.workers import Workers

pytestmark = pytest.mark.timeout(30)


def one_shot() -> Workers:
    """Workers that end with their run, so a test can join the thread its run took (the
    exporter's own keep theirs for the next run: tests/test_workers.py)."""
    return Workers(idle_s=0)


class Work:
    """Work that counts its runs and, while ``hold`` is set, waits until released."""

    def __init__(self, hold: bool = True, error: Exception | None = None) -> None:
        self.runs = 0
        self.lates = 0
        self.hold = hold
        self.error = error
        self.release = threading.Event()
        self.started = threading.Event()
        self.threads: list[threading.Thread] = []
        self.names: list[str] = []  # each run's thread's name as it ran (an idle worker is renamed)

    def __call__(self) -> str:
        self.runs += 1
        run = self.runs
        self.threads.append(threading.current_thread())
        self.names.append(threading.current_thread().name)
        self.started.set()
        if self.hold:
            self.release.wait(10)
        if self.error is not None:
            raise self.error
        return f"run {run}"

    def late(self) -> str:
        self.lates += 1
        return f"late {self.lates}"


def ask(flights: Flights, key: str, work: Work, budget_s: float, results: list) -> threading.Thread:
    """A caller in a thread of its own; what it got (or raised) and when, in ``results``."""
    def call() -> None:
        started = time.monotonic()
        try:
            results.append((flights.run(key, Deadline.after(budget_s), work, work.late), time.monotonic() - started))
        except Exception as e:
            results.append((e, time.monotonic() - started))

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def wait_joined(flights: Flights, key: str, count: int) -> None:
    """Until ``count`` callers wait on the run of ``key``: releasing it earlier would let a slow
    thread start a run of its own."""
    deadline = time.monotonic() + 10
    while flights.joined(key) < count:
        assert time.monotonic() < deadline, f"{flights.joined(key)} of {count} callers joined"
        time.sleep(0.005)


def finish(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()


# --- sharing -----------------------------------------------------------------------------------

def test_callers_of_one_key_share_one_run() -> None:
    flights: Flights[str, str] = Flights("read", workers=one_shot())
    work = Work()
    results: list = []
    first = ask(flights, "gpu", work, 5.0, results)
    assert work.started.wait(5)
    others = [ask(flights, "gpu", work, 5.0, results) for _ in range(20)]
    wait_joined(flights, "gpu", 20)
    work.release.set()
    finish(first, *others)
    assert work.runs == 1
    assert [answer for answer, _ in results] == ["run 1"] * 21
    assert flights.joined("gpu") == 0, "the run has left the table"


def test_each_key_has_runs_of_its_own() -> None:
    flights: Flights[str, str] = Flights("probe", workers=one_shot())
    slow, fast = Work(), Work(hold=False)
    results: list = []
    held = ask(flights, "slow", slow, 5.0, results)
    assert slow.started.wait(5)
    assert flights.run("fast", Deadline.after(5.0), fast, fast.late) == "run 1"
    assert (slow.runs, fast.runs) == (1, 1) and held.is_alive(), "the other key's run does not wait for this one"
    slow.release.set()
    finish(held)
    assert results[0][0] == "run 1"


def test_a_run_that_has_ended_is_not_reused() -> None:
    flights: Flights[str, str] = Flights("read", workers=one_shot())
    work = Work(hold=False)
    assert flights.run("gpu", Deadline.after(5.0), work, work.late) == "run 1"
    assert flights.run("gpu", Deadline.after(5.0), work, work.late) == "run 2"


def test_the_work_runs_in_a_daemon_thread_named_by_the_flight() -> None:
    flights: Flights[str, str] = Flights("scrape", workers=one_shot())
    work = Work(hold=False)
    flights.run("gpu", Deadline.after(5.0), work, work.late)
    (thread,) = work.threads
    assert thread is not threading.current_thread() and thread.daemon and work.names == ["scrape"]


# --- errors ------------------------------------------------------------------------------------

def test_every_caller_of_a_run_that_raised_gets_the_error() -> None:
    flights: Flights[str, str] = Flights("scrape", workers=one_shot())
    bug = RuntimeError("mapping bug")
    work = Work(error=bug)
    results: list = []
    threads = [ask(flights, "gpu", work, 5.0, results)]
    assert work.started.wait(5)
    threads += [ask(flights, "gpu", work, 5.0, results) for _ in range(3)]
    wait_joined(flights, "gpu", 3)
    work.release.set()
    finish(*threads)
    assert work.runs == 1
    errors = [e for e, _ in results]
    # The caller that started the run raises its error; each of the others an exception of its
    # own caused by it: raising the one object in every thread would pile every thread's frames
    # onto its traceback.
    assert errors.count(bug) == 1
    joined = [e for e in errors if e is not bug]
    assert len(joined) == 3 and all(isinstance(e, FlightFailed) and e.__cause__ is bug for e in joined)
    assert str(joined[0]) == "the shared scrape failed: mapping bug"


def test_a_refused_admission_starts_nothing_and_a_joiner_is_not_asked() -> None:
    flights: Flights[str, str] = Flights("probe", workers=one_shot())
    work = Work()
    asked: list[str] = []

    def refuse() -> None:
        asked.append("refused")
        raise LookupError("no slot")

    with pytest.raises(LookupError, match="no slot"):
        flights.run("gpu", Deadline.after(5.0), work, work.late, admit=refuse)
    assert work.runs == 0 and flights.joined("gpu") == 0
    results: list = []
    first = ask(flights, "gpu", work, 5.0, results)
    assert work.started.wait(5)
    # Joining the run in flight needs no admission: refuse() is not called.
    joiner = threading.Thread(target=lambda: results.append(
        (flights.run("gpu", Deadline.after(5.0), work, work.late, admit=refuse), 0.0)))
    joiner.start()
    wait_joined(flights, "gpu", 1)
    work.release.set()
    finish(first, joiner)
    assert asked == ["refused"] and [answer for answer, _ in results] == ["run 1", "run 1"]


# --- deadlines ---------------------------------------------------------------------------------

def test_a_caller_with_a_sooner_deadline_joins_the_run_and_answers_at_its_own() -> None:
    """Behind a run due in 8 s (a read hung for all of it), a caller with 0.5 s joins it, rather
    than starting another, and answers after its own 0.5 s with the late answer; the run goes on."""
    flights: Flights[str, str] = Flights("read", workers=one_shot())
    work = Work()
    results: list = []
    slow = ask(flights, "gpu", work, 8.0, results)
    assert work.started.wait(5)
    started = time.monotonic()
    answer = flights.run("gpu", Deadline.after(0.5), work, work.late)
    waited = time.monotonic() - started
    assert answer == "late 1" and work.runs == 1
    # No grace: the run was not due by this caller's deadline, so the grace would not bring it.
    assert 0.5 <= waited < 0.5 + flight.JOIN_GRACE_S, f"waited {waited:.2f}s"
    assert slow.is_alive()
    work.release.set()
    finish(slow)
    assert results[0][0] == "run 1"


def test_a_run_due_by_the_callers_deadline_gets_the_grace_to_answer() -> None:
    """A command killed at the deadline answers a few ms after it: the caller waits that long."""
    flights: Flights[str, str] = Flights("read", workers=one_shot())

    def a_little_late() -> str:
        time.sleep(0.4)
        return "answered"

    started = time.monotonic()
    assert flights.run("gpu", Deadline.after(0.3), a_little_late, lambda: "late") == "answered"
    assert time.monotonic() - started < 0.3 + flight.JOIN_GRACE_S


def test_callers_kept_past_their_deadline_together_share_one_late_answer(monkeypatch) -> None:
    """A run that overran its own deadline (a bug) keeps callers waiting: they answer at their
    deadline, with one late answer between them (a failed read counted and logged once)."""
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 0.05)
    flights: Flights[str, str] = Flights("scrape", workers=one_shot())
    work = Work()
    results: list = []
    first = ask(flights, "gpu", work, 1.0, results)  # a bug: it holds past its 1 s
    assert work.started.wait(5)
    joiners = [ask(flights, "gpu", work, 1.1, results) for _ in range(3)]
    wait_joined(flights, "gpu", 3)
    finish(first, *joiners)
    assert work.runs == 1 and work.lates == 1
    assert sorted(answer for answer, _ in results) == ["late 1"] * 4
    # Each at its own deadline and the grace, the one that started the run too.
    assert all(1.0 <= waited < 2.0 for _, waited in results), results
    # A caller that joins once that answer was made waits with no one: it gets one of its own.
    assert flights.run("gpu", Deadline.after(0.2), work, work.late) == "late 2"
    assert work.runs == 1
    work.release.set()


def test_an_overdue_run_is_joined_not_doubled() -> None:
    """A run past its own deadline (a driver call hung for good) is joined by the next caller,
    who answers at its own deadline: the hung call holds one thread, not one per scrape."""
    flights: Flights[str, str] = Flights("read", workers=one_shot())
    work = Work()
    assert flights.run("gpu", Deadline.after(0.1), work, work.late) == "late 1"
    time.sleep(0.2)
    started = time.monotonic()
    assert flights.run("gpu", Deadline.after(0.3), work, work.late) == "late 2"
    assert time.monotonic() - started < 0.3 + flight.JOIN_GRACE_S + 0.2
    assert work.runs == 1 and len(work.threads) == 1
    work.release.set()
    work.threads[0].join(10)
    # Once it has ended, the next caller starts afresh.
    work.hold = False
    assert flights.run("gpu", Deadline.after(5.0), work, work.late) == "run 2"


_HUNG_AT_EXIT = textwrap.dedent("""
    import threading, time
    from mig_exporter.core.deadline import Deadline
    from mig_exporter.core.flight import Flights
    hung = threading.Event()
    def work():
        hung.wait()  # never set: a driver call that never returns
        return "never"
    started = time.monotonic()
    print(Flights("read").run("gpu", Deadline.after(0.2), work, lambda: "late"))
    print(round(time.monotonic() - started, 2))
""")


def test_a_hung_run_does_not_hold_up_the_interpreters_exit() -> None:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", _HUNG_AT_EXIT], capture_output=True, text=True, timeout=20)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    answer, waited = result.stdout.split()
    assert answer == "late" and float(waited) < 1.0
    assert elapsed < 10, f"the interpreter took {elapsed:.1f}s to exit"


def test_a_caller_that_joins_an_overdue_run_waits_until_its_own_deadline_alone(monkeypatch) -> None:
    """Behind a run past its deadline and the grace (a call hung for good), the grace would only
    make every answer late: the caller answers at its own deadline."""
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 1.5)
    flights: Flights[str, str] = Flights("read", workers=one_shot())
    work = Work()
    results: list = []
    finish(ask(flights, "gpu", work, 0.05, results))  # its starter waited 0.05 s and the grace
    assert results[0][0] == "late 1"
    started = time.monotonic()
    assert flights.run("gpu", Deadline.after(0.2), work, work.late) == "late 2"
    waited = time.monotonic() - started
    assert waited < 1.0, f"waited {waited:.2f}s: the grace was added to a run long overdue"
    assert work.runs == 1
    work.release.set()


def test_work_that_no_deadline_reaches_is_waited_for_with_no_grace(monkeypatch) -> None:
    """An NVML call hung in the driver does not end at its deadline: a grace would only make the
    answer late, for the caller that started the run too."""
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 5.0)
    flights: Flights[str, str] = Flights("nvml-read", workers=one_shot(), ends_at_deadline=False)
    work = Work()
    started = time.monotonic()
    assert flights.run("gpu", Deadline.after(0.2), work, work.late) == "late 1"
    waited = time.monotonic() - started
    assert waited < 2.5, f"waited {waited:.2f}s"
    work.release.set()


# --- a run's failure, one failed answer --------------------------------------------------------

def test_a_run_whose_callers_all_answered_late_keeps_none(monkeypatch) -> None:
    """The run's failure is no one's answer when every caller has answered late: its work is told
    so, and counts and logs nothing (each late answer counted itself)."""
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 0.05)
    flights: Flights[str, str] = Flights("scrape", workers=one_shot())
    kept: list[bool] = []
    work = Work()

    def failing() -> str:
        work()
        kept.append(flights.keep_callers("gpu"))
        return "failed"

    assert flights.run("gpu", Deadline.after(0.1), failing, work.late) == "late 1"
    work.release.set()
    work.threads[0].join(10)
    assert kept == [False]


class Keeping(Work):
    """Work that, once ``keep`` is set, asks to keep its callers, then goes on as ``Work``."""

    def __init__(self, flights: Flights, key: str) -> None:
        super().__init__()
        self.flights, self.key = flights, key
        self.began = threading.Event()
        self.keep = threading.Event()
        self.kept: list[bool] = []

    def __call__(self) -> str:
        self.began.set()
        self.keep.wait(10)
        self.kept.append(self.flights.keep_callers(self.key))
        return super().__call__()


def test_a_run_keeps_the_callers_still_waiting_and_they_take_its_answer(monkeypatch) -> None:
    """One caller waits still, another answered late: the run's failure is the waiting one's
    answer, and once kept, a caller whose deadline passes waits for it rather than answer late
    (the same failure counted twice)."""
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 5.0)  # how long a kept caller waits past its deadline
    flights: Flights[str, str] = Flights("scrape", workers=one_shot())
    work = Keeping(flights, "gpu")
    results: list = []
    starter = ask(flights, "gpu", work, 10.0, results)
    assert work.began.wait(5)
    finish(ask(flights, "gpu", work, 0.1, results))
    assert results.pop()[0] == "late 1"
    work.keep.set()  # the starter still waits: the run keeps it
    assert work.started.wait(5) and work.kept == [True]
    joiner = ask(flights, "gpu", work, 0.3, results)
    wait_joined(flights, "gpu", 2)
    time.sleep(0.5)  # past the joiner's deadline (should a slow machine not get there, its answer is the same)
    work.release.set()
    finish(starter, joiner)
    assert sorted(answer for answer, _ in results) == ["run 1", "run 1"]
    assert work.lates == 1


# --- a run that cannot start -------------------------------------------------------------------

def fail_thread_start_once(monkeypatch, name: str) -> list[str]:
    """Make ``Thread.start`` fail once, as at a pids limit, for a thread named ``name``; the
    exporter's workers are new ones, with no idle thread a run could take instead."""
    monkeypatch.setattr(workers, "WORKERS", Workers(idle_s=0))
    original = threading.Thread.start
    failed: list[str] = []

    def start(thread: threading.Thread) -> None:
        if thread.name == name and not failed:
            failed.append(name)
            raise RuntimeError("can't start new thread")
        original(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return failed


def test_a_run_that_cannot_start_leaves_nothing_behind(monkeypatch) -> None:
    failed = fail_thread_start_once(monkeypatch, "probe")
    flights: Flights[str, str] = Flights("probe", workers=one_shot())
    slots = threading.BoundedSemaphore(1)

    def admit():
        assert slots.acquire(blocking=False), "the slot the failed start took was never given back"
        return slots.release

    work = Work(hold=False)
    with pytest.raises(flight.FlightNotStarted, match="could not start a thread for the probe: can't start new thread"
                       ) as raised:
        flights.run("gpu", Deadline.after(5.0), work, work.late, admit)
    assert failed == ["probe"] and isinstance(raised.value.__cause__, RuntimeError)
    assert work.runs == 0 and not flights._runs
    # The key is not stuck and the slot is back: the next caller starts afresh, and takes it.
    assert flights.run("gpu", Deadline.after(5.0), work, work.late, admit) == "run 1"
    work.threads[0].join(10)
    assert slots.acquire(blocking=False), "the run that ended gave its slot back"


# --- what no caller takes ----------------------------------------------------------------------

@pytest.mark.parametrize("error, level, traceback", [
    (RuntimeError("mapping bug"), "ERROR", True),
    (ReadError("NVML call failed: GPU is lost"), "INFO", False),
])
def test_what_a_run_raised_after_every_caller_answered_late_is_logged_once(monkeypatch, caplog, error, level,
                                                                          traceback) -> None:
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 0.05)
    caplog.set_level("INFO", logger="mig_exporter")
    flights: Flights[str, str] = Flights("scrape", workers=one_shot())
    work = Work(error=error)
    assert flights.run("gpu", Deadline.after(0.1), work, work.late) == "late 1"
    work.release.set()
    work.threads[0].join(10)
    records = [r for r in caplog.records if r.name == "mig_exporter"]
    assert [(r.levelname, r.getMessage()) for r in records] == [
        (level, "a scrape run that every caller had answered late without failed"
         + ("" if traceback else f": {error}"))]
    assert (records[0].exc_info is not None) == traceback


def test_what_a_caller_takes_is_not_logged_here(caplog) -> None:
    caplog.set_level("INFO", logger="mig_exporter")
    flights: Flights[str, str] = Flights("scrape", workers=one_shot())
    work = Work(hold=False, error=RuntimeError("mapping bug"))
    with pytest.raises(RuntimeError):
        flights.run("gpu", Deadline.after(5.0), work, work.late)
    work.threads[0].join(10)
    assert [r for r in caplog.records if r.name == "mig_exporter"] == []
