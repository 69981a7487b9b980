"""Shared test fixtures: our own nvidia-smi outputs, the real corpus, and a fake nvidia-smi."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mig_exporter.core import workers
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.families import snapshot_families
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.snapshot import ACTIVITY_NOT_READ, Snapshot
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from mig_exporter.web.server import ExporterServer


@pytest.fixture(autouse=True)
def one_thread_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """In process, each test's runs take threads that end with them, as before the exporter
    kept its workers: a test can join the thread a run took, and one test's idle worker is never
    another's. Reuse itself is tested in tests/test_workers.py; a served process keeps its own."""
    monkeypatch.setattr(workers, "WORKERS", workers.Workers(idle_s=0))

# Any skip fails the run: a group is left out by deselecting it, never by skipping.
pytest_plugins = ["no_silent_skips"]

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures" / "nvidia-smi"
SAMPLES = REPO / "src" / "mig_exporter" / "samples"
# The real corpus lives beside the checkout (../shared), as in CI.
REAL_CORPUS = Path(os.environ.get("MIG_EXPORTER_REAL_CORPUS",
                                  REPO.parent / "shared" / "fixtures" / "nvidia-smi" / "real"))
MIB = 1024 * 1024


def fixture_bytes(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def scenario(name: str) -> Snapshot:
    """The snapshot of one of our fixture scenarios, -q -x and -L together."""
    return snapshot_from_smi(fixture_bytes(f"{name}.xml"), fixture_bytes(f"{name}.L.txt"))


def sample_value(families, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one sample among metric families, like registry.get_sample_value."""
    labels = labels or {}
    for family in families:
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition (text format), keyed by name and labels; a
    series exposed twice fails the test (Prometheus would refuse the scrape)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def value(parsed: dict, name: str, **labels: str) -> float | None:
    """The one sample of ``name`` in ``samples(text)`` whose labels include ``labels``."""
    found = [v for (n, ls), v in parsed.items() if n == name and set(labels.items()) <= ls]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} series"
    return found[0] if found else None


def samples_of(families, name: str) -> list:
    return [s for f in families for s in f.samples if s.name == name]


def without_activity(snapshot: Snapshot) -> Snapshot:
    """``snapshot`` without issue 39's activity, which only the NVML path reads (GPM) or which
    moves between two reads (GPM's first sample, the processes' samples since the last read)."""
    devices = tuple(dataclasses.replace(d, activity=None, activity_unknown=ACTIVITY_NOT_READ) for d in snapshot.devices)
    return dataclasses.replace(snapshot, devices=devices, process_activity=())


def families_of(snapshot: Snapshot) -> list:
    return list(snapshot_families(snapshot))


FakeSmi = Callable[..., Path]


def calls(fake: Path) -> list[tuple[int, str]]:
    """(pid, arguments) of each run of the fake, from its calls.log."""
    log = fake.parent / "calls.log"
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        pid, _, args = line.partition(" ")
        out.append((int(pid), args))
    return out


def escaped(fake: Path) -> list[int]:
    """The pids of the grandchildren the fake's ``escape`` runs left, from their pid files."""
    return sorted(int(f.read_text()) for f in fake.parent.glob("escaped.*") if not f.name.endswith(".tmp"))


@contextlib.contextmanager
def a_thread() -> Iterator[int]:
    """A thread of this process while the block runs: its id, which opens as /proc/TID but is
    not in /proc's listing (thread group leaders only)."""
    native: list[int] = []
    started, done = threading.Event(), threading.Event()

    def run() -> None:
        native.append(threading.get_native_id())
        started.set()
        done.wait(30)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        assert started.wait(10)
        assert native[0] != os.getpid() and os.path.exists(f"/proc/{native[0]}/status")
        assert native[0] not in {int(n) for n in os.listdir("/proc") if n.isdigit()}
        yield native[0]
    finally:
        done.set()
        worker.join(10)


@contextlib.contextmanager
def threads_started() -> Iterator[set[str]]:
    """The names of the threads that appear while the block runs (watched every 5 ms), filled
    in when it ends: what a read starts, once the exporter keeps its workers."""
    seen: set[threading.Thread] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(threading.enumerate())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, name="watcher")
    before = set(threading.enumerate()) | {watcher}
    started: set[str] = set()
    watcher.start()
    try:
        yield started
    finally:
        stop.set()
        watcher.join()
        started.update(t.name for t in seen - before)


def running(pid: int) -> bool:
    """Whether ``pid`` is a process still running (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _proc_stats() -> list[tuple[int, str, int, int]]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out.append((int(entry), fields[0], int(fields[1]), int(fields[2])))
    return out


def left_behind(pgids: list[int], within_s: float = 1.0) -> tuple[list[tuple[int, str, int]], list[int]]:
    """Running members of the given process groups, and unreaped children of this process, after a
    short grace for SIGKILL to land. Zombies already handed to init are not ours to reap."""
    me = os.getpid()
    deadline = time.monotonic() + within_s
    while True:
        stats = _proc_stats()
        live = [(pid, state, pgrp) for pid, state, _, pgrp in stats if pgrp in pgids and state not in "ZX"]
        zombies = [pid for pid, state, ppid, _ in stats if ppid == me and state == "Z"]
        if (not live and not zombies) or time.monotonic() > deadline:
            return live, zombies
        time.sleep(0.02)


PMON_HEADER = (b"# gpu         pid   type     sm    mem    enc    dec    jpg    ofa    command \n"
               b"# Idx           #    C/G      %      %      %      %      %      %    name \n")


def pmon_row(card: int, pid: int | None, kind: str = "C", sm: int | None = None, mem: int | None = None,
             command: str = "-") -> bytes:
    """One row of ``nvidia-smi pmon`` as a 590 driver prints it (tests/fixtures/nvidia-smi-pmon/):
    ``-`` for a value the driver has no sample of, and for every field of a card with no process."""
    def value(v: object) -> str:
        return "-" if v is None else str(v)
    kind = kind if pid is not None else "-"
    return (f"{card:>5}{value(pid):>11}{kind:>6}{value(sm):>7}{value(mem):>7}" + "      -" * 4
            + f"    {command[:15]:<15}\n").encode()


def idle_pmon(xml: bytes) -> bytes:
    """What ``nvidia-smi pmon -c 1`` prints for the cards of a ``-q -x`` report when none of their
    processes computed anything in the sample: a row of ``-`` for each (on a whole card, as the
    idle memhogs of the real H100 capture; on a card in MIG mode, as every process there), a ``-``
    row for a card without one. The header alone where the report cannot be read."""
    rows = [PMON_HEADER]
    try:
        root = ElementTree.fromstring(xml)
    except (ElementTree.ParseError, ValueError):
        return PMON_HEADER
    for card, gpu in enumerate(root.iterfind("gpu")):
        listed = [(p.findtext("pid", ""), p.findtext("type", "C"), p.findtext("process_name", ""))
                  for p in gpu.iterfind("processes/process_info")]
        listed = [(int(pid), kind, os.path.basename(name.strip()))
                  for pid, kind, name in listed if pid.strip().isdigit()]
        rows.extend(pmon_row(card, pid, kind, command=name) for pid, kind, name in listed)
        if not listed:
            rows.append(pmon_row(card, None))
    return b"".join(rows)


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path) -> FakeSmi:
    """Make a fake ``nvidia-smi``: a real executable that prints captured output.

    ``xml``/``listing``: bytes printed for ``-q -x`` and ``-L``.
    ``mode``: ``ok``; ``hang`` (sleeps, with a child of its own, after printing
    part of the output); ``fail`` (prints ``stderr`` and exits ``exit_code``);
    ``garbage`` (prints random bytes); ``flood`` (prints without end);
    ``escape`` (prints the output, then leaves a grandchild that escaped the
    process group: double-forked, in a session of its own (``setsid``), deaf to
    SIGTERM, holding stdout open, sleeping 600 s; exits 0 once the grandchild
    has written its pid to ``escaped.<pid of the run>`` beside the script, see
    ``escaped()``); ``escape-hang`` (the same, then sleeps instead of exiting).
    ``list_mode`` does the same for ``-L`` alone. ``pmon``: bytes printed for
    ``pmon`` (any arguments); by default what a driver prints when every process
    of ``xml`` is idle (``idle_pmon``); ``pmon_mode`` as ``list_mode``. Each call
    is logged to ``calls.log`` beside the script, one line per run.
    """
    counter = iter(range(1000))

    def make(
        xml: bytes = b"",
        listing: bytes = b"",
        mode: str = "ok",
        list_mode: str = "ok",
        stderr: str = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
        exit_code: int = 9,
        delay_s: float = 0.0,
        pmon: bytes | None = None,
        pmon_mode: str = "ok",
    ) -> Path:
        d = tmp_path / f"fake-smi-{next(counter)}"
        d.mkdir()
        (d / "q.xml").write_bytes(xml)
        (d / "L.txt").write_bytes(listing)
        (d / "pmon.txt").write_bytes(idle_pmon(xml) if pmon is None else pmon)
        script = d / "nvidia-smi"

        def action(which: str, what: str) -> str:
            out = shlex.quote(str(d / which))
            # The grandchild writes its pid once it has left the group (setsid), under a
            # name of the run's own; the run waits for that (at most 5 s) before going on.
            pidfile = shlex.quote(str(d / "escaped.")) + "$$"
            grandchild = "trap '' TERM; echo $$ > \"$0.tmp\"; mv \"$0.tmp\" \"$0\"; exec sleep 600"
            escape = (f"cat {out}; ( setsid sh -c {shlex.quote(grandchild)} {pidfile} & ); "
                      f"i=0; while [ ! -e {pidfile} ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i + 1)); done")
            return {
                "ok": f"cat {out}",
                "hang": f"head -c 100 {out}; sleep 600 & sleep 600",
                "fail": f"echo {shlex.quote(stderr)} >&2; exit {exit_code}",
                "garbage": "head -c 4096 /dev/urandom",
                "flood": "yes '<gpu>'",
                "escape": escape,
                "escape-hang": f"{escape}; sleep 600",
            }[what]

        script.write_text(
            "#!/bin/sh\n"
            f"echo \"$$ $*\" >> {shlex.quote(str(d / 'calls.log'))}\n"
            + (f"sleep {delay_s}\n" if delay_s else "")
            + 'case "$1" in\n'
            f"  -q) {action('q.xml', mode)} ;;\n"
            f"  -L) {action('L.txt', list_mode)} ;;\n"
            f"  pmon) {action('pmon.txt', pmon_mode)} ;;\n"
            '  *) echo "fake nvidia-smi: unknown arguments: $*" >&2; exit 2 ;;\n'
            "esac\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return script

    return make


@pytest.fixture
def serve():
    """Start an ``ExporterServer`` in this process, on 127.0.0.1, and give its URL:
    ``serve(source_or_scraper, timeout_s=10.0, offset_s=0.5, prober=None, limits=None)``, the
    scrape and the prober's counters composed as serve composes them (or an ``Exporter`` made by
    the test, served as it is); ``serve.servers`` holds them. Every server started is shut down at
    the end of the test."""
    servers: list[ExporterServer] = []

    def start(source, timeout_s: float = 10.0, offset_s: float = 0.5, prober=None, limits=None) -> str:
        if isinstance(source, Exporter):
            exporter = source
        else:
            scraper = source if isinstance(source, Scraper) else Scraper(source)
            exporter = Exporter(scraper, *([prober] if prober is not None else []), timeout_s=timeout_s)
        server = ExporterServer(("127.0.0.1", 0), exporter, timeout_offset_s=offset_s, prober=prober, limits=limits)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.url

    start.servers = servers  # type: ignore[attr-defined]
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_wrapper(tmp_path: Path) -> Callable[..., Path]:
    """Make a wrapper like ``ssh HOST`` or ``chroot DIR``: ``wrapper ARG... -q -x``
    logs its pid and arguments to ``wrapper.log`` beside it, drops the ``ARG``s
    and runs ``inner`` with the rest as its child (not exec: a wrapper's
    children must be killed with it)."""
    counter = iter(range(1000))

    def make(inner: Path, fixed_args: int) -> Path:
        d = tmp_path / f"wrapper-{next(counter)}"
        d.mkdir()
        script = d / "wrapper"
        script.write_text(
            "#!/bin/sh\n"
            f"echo \"$$ $*\" >> {shlex.quote(str(d / 'wrapper.log'))}\n"
            f"shift {fixed_args}\n"
            f'{shlex.quote(str(inner))} "$@"\n'
        )
        script.chmod(0o755)
        return script

    return make


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def fake_nvml_lib():
    """``fake_nvml_lib(name_or_scenario)`` installs a fake libnvidia-ml beneath pynvml's real
    ctypes layer (tests/fake_nvml.py) until the test ends; a second call replaces the first."""
    from fake_nvml import install_fake_nvml

    installed = []

    def install(scenario):
        for old in installed:
            old.uninstall()
        fake = install_fake_nvml(scenario)
        installed.append(fake)
        return fake

    yield install
    for fake in reversed(installed):
        fake.uninstall()


@pytest.fixture(scope="session")
def fake_libnvml_dir() -> Path:
    """The directory of the C fake libnvidia-ml.so.1 (tests/fake_libnvml/), built once per source
    hash into a private temporary directory; put it on ``LD_LIBRARY_PATH``."""
    from fake_nvml_c import build

    return build()


@pytest.fixture
def fake_libnvml_env(fake_libnvml_dir, tmp_path):
    """``fake_libnvml_env(name_or_scenario, **modes)``: the environment for a process that loads
    the C fake libnvidia-ml serving that scenario (modes: ``hang``, ``grow``, ``clock_file``, ``later``,
    ``wall_clock``; tests/fake_nvml_c.py's scenario_text)."""
    from fake_nvml import SCENARIOS
    from fake_nvml_c import environment, write_scenario

    counter = iter(range(1000))

    def make(scenario, **modes):
        scenario = SCENARIOS[scenario]() if isinstance(scenario, str) else scenario
        path = write_scenario(tmp_path / f"nvml-scenario-{next(counter)}.txt", scenario, **modes)
        return environment(fake_libnvml_dir, path)

    return make


@pytest.fixture(scope="session")
def podresources_pb(tmp_path_factory):
    """The pod-resources messages, compiled from our proto by grpcio-tools."""
    from fake_kubelet import compile_proto

    return compile_proto(tmp_path_factory.mktemp("podresources-pb"))


@pytest.fixture
def fake_kubelet(podresources_pb):
    """Start fake kubelets: ``fake_kubelet(pods)`` serves pod-resources List on
    a unix socket (``.socket_path``) until the test ends."""
    import shutil as _shutil

    from fake_kubelet import FakeKubelet, short_socket_dir

    started = []

    def start(pods=None):
        directory = short_socket_dir()
        kubelet = FakeKubelet(podresources_pb, os.path.join(directory, "kubelet.sock"), pods)
        started.append((kubelet, directory))
        return kubelet

    yield start
    for kubelet, directory in started:
        kubelet.stop()
        _shutil.rmtree(directory, ignore_errors=True)


# --- the 10 000-case fuzz runs: behind --fuzz, which scripts/test adds under CI ---------------

@pytest.fixture(scope="session")
def shared_buildah(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """buildah over a private storage shared by tests/test_container.py and tests/test_release.py,
    so that the image is built once a run (a build is about 40 s); everything in it is removed at
    the end of the run, whether the builds and tests passed or not, and the removal is checked."""
    from buildah_store import Buildah
    store = Buildah(tmp_path_factory.mktemp("buildah"))
    yield store
    store.destroy()


@pytest.fixture(scope="session")
def shared_image(shared_buildah: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The repository's Dockerfile built over the debootstrapped base, once a run."""
    from buildah_store import build_base_image, build_image
    return build_image(shared_buildah, build_base_image(shared_buildah, tmp_path_factory), SHARED_IMAGE)


SHARED_IMAGE = "localhost/mig-exporter:test"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz", action="store_true", default=False,
                     help="also run the tests marked fuzz (10 000 cases each; CI runs them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--fuzz"):
        return
    kept = [item for item in items if item.get_closest_marker("fuzz") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def require_tool(name: str) -> str:
    """The path of a tool the test needs, looked up beside this interpreter first (the
    venv's ``bin``, where pip puts hadolint and kubernetes-validate whatever ``PATH``
    the caller has), then on ``PATH``. A missing tool fails the test, never skips it:
    ``scripts/test`` installs every tool, and a caller who cannot have one leaves its
    group out by name (``./scripts/test --no-container``, ``-m "not container"``)."""
    import shutil as _shutil

    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    path = _shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: ./scripts/test installs it (or leave its group out by marker)",
                    pytrace=False)
    return path


def require_real_corpus() -> Path:
    """The real nvidia-smi corpus in ../shared: its absence fails the test."""
    if not REAL_CORPUS.is_dir():
        pytest.fail(f"the real nvidia-smi corpus is not at {REAL_CORPUS}: check out ../shared beside the "
                    "repository, or set MIG_EXPORTER_REAL_CORPUS", pytrace=False)
    return REAL_CORPUS
