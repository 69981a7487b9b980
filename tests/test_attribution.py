"""Attributing GPU memory to engine processes: a fabricated /proc tree, read
by the real reader, against the GPU lists of the demo and fixture scenarios."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path

from conftest import MIB, scenario
from mig_exporter.config.engines import parse_engines
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import CommandNotFound
from mig_exporter.engines.attribution import EngineReader, engine_reading
from mig_exporter.engines.rules import DEFAULT_SETTINGS
from mig_exporter.host.procfs import REVISIT_READS, ProcfsSource
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.readings import EngineProcess, EngineReading
from mig_exporter.sources.demo import DemoProcs, DemoSource
from proc_tree import CONTAINER_NS, Proc, make_proc, write_proc

LLAMA = ["/usr/local/bin/llama-server", "-m", "/models/q.gguf", "-ngl", "99"]
ENGINES = DEFAULT_SETTINGS.engines


def demo_gpu():
    """The demo's GPU lists: 48213 on 1000 (11520 MiB), 51877 on 1001 (9216 MiB),
    50102 (type G, 20480 MiB) and 50318 (1620 MiB) on card 1."""
    return DemoSource().read()


def read(root: Path, snapshot, settings=DEFAULT_SETTINGS) -> EngineReading:
    watch = EngineReader(settings, ProcfsSource(str(root)))
    return watch.reading(*watch.read_procs(), snapshot)


def test_memory_of_the_pid_its_threads_and_its_descendants(tmp_path):
    root = make_proc(tmp_path / "proc", [
        Proc(48213, "llama-server", LLAMA, exe="/usr/local/bin/llama-server"),  # on 1000 itself
        Proc(50300, "llama-server", LLAMA, threads=[50318]),  # a thread of it is on card 1
        Proc(51860, "vllm", ["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "Qwen/Qwen2.5-1.5B-Instruct"]),
        Proc(51877, "VLLM::EngineCor", ["VLLM::EngineCore"], ppid=51860),  # its child holds the model
        Proc(52040, "llama-server", LLAMA),  # on no list: on the CPU
        Proc(60000, "python3", ["/usr/bin/python3", "train.py"]),  # not an engine
    ])
    assert read(root, demo_gpu()) == EngineReading(
        engines=ENGINES,
        host_pid_namespace=True,
        processes=(
            EngineProcess("llama.cpp", 48213, "llama-server", 11520 * MIB, (1000,)),
            EngineProcess("llama.cpp", 50300, "llama-server", 1620 * MIB, (1,)),
            EngineProcess("llama.cpp", 52040, "llama-server", 0, ()),
            EngineProcess("vllm", 51860, "vllm", 9216 * MIB, (1001,)),
        ),
        placed=True,
    )


def test_a_matched_descendant_is_folded_into_the_top_most_engine(tmp_path):
    """TGI's launcher starts shards that match too: one engine, holding what
    both shards hold on two devices, not three engines."""
    server = ["/opt/conda/bin/python3.11", "/opt/conda/bin/text-generation-server", "serve", "m"]
    root = make_proc(tmp_path / "proc", [
        Proc(9000, "text-generation", ["text-generation-launcher", "--model-id", "m", "--num-shard", "2"],
             exe="/usr/local/bin/text-generation-launcher"),
        Proc(48213, "text-generation", server, ppid=9000),
        Proc(50102, "text-generation", server, ppid=9000),
        Proc(50500, "llama-server", LLAMA, ppid=50102),  # a matched grandchild of another engine
    ])
    reading = read(root, demo_gpu())
    assert reading.processes == (EngineProcess("tgi", 9000, "text-generation", (11520 + 20480) * MIB, (1, 1000)),)


def test_zombies_are_not_engines(tmp_path):
    root = make_proc(tmp_path / "proc", [
        Proc(48213, "llama-server", LLAMA),
        Proc(52040, "llama-server", [], state="Z"),
    ])
    assert [e.pid for e in read(root, demo_gpu()).processes] == [48213]


def test_a_failed_gpu_read_still_counts_engines_but_places_none(tmp_path):
    root = make_proc(tmp_path / "proc", [Proc(48213, "llama-server", LLAMA)])
    assert read(root, None) == EngineReading(
        ENGINES, True, (EngineProcess("llama.cpp", 48213, "llama-server", None, ()),), placed=False)


def test_memory_the_driver_does_not_know_is_unknown_not_zero(tmp_path):
    # na-memory: pids 4242 (C) and 4243 (G) on card 0, used memory N/A.
    root = make_proc(tmp_path / "proc", [Proc(4243, "llama-server", LLAMA)], self_pid=4000)
    reading = read(root, scenario("na-memory"))
    assert reading.processes == (EngineProcess("llama.cpp", 4243, "llama-server", None, (0,)),)


def test_outside_the_host_namespace_no_engine_is_reported(tmp_path):
    root = make_proc(tmp_path / "proc", [Proc(52040, "llama-server", LLAMA)], namespace=CONTAINER_NS)
    reading = read(root, demo_gpu())
    assert (reading.host_pid_namespace, reading.processes, reading.placed) == (False, None, True)
    assert len(reading.problems) == 1
    assert "is pid:[4026532513], not the host's pid:[4026531836]" in reading.problems[0]


def test_an_unreadable_proc_leaves_everything_out(tmp_path):
    reading = read(tmp_path / "missing", demo_gpu())
    assert reading == EngineReading(ENGINES, None, None, True, (f"cannot read {tmp_path}/missing: "
                                                                 "No such file or directory",))


def test_with_no_engine_switched_on_only_the_namespace_is_read(tmp_path):
    settings, _ = parse_engines({"presets": False})
    root = make_proc(tmp_path / "proc", [Proc(52040, "llama-server", LLAMA)])
    assert read(root, demo_gpu(), settings) == EngineReading((), True, None, True)


def test_a_driver_listing_none_of_our_pids_leaves_engines_out(tmp_path):
    """The driver lists 21180, 21181 and 21198; this /proc has none of them."""
    root = make_proc(tmp_path / "proc", [Proc(52040, "llama-server", LLAMA)])
    reading = read(root, scenario("h100-mig-processes"))
    assert (reading.host_pid_namespace, reading.processes) == (True, None)
    assert reading.problems == (
        f"none of the 3 process(es) the driver lists (pid 21180, 21181, 21198) is in {root}; "
        "engine metrics are left out of this read",)


def test_a_driver_listing_no_process_is_no_mismatch(tmp_path):
    """No process on any GPU is the plain case of every engine on the CPU."""
    root = make_proc(tmp_path / "proc", [Proc(52040, "llama-server", LLAMA)])
    idle = replace(scenario("a100-mig-nothing-carved"), processes=())
    assert read(root, idle).processes == (EngineProcess("llama.cpp", 52040, "llama-server", 0, ()),)


def test_the_demo_host():
    watch = EngineReader(DEFAULT_SETTINGS, DemoProcs())
    assert engine_reading(DEFAULT_SETTINGS, *watch.read_procs(), demo_gpu()).processes == (
        EngineProcess("llama.cpp", 48213, "llama-server", 11520 * MIB, (1000,)),
        EngineProcess("llama.cpp", 50102, "llama-server", 20480 * MIB, (1,)),
        EngineProcess("llama.cpp", 52040, "llama-server", 0, ()),
        EngineProcess("vllm", 51860, "vllm", 9216 * MIB, (1001,)),
    )


def test_an_unreadable_proc_with_no_engine_is_no_problem_and_no_namespace(tmp_path):
    settings, _ = parse_engines({"presets": False})
    assert read(tmp_path / "missing", demo_gpu(), settings) == EngineReading((), None, None, True)


# --- /proc is read alongside the GPUs ----------------------------------------------------------------

class _Meet:
    """The GPU read and the /proc read, each waiting (a while) for the other to have begun:
    both see the other only if they run at the same time."""

    def __init__(self) -> None:
        self.gpu_began, self.procs_began = threading.Event(), threading.Event()
        self.met: list[str] = []

    def source(self) -> DemoSource:
        meet = self

        class Gpu(DemoSource):
            def read(self, deadline=None):
                meet.gpu_began.set()
                if meet.procs_began.wait(5):
                    meet.met.append("gpu saw procs")
                return super().read(deadline)

        return Gpu()

    def procs(self) -> DemoProcs:
        meet = self

        class Procs(DemoProcs):
            def read(self):
                meet.procs_began.set()
                if meet.gpu_began.wait(5):
                    meet.met.append("procs saw gpu")
                return super().read()

        return Procs()


def test_proc_is_read_while_the_gpus_are():
    meet = _Meet()
    scraper = Scraper(meet.source(), EngineReader(DEFAULT_SETTINGS, meet.procs()))
    started = time.monotonic()
    outcome, _ = scraper.scrape(Deadline.after(20))
    assert sorted(meet.met) == ["gpu saw procs", "procs saw gpu"]
    assert time.monotonic() - started < 4  # neither waited its 5 s out
    assert outcome.success and outcome.engines is not None and outcome.engines.processes


class _Telling(DemoSource):
    """A read that starts commands: it says when they run (``started``), as nvidia-smi's does,
    after ``start_s`` (or never, ``start_s`` None), then waits (a while) for /proc to be read."""

    tells_start = True

    def __init__(self, start_s: float | None, events: list[str], procs_began: threading.Event) -> None:
        self.start_s, self.events, self.procs_began = start_s, events, procs_began

    def read(self, deadline=None, started=None):
        if self.start_s is None:
            self.procs_began.wait(5)
        else:
            time.sleep(self.start_s)
            self.events.append("commands started")
            started()
            self.procs_began.wait(5)
        self.events.append("gpu read done" if self.procs_began.is_set() else "gpu read done alone")
        return super().read(deadline)


def _procs_of(events: list[str], procs_began: threading.Event) -> DemoProcs:
    class Procs(DemoProcs):
        def read(self):
            events.append("procs read")
            procs_began.set()
            return super().read()

    return Procs()


def test_proc_is_read_once_the_gpu_reads_commands_run():
    """Issue 17: the /proc read holds the interpreter. Begun with the GPU read it held up
    nvidia-smi's start: 2.9 ms more a scrape behind a 5000-process /proc (benchmarks/procscan.py).
    It begins once the read says its commands run, and still while the GPU read goes on."""
    events: list[str] = []
    began = threading.Event()
    scraper = Scraper(_Telling(0.05, events, began), EngineReader(DEFAULT_SETTINGS, _procs_of(events, began)))
    outcome, _ = scraper.scrape(Deadline.after(20))
    assert events == ["commands started", "procs read", "gpu read done"]
    assert outcome.success and outcome.engines is not None and outcome.engines.processes


def test_proc_is_read_all_the_same_when_the_commands_never_say_they_run():
    """A start that hangs (an exec on a dead mount) must not keep the engines from being read."""
    events: list[str] = []
    began = threading.Event()
    scraper = Scraper(_Telling(None, events, began), EngineReader(DEFAULT_SETTINGS, _procs_of(events, began)))
    started = time.monotonic()
    outcome, _ = scraper.scrape(Deadline.after(20))
    assert events == ["procs read", "gpu read done"]
    assert time.monotonic() - started < 4  # the /proc read waited its 0.1 s, not the read's 5
    assert outcome.engines is not None and outcome.engines.processes


def test_a_read_that_fails_before_its_commands_run_lets_the_proc_read_go_on_at_once(monkeypatch):
    """Review (issue 17): a read that says when its commands run but fails before (nvidia-smi not
    found) must not leave the /proc read waiting for that word until the scrape's deadline."""
    import mig_exporter.metrics.scrape as scrape_module

    monkeypatch.setattr(scrape_module, "_WAIT_FOR_GPU_S", 60.0)  # only the failure may release it

    class Missing(DemoSource):
        tells_start = True

        def read(self, deadline=None, started=None):
            raise CommandNotFound("/nonexistent/nvidia-smi: no such file")

    scraper = Scraper(Missing(), EngineReader(DEFAULT_SETTINGS, DemoProcs()))
    outcome, _ = scraper.scrape(Deadline.after(20))
    assert not outcome.success and outcome.error == "/nonexistent/nvidia-smi: no such file"
    assert outcome.engines is not None and outcome.engines.problems == ()
    assert [e.pid for e in outcome.engines.processes] == [e.pid for e in read_demo().processes]


def test_what_proc_alone_says_of_the_engines_is_made_beside_the_gpu_read(monkeypatch):
    """Issue 17: the top-most engines and their trees' ids need no GPU: they are made in the /proc
    read's worker, and only their sums over the GPU lists wait for the GPUs (on 5000 processes the
    whole attribution added 1.4 ms to the scrape's critical path; 0 now)."""
    import mig_exporter.metrics.scrape as scrape_module
    threads: dict[str, str] = {}
    real_trees, real_sums = EngineReader.trees, scrape_module.engines_on_gpus

    def trees(self, table, error):
        threads["trees"] = threading.current_thread().name
        return real_trees(self, table, error)

    def sums(trees, snapshot):
        threads["sums"] = threading.current_thread().name
        return real_sums(trees, snapshot)

    monkeypatch.setattr(EngineReader, "trees", trees)
    monkeypatch.setattr(scrape_module, "engines_on_gpus", sums)
    scraper = Scraper(DemoSource(), EngineReader(DEFAULT_SETTINGS, DemoProcs()))
    outcome, _ = scraper.scrape(Deadline.after(20))
    here = threading.current_thread().name
    assert threads["sums"] == here and threads["trees"] != here
    assert [e.pid for e in outcome.engines.processes] == [e.pid for e in read_demo().processes]


def read_demo() -> EngineReading:
    reader = EngineReader(DEFAULT_SETTINGS, DemoProcs())
    return reader.reading(*reader.read_procs(), demo_gpu())


def test_a_hung_proc_read_costs_the_engines_not_the_deadline():
    release = threading.Event()

    class Hung(DemoProcs):
        def read(self):
            release.wait(30)
            return super().read()

    scraper = Scraper(DemoSource(), EngineReader(DEFAULT_SETTINGS, Hung()))
    try:
        started = time.monotonic()
        outcome, families = scraper.scrape(Deadline.after(0.5))
        took = time.monotonic() - started
    finally:
        release.set()
    assert took < 2
    assert outcome.success and outcome.snapshot is not None
    assert outcome.engines is not None
    assert outcome.engines.problems == ("reading processes took longer than the scrape's budget",)
    problems = [s.value for f in families for s in f.samples if s.name == "mig_exporter_read_problems"]
    assert problems == [1]  # and the GPUs answered: the rest of the scrape is there


def test_a_process_not_read_again_is_not_matched_again(tmp_path, monkeypatch):
    """What an unchanged process matched is kept (a match is ~10 µs: 50 ms a scrape on a node of
    5 000), also when it is read again (the engines' trees at every read, the old processes in
    their turn); new processes and changed ones are matched afresh."""
    from mig_exporter.engines.rules import EngineSettings

    matched: list[int] = []
    real = EngineSettings.match
    monkeypatch.setattr(EngineSettings, "match", lambda self, p: matched.append(p.pid) or real(self, p))
    root = make_proc(tmp_path / "proc", [
        Proc(48213, "llama-server", LLAMA, exe="/usr/local/bin/llama-server"),
        Proc(48300, "llama-server", LLAMA, ppid=48213),  # folded into 48213
        Proc(60000, "python3", ["/usr/bin/python3", "train.py"]),
    ])
    reader = EngineReader(DEFAULT_SETTINGS, ProcfsSource(str(root)))
    first = reader.reading(*reader.read_procs(), demo_gpu())
    matched.clear()
    again = reader.reading(*reader.read_procs(), demo_gpu())
    assert again == first and [e.pid for e in again.processes] == [48213]
    assert matched == []  # 48213 and 48300 read again (an engine's tree), and init in its turn: unchanged
    write_proc(root, Proc(60001, "llama-server", LLAMA))
    (root / "48300" / "task" / "48301").mkdir()  # a thread starts: 48300 has changed
    matched.clear()
    third = reader.reading(*reader.read_procs(), demo_gpu())
    assert sorted(set(matched)) == [48300, 60001]
    assert [e.pid for e in third.processes] == [48213, 60001]


def test_new_settings_match_afresh(tmp_path):
    """A config reload sets new settings: what the old ones matched (or not) is not kept."""
    root = make_proc(tmp_path / "proc", [Proc(52040, "llama-server", LLAMA),
                                         Proc(48213, "python3", ["python3"])])  # on the GPU: our pids
    none, _ = parse_engines({"presets": False})
    reader = EngineReader(none, ProcfsSource(str(root)))
    assert reader.reading(*reader.read_procs(), demo_gpu()).processes is None
    reader.settings = DEFAULT_SETTINGS
    assert [e.pid for e in reader.reading(*reader.read_procs(), demo_gpu()).processes] == [52040]
    reader.settings = none
    assert reader.reading(*reader.read_procs(), demo_gpu()).processes is None


def test_an_entrypoint_that_execs_into_its_engine_after_a_long_download_is_that_engine(tmp_path):
    """Review (issue 17): `sh -c "huggingface-cli download ... && exec llama-server ..."`, the usual
    container entrypoint, execs into the engine once the model is down, minutes after it started.
    Read fresh at each scrape (as before the /proc cache), pid 48213 is the llama.cpp engine
    holding its 11520 MiB on 1000 from the next read. The cache reads an old process again in
    turn, once every REVISIT_READS reads: it is the engine within as many reads, and stays one."""
    from proc_tree import stat_line

    ticks = os.sysconf("SC_CLK_TCK")
    started = (86400 - 3600) * ticks  # an hour before the reads: past SETTLE_S
    entry = ["/bin/sh", "-c", "huggingface-cli download m && exec llama-server -m /models/q.gguf -ngl 99"]
    root = make_proc(tmp_path / "proc", [Proc(48213, "sh", entry, exe="/bin/sh", start_ticks=started)])
    reader = EngineReader(DEFAULT_SETTINGS, ProcfsSource(str(root)))
    assert reader.reading(*reader.read_procs(), demo_gpu()).processes == ()
    d = root / "48213"  # the exec: same process, same /proc/PID, new name, command line and executable
    (d / "stat").write_text(stat_line(48213, "llama-server", "S", 1, 1, started))
    (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in LLAMA))
    (d / "exe").unlink()
    os.symlink("/usr/local/bin/llama-server", d / "exe")
    engine = (EngineProcess("llama.cpp", 48213, "llama-server", 11520 * MIB, (1000,)),)
    assert read(root, demo_gpu()).processes == engine  # a fresh reader sees it
    seen = [reader.reading(*reader.read_procs(), demo_gpu()).processes for _ in range(REVISIT_READS + 2)]
    assert seen[REVISIT_READS - 1:] == [engine] * 3


def test_a_proc_read_hung_for_good_holds_one_thread_not_one_per_scrape(tmp_path):
    """Review (issue 17): a /proc file that blocks for good (a process stuck in D state holding its
    mmap lock blocks reads of its cmdline; here a FIFO nobody writes). Before the /proc read moved
    to a worker, the hung read held the scrape's flight and later scrapes joined it; now each
    scrape starts a read of its own in a new worker, which hangs on the same file: the threads
    grow by one a scrape, without bound."""
    from mig_exporter.core.workers import WORKERS

    root = make_proc(tmp_path / "proc", [Proc(48213, "llama-server", LLAMA, exe="/usr/local/bin/llama-server")])
    scraper = Scraper(DemoSource(), EngineReader(DEFAULT_SETTINGS, ProcfsSource(str(root))))
    assert scraper.scrape(Deadline.after(5))[0].success  # the first, cold read: every process, inline
    write_proc(root, Proc(50000, "stuck", ["stuck"]))
    (root / "50000" / "cmdline").unlink()
    os.mkfifo(root / "50000" / "cmdline")
    hung = []
    try:
        before = WORKERS.threads
        for _ in range(6):
            outcome, _ = scraper.scrape(Deadline.after(0.2))
            assert outcome.success  # the GPUs still answer
        hung = [t for t in threading.enumerate() if t.name == "mig-exporter-procs"]
        assert WORKERS.threads - before <= 1 and len(hung) <= 1
    finally:
        for _ in range(len(hung) + 8):  # a writer at a time lets each blocked open through
            fd = os.open(root / "50000" / "cmdline", os.O_RDWR | os.O_NONBLOCK)
            time.sleep(0.05)
            os.close(fd)


def test_an_engine_listed_nowhere_is_unknown_while_a_process_list_is_hidden(tmp_path):
    """A device whose process list is not whole may hold the engine: it is then neither on a
    GPU nor "on no GPU" (EngineHoldsNoGPUMemory reads 0 only). With every list whole, 0."""
    root = make_proc(tmp_path / "proc", [Proc(52040, "llama-server", LLAMA), Proc(48213, "llama-server", LLAMA)])
    demo = demo_gpu()
    assert read(root, demo).processes == (EngineProcess("llama.cpp", 48213, "llama-server", 11520 * MIB, (1000,)),
                                          EngineProcess("llama.cpp", 52040, "llama-server", 0, ()))
    unlisted = replace(demo, devices=tuple(replace(d, processes_known=d.index != 1002) for d in demo.devices))
    assert read(root, unlisted).processes == (
        EngineProcess("llama.cpp", 48213, "llama-server", 11520 * MIB, (1000,)),
        EngineProcess("llama.cpp", 52040, "llama-server", None, ()))
    denied = replace(demo, cards=tuple(replace(c, aggregate_denied=c.index == 0) for c in demo.cards))
    assert read(root, denied).processes[1] == EngineProcess("llama.cpp", 52040, "llama-server", None, ())
