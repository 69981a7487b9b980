"""``/probe?target=NAME``: one read through a command named in the config file,
the way blackbox_exporter probes a target.

Only a name from the config's ``probe_targets`` can run; the query string is
checked before anything starts, and whatever is not exactly one configured
name is refused with a one-line reason. Each answer is the probe's families
alone (``ProbeResult.answer()``)::

    probe_success 1.0
    probe_duration_seconds 0.21
    probe_read_problems 0.0
    mig_exporter_device_memory_used_bytes{card="0",index="1000",mig_profile="3g.40gb"} 3.768582144e+09
    ...

At most ``max_concurrent`` commands run at once; a probe beyond that is
refused at once (the server answers 503) instead of queueing behind hung
ones. Probes of a target that is already running wait for that run and share
its result, so a burst of scrapes costs one run (``core/flight.py``, keyed by
target), and its answer: the families and their encoded bytes are made once
per run. A run's answer that succeeded is given as it is to probes of the
target that arrive within ``REUSE_S`` of its end while a connection still has
its bytes queued, as ``/metrics`` does (``metrics/exporter.py``): clients that
never read pin one answer a window, not one each. The exporter's own counters
about probes are served on ``/metrics`` (``collect()``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mig_exporter.config.checks import ConfigError, one_line
from mig_exporter.config.file import TARGET_NAME, Config, ProbeTarget, load_config
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.flight import FlightFailed, FlightNotStarted, Flights
from mig_exporter.core.logs import shown
from mig_exporter.core.ratelog import RateLimitedLog
from mig_exporter.metrics.exporter import REUSE_S, Answer, reusable
from mig_exporter.metrics.families import snapshot_families
from mig_exporter.metrics.scrape import ReadOutcome, Scraper
from mig_exporter.sources.nvidia_smi import DEFAULT_TIMEOUT_S, NvidiaSmiSource
from mig_exporter.web.reloader import Reloader

log = logging.getLogger("mig_exporter.web.probe")

DEFAULT_MAX_CONCURRENT = 4
# A config read slower than this is stuck: /-/ready says so, and no request waits for it.
RELOAD_DEADLINE_S = 5.0
REJECT_REASONS = ("bad_request", "busy")
_MAX_QUERY_FIELDS = 16
_SHOWN_CHARS = 64
_NAMES_IN_MESSAGE = 10


class BadProbeRequest(Exception):
    """The query does not name exactly one configured target (HTTP 400)."""


class ProbeBusy(Exception):
    """The probe cannot run now (HTTP 503): all probe slots are taken, or no thread could be
    started for its run (a pids limit)."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    target: ProbeTarget
    outcome: ReadOutcome
    duration_s: float
    # The answer the probes of one successful run share (``Prober.probe``); None: an answer of its own.
    shared: SharedAnswer | None = field(default=None, compare=False, repr=False)

    def collect(self) -> Iterator[Metric]:
        """The families of the answer."""
        yield GaugeMetricFamily("probe_success", "1 when the probe's read succeeded, 0 when it failed (see the log).",
                                value=int(self.outcome.success))
        yield GaugeMetricFamily("probe_duration_seconds", "How long the probe took, in seconds.", value=self.duration_s)
        snapshot = self.outcome.snapshot
        if snapshot is not None:
            yield GaugeMetricFamily(
                "probe_read_problems",
                "Problems in the probe's read that did not fail it (an unreadable card or value, a failed "
                "nvidia-smi -L); each is logged.",
                value=len(snapshot.problems),
            )
            yield from snapshot_families(snapshot)

    def answer(self) -> Answer:
        """What the server sends: these families alone, encoded as the request asks; for a run's
        shared answer, the one its first probe made (with that probe's duration)."""
        if self.shared is None:
            return Answer(list(self.collect()))
        return self.shared.get(lambda: Answer(list(self.collect())))


class SharedAnswer:
    """The answer of one successful run of a target, made once, by the first probe that asks,
    and given to every probe that shares the run or reuses it (issue 38: 450 probes that never
    read their answers pinned 450 copies of a big target's body)."""

    def __init__(self, outcome: ReadOutcome, ended_at: float, duration_s: float) -> None:
        self.outcome = outcome
        self.ended_at = ended_at  # time.monotonic() when the first probe took the run's outcome
        self.duration_s = duration_s  # that probe's: what the answer says
        self._lock = threading.Lock()
        self._answer: Answer | None = None

    def get(self, make: Callable[[], Answer]) -> Answer:
        with self._lock:
            if self._answer is None:
                self._answer = make()
            return self._answer

    def reusable(self, now: float) -> bool:
        """Whether a probe arriving ``now`` takes this answer instead of a run: within
        ``REUSE_S`` of the run's end while a connection has its bytes queued."""
        with self._lock:
            answer = self._answer
        return reusable(answer, self.ended_at, now)


class Prober:
    """Runs probes against the configured targets; thread-safe.

    ``default_timeout_s`` is the deadline of a target whose config gives
    none. ``config_file`` is what ``reload()`` reads.
    """

    def __init__(
        self,
        config: Config,
        *,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        default_timeout_s: float = DEFAULT_TIMEOUT_S,
        config_file: str | None = None,
        on_reload: Callable[[Config], None] | None = None,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        self.max_concurrent = max_concurrent
        self.default_timeout_s = default_timeout_s
        self.config_file = config_file
        self.on_reload = on_reload  # the rest of the exporter takes its part of a reloaded config
        self._lock = threading.Lock()
        self._reload_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._runs: Flights[ProbeTarget, ReadOutcome] = Flights("probe")
        self._answers_lock = threading.Lock()
        # The answers of each target's successful runs that ended within REUSE_S, by id() of the run's
        # outcome (which each SharedAnswer holds): the probes of one run find its answer even when
        # they take it after a newer run has ended.
        self._answers: dict[ProbeTarget, dict[int, SharedAnswer]] = {}
        self._config = config
        self._scrapers: dict[ProbeTarget, Scraper] = {}
        self._probes: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._rejected = dict.fromkeys(REJECT_REASONS, 0)
        self._reload_ok = True
        self._reload_success_time = time.time()
        # A reload that changes nothing, or fails as the last one did, is logged once a window: a
        # flood of POST /-/reload (10 clients for 10 s once wrote 10 802 lines) is a few lines.
        self._reload_log = RateLimitedLog(log, burst=1)
        # POST /-/reload and SIGHUP read the file through it: in a thread of its own, one read at a
        # time, never in a pool thread (a FIFO or a hung mount once held all of them).
        self._reloader = Reloader(f"config file {config_file}", self.reload, RELOAD_DEADLINE_S)
        self._apply(config)

    @property
    def config(self) -> Config:
        with self._lock:
            return self._config

    # --- requests ----------------------------------------------------------------------------

    def target_for_query(self, query: str) -> ProbeTarget:
        """The target a query string names, or ``BadProbeRequest`` with a
        one-line reason. Nothing runs here."""
        config = self.config
        try:
            return _target_for_query(query, config.probe_targets)
        except BadProbeRequest as e:
            with self._lock:
                self._rejected["bad_request"] += 1
            log.debug("probe refused: %s", e)
            raise

    def timeout_for(self, target: ProbeTarget) -> float:
        return self.default_timeout_s if target.timeout_s is None else target.timeout_s

    def probe(self, target: ProbeTarget, deadline: Deadline) -> ProbeResult:
        """Read ``target`` by ``deadline``, or join its run in progress.
        Raises ``ProbeBusy`` at once when every slot is taken, or no thread can be started.
        Within ``REUSE_S`` of a successful run's end, while a connection still has its answer
        queued, that answer is given again and nothing runs."""
        started = time.monotonic()
        reused = self._reusable(target, started)
        if reused is not None:
            return self._counted(ProbeResult(target, reused.outcome, reused.duration_s, reused), own_timeout=False)
        starts = False  # whether this probe started the run: admit is asked for a new run alone
        # The run reads under the target's own timeout, never a probe's shorter deadline: one probe
        # asking for 0.1s must not fail the run the others join (issue 38). A probe due sooner
        # answers its own timeout alone, which is no failure of the target's read.
        limit = deadline.at_least(self.timeout_for(target))
        own_timeout = False

        def admit() -> Callable[[], None]:
            nonlocal starts
            release = self._take_slot()
            starts = True
            return release

        def own_late() -> ReadOutcome:
            nonlocal own_timeout
            own_timeout = True
            reason = f"this probe's own deadline of {deadline.at - started:.3g}s passed while the run went on"
            log.debug("probe of %s: %s", target.name, reason)
            return ReadOutcome(None, time.monotonic() - started, reason)

        def late() -> ReadOutcome:
            budget = f"{deadline.at - started:.3g}s"
            return self._failed(target, started, f"its run did not finish within the deadline of {budget}" if starts
                                else f"deadline of {budget} passed while waiting for the run already in progress")

        def read() -> ReadOutcome:
            return self._read(target, limit, lambda: self._runs.keep_callers(target))
        try:
            outcome = self._runs.run(target, deadline, read, late, admit, run_deadline=limit, own_late=own_late)
        except FlightFailed:
            outcome = self._failed(target, started, "the run this probe waited for ended without a result")
        except FlightNotStarted as e:
            raise ProbeBusy(str(e)) from e
        return self._counted(self._result(target, outcome, started), own_timeout)

    def _result(self, target: ProbeTarget, outcome: ReadOutcome, started: float) -> ProbeResult:
        """The probes of one successful run share its answer (the same outcome object: the run's);
        a failed probe's answer is its own, and never reused."""
        now = time.monotonic()
        if not outcome.success:
            return ProbeResult(target, outcome, now - started)
        with self._answers_lock:
            runs = self._answers.setdefault(target, {})
            shared = runs.get(id(outcome))
            if shared is None:
                shared = runs[id(outcome)] = SharedAnswer(outcome, now, now - started)
        return ProbeResult(target, outcome, shared.duration_s, shared)

    def _reusable(self, target: ProbeTarget, now: float) -> SharedAnswer | None:
        """The target's newest answer that a probe arriving ``now`` takes (``SharedAnswer.reusable``),
        if any; the answers past their window are let go."""
        self.forget_finished(now)
        with self._answers_lock:
            recent = sorted(self._answers.get(target, {}).values(), key=lambda shared: shared.ended_at, reverse=True)
        return next((shared for shared in recent if shared.reusable(now)), None)

    def forget_finished(self, now: float) -> None:
        """Let go of the answers no probe can reuse any more (their window has passed), so that a
        target's families are not kept between probes."""
        with self._answers_lock:
            for target, runs in list(self._answers.items()):
                for key in [key for key, shared in runs.items() if now - shared.ended_at > REUSE_S]:
                    del runs[key]
                if not runs:
                    del self._answers[target]

    def _counted(self, result: ProbeResult, own_timeout: bool) -> ProbeResult:
        with self._lock:
            name = result.target.name
            if name in self._probes:  # not a target a reload has removed
                self._probes[name] += 1
                if not result.outcome.success and not own_timeout:  # a client's deadline is no failure of the target
                    self._failures[name] += 1
        return result

    def _take_slot(self) -> Callable[[], None]:
        """Before a new run: a slot, or ``ProbeBusy``; what gives it back (the flight calls it when
        the run ends, or at once if the run cannot start). A probe that joins a run takes none."""
        if not self._slots.acquire(blocking=False):
            with self._lock:
                self._rejected["busy"] += 1
            raise ProbeBusy(f"{self.max_concurrent} probes are running already (--probe.max-concurrent)")
        return self._slots.release

    def _read(self, target: ProbeTarget, deadline: Deadline, answered: Callable[[], bool]) -> ReadOutcome:
        """One run, in the flight's thread: its failure is logged only if a probe takes it."""
        with self._lock:
            scraper = self._scraper_for(target)
        return scraper.read(deadline, answered)

    @staticmethod
    def _failed(target: ProbeTarget, started: float, reason: str) -> ReadOutcome:
        log.warning("read from probe target %s failed: %s", target.name, reason)
        return ReadOutcome(None, time.monotonic() - started, reason)

    def _scraper_for(self, target: ProbeTarget) -> Scraper:
        """The target's scraper (called with the lock held). Kept while the
        target is unchanged, so a problem is logged once, not at every probe;
        a target a reload has just replaced gets one of its own."""
        return self._scrapers.get(target) or self._new_scraper(target)

    def _new_scraper(self, target: ProbeTarget) -> Scraper:
        source = NvidiaSmiSource(target.command, self.timeout_for(target))
        return Scraper(source, name=f"probe target {target.name}")

    # --- config ------------------------------------------------------------------------------

    def request_reload(self, wait_s: float | None = None) -> tuple[bool, str] | None:
        """Ask for a reload (``reload``, run by the reloader) and wait up to ``wait_s`` for its
        outcome (where None, until it comes or the read is stuck past its deadline; beyond two
        callers, a quarter of a second: ``reloader.py``); None when it has not come by then
        (the reload still happens)."""
        if self.config_file is None:
            return False, "no config file to reload: serve was started without --config.file"
        return self._reloader.request(wait_s)

    def reload_stuck(self) -> str | None:
        """Why reloading is stuck (a read of the file past its deadline), or None."""
        return self._reloader.stuck()

    def reload(self) -> tuple[bool, str]:
        """Read ``config_file`` again. A bad file keeps the config in use;
        either way the answer is (ok, what happened: a line, then one line
        per error). Never raises: an unexpected error is a failed reload too
        (``mig_exporter_config_last_reload_successful`` 0), logged in one line
        (its traceback at debug level)."""
        if self.config_file is None:
            return False, "no config file to reload: serve was started without --config.file"
        with self._reload_lock:
            try:
                config = load_config(self.config_file)
                if self.on_reload is not None:  # first: should it fail, the probe targets stay as they are
                    self.on_reload(config)
            except ConfigError as e:
                return self._reload_failed(e.errors)
            except Exception as e:  # a bug, or MemoryError: the exporter goes on with the config in use
                log.debug("reloading %s failed", self.config_file, exc_info=True)
                return self._reload_failed([f"unexpected error: {one_line(e)}"])
            with self._lock:
                unchanged = config == self._config and self._reload_ok
            self._apply(config)
            with self._lock:
                self._reload_ok = True
                self._reload_success_time = time.time()
            if unchanged:
                message = f"reloaded {self.config_file}: unchanged, {config.summary()}"
                self._reload_log.log("unchanged", logging.INFO, "%s", message)
            else:
                message = f"reloaded {self.config_file}: {config.summary()}"
                log.info("%s", message)
            return True, message

    def _reload_failed(self, errors: Sequence[str]) -> tuple[bool, str]:
        with self._lock:
            self._reload_ok = False
            kept = self._config.summary()
        summary = f"reloading {self.config_file} failed; kept the previous config, {kept}"
        self._reload_log.log(("failed", tuple(errors)), logging.ERROR, "%s: %s", summary, "; ".join(errors))
        return False, "\n".join([f"{summary}:", *(f"  {error}" for error in errors)])

    def _apply(self, config: Config) -> None:
        """Use ``config``. Counters of targets that stay keep counting; a new
        target starts at 0; a removed target's series go away."""
        with self._lock:
            self._config = config
            names = list(config.probe_targets)
            self._probes = {n: self._probes.get(n, 0) for n in names}
            self._failures = {n: self._failures.get(n, 0) for n in names}
            old = self._scrapers
            self._scrapers = {}
            for target in config.probe_targets.values():
                self._scrapers[target] = old.get(target) or self._new_scraper(target)

    # --- the exporter's own metrics, on /metrics ----------------------------------------------

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            probes = dict(self._probes)
            failures = dict(self._failures)
            rejected = dict(self._rejected)
            reload_ok, reload_time = self._reload_ok, self._reload_success_time
        total = CounterMetricFamily("mig_exporter_probes", "Probes answered, by configured target.", labels=["target"])
        failed = CounterMetricFamily(
            "mig_exporter_probe_failures", "Probes answered with probe_success 0, by configured target.",
            labels=["target"],
        )
        for name in sorted(probes):
            total.add_metric([name], probes[name])
            failed.add_metric([name], failures[name])
        refused = CounterMetricFamily(
            "mig_exporter_probes_rejected",
            "Probe requests refused before anything ran: bad_request (HTTP 400: not exactly one configured target) "
            "or busy (HTTP 503: --probe.max-concurrent probes already running).",
            labels=["reason"],
        )
        for reason in REJECT_REASONS:
            refused.add_metric([reason], rejected[reason])
        yield from (total, failed, refused)
        if self.config_file is not None:
            yield GaugeMetricFamily(
                "mig_exporter_config_last_reload_successful",
                "1 when the config file was last loaded without error, 0 when the last reload failed.",
                value=int(reload_ok),
            )
            yield GaugeMetricFamily(
                "mig_exporter_config_last_reload_success_timestamp_seconds",
                "When the config file was last loaded successfully, in seconds since the epoch.",
                value=reload_time,
            )


def _target_for_query(query: str, targets: Mapping[str, ProbeTarget]) -> ProbeTarget:
    try:
        fields = parse_qsl(query, keep_blank_values=True, errors="strict", max_num_fields=_MAX_QUERY_FIELDS)
    except UnicodeDecodeError:
        raise BadProbeRequest("the query is not valid UTF-8 once percent-decoded") from None
    except ValueError:
        raise BadProbeRequest(f"more than {_MAX_QUERY_FIELDS} query parameters") from None
    unknown = sorted({k for k, _ in fields if k != "target"})
    if unknown:
        raise BadProbeRequest(f"unknown parameter {_shown(unknown[0])}: /probe takes only target=NAME")
    names = [v for _, v in fields]
    if not names:
        raise BadProbeRequest("missing target: use /probe?target=NAME with a NAME from probe_targets")
    if len(names) > 1:
        raise BadProbeRequest(f"target is given {len(names)} times; give it once")
    (name,) = names
    if not name:
        raise BadProbeRequest("empty target: use /probe?target=NAME with a NAME from probe_targets")
    if not TARGET_NAME.fullmatch(name):
        raise BadProbeRequest(
            f"target {_shown(name)} is not a target name: give a NAME from probe_targets, not a path or a command"
        )
    target = targets.get(name)
    if target is None:
        known = sorted(targets)
        listed = ", ".join(known[:_NAMES_IN_MESSAGE]) + (", ..." if len(known) > _NAMES_IN_MESSAGE else "")
        raise BadProbeRequest(f"unknown target {_shown(name)}: not in probe_targets ({listed or 'none configured'})")
    return target


def _shown(text: str) -> str:
    """Client input as it can be echoed: escaped to printable ASCII, one line, bounded."""
    return shown(text, _SHOWN_CHARS)
