"""The /proc reader: parsing the kernel's file formats, reading fabricated
trees in those formats and the real /proc, and telling the host's PID
namespace apart from a container's."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from conftest import a_thread
from mig_exporter.host.procfs import (
    HOST_PID_NAMESPACE,
    MAX_FILE_BYTES,
    SETTLE_S,
    PidNamespace,
    ProcError,
    ProcfsSource,
    parse_cmdline,
    parse_exe_link,
    parse_stat,
)
from proc_tree import CONTAINER_NS, Proc, make_proc, stat_line, write_proc

# --- parsing -------------------------------------------------------------------------------------


def test_stat_name_with_spaces_and_parentheses():
    line = stat_line(31337, "my (odd) name) x", "R", 4242, 3).encode()
    assert parse_stat(line) == (31337, "my (odd) name) x", "R", 4242)


def test_stat_of_a_kernel_thread_as_captured():
    # /proc/2/stat on the machine these tests were written on (Linux 6.18).
    line = (b"2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 25 0 0 18446744073709551615 0 0 0 0 0 "
            b"0 0 2147483647 0 1 0 0 0 1 0 0 0 0 0 0 0 0 0 0 0 0 0\n")
    assert parse_stat(line) == (2, "kthreadd", "S", 0)


def test_stat_of_this_process_from_the_real_proc():
    pid, comm, state, ppid = parse_stat(Path("/proc/self/stat").read_bytes())
    assert (pid, ppid) == (os.getpid(), os.getppid())
    assert comm == Path("/proc/self/comm").read_text().rstrip("\n")
    assert state == "R"  # it is reading its own stat


@pytest.mark.parametrize("bad", [b"", b"garbage", b"12 (x", b"(x) S 1", b"12 (x)"])
def test_malformed_stat_is_a_value_error(bad):
    with pytest.raises(ValueError):
        parse_stat(bad)


def test_cmdline_is_nul_separated_and_terminated():
    raw = b"/usr/local/bin/llama-server\0-m\0/models/a b.gguf\0-ngl\0" + b"99\0"
    assert parse_cmdline(raw) == ("/usr/local/bin/llama-server", "-m", "/models/a b.gguf", "-ngl", "99")


def test_cmdline_of_a_kernel_thread_is_empty():
    assert parse_cmdline(b"") == ()


def test_cmdline_rewritten_by_setproctitle_is_one_argument():
    # vLLM's EngineCore after setproctitle: one string, padded.
    assert parse_cmdline(b"VLLM::EngineCore" + b" " * 40) == ("VLLM::EngineCore",)


def test_cmdline_keeps_undecodable_bytes():
    assert parse_cmdline(b"/opt/\xff/llama-server\0-ngl\0") == ("/opt/\udcff/llama-server", "-ngl")


def test_a_replaced_binary_is_still_its_program():
    assert parse_exe_link("/usr/local/bin/llama-server (deleted)") == "/usr/local/bin/llama-server"
    assert parse_exe_link("/usr/bin/python3.12") == "/usr/bin/python3.12"


# --- reading fabricated trees --------------------------------------------------------------------


def tree(tmp_path: Path, namespace: str = HOST_PID_NAMESPACE) -> Path:
    return make_proc(tmp_path / "proc", [
        Proc(48213, "llama-server", ["/usr/local/bin/llama-server", "-m", "/m.gguf", "-ngl", "99"],
             exe="/usr/local/bin/llama-server (deleted)", threads=[48214, 48215]),
        Proc(7001, "python3", ["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "Qwen/Qwen2.5-1.5B"],
             exe=None),  # exe unreadable (EACCES): the name falls back to argv[0]
        Proc(7002, "VLLM::EngineCor", ["VLLM::EngineCore"], ppid=7001, exe="/usr/bin/python3.12"),
        Proc(666, "llama-server", [], state="Z", exe=None),
    ], namespace=namespace)


def test_reads_every_process_with_its_parent_name_exe_and_threads(tmp_path):
    table = ProcfsSource(str(tree(tmp_path))).read()
    assert sorted(table.processes) == [1, 2, 666, 4242, 7001, 7002, 48213]
    llama = table.processes[48213]
    assert (llama.ppid, llama.comm, llama.state) == (1, "llama-server", "S")
    assert llama.exe == "/usr/local/bin/llama-server"
    assert llama.exe_name == "llama-server"
    assert llama.cmdline == ("/usr/local/bin/llama-server", "-m", "/m.gguf", "-ngl", "99")
    assert llama.thread_ids == (48213, 48214, 48215)
    vllm = table.processes[7001]
    assert vllm.exe is None and vllm.exe_name == "python3" and vllm.exe_path == "/usr/bin/python3"
    assert table.processes[7002].ppid == 7001
    assert table.processes[2].cmdline == () and table.processes[2].exe is None
    assert not table.processes[666].alive and llama.alive
    assert table.namespace == PidNamespace(str(tmp_path / "proc"), HOST_PID_NAMESPACE)
    assert table.namespace.is_host


def test_a_process_that_exits_mid_read_is_skipped(tmp_path):
    root = tree(tmp_path)
    (root / "7002" / "stat").unlink()  # gone between listing and reading its stat
    (root / "48213" / "cmdline").unlink()  # gone between its stat and its cmdline
    shutil.rmtree(root / "7001" / "task")  # gone before its threads were listed
    table = ProcfsSource(str(root)).read()
    assert 7002 not in table.processes
    assert 48213 not in table.processes
    assert table.processes[7001].thread_ids == (7001,)


def test_a_long_command_line_is_read_whole_and_a_huge_one_only_up_to_the_cap(tmp_path):
    """A vLLM started with a long JSON config: longer than one read; a cmdline past
    MAX_FILE_BYTES (a process rewriting its own) is cut there, never buffered whole."""
    config = "--override-generation-config=" + "x" * 40_000
    root = make_proc(tmp_path / "proc", [
        Proc(7001, "python3", ["python3", "-m", "vllm.entrypoints.openai.api_server", config]),
        Proc(7002, "python3", ["python3", "y" * (MAX_FILE_BYTES + 5000)]),
    ])
    table = ProcfsSource(str(root)).read()
    assert table.processes[7001].cmdline == ("python3", "-m", "vllm.entrypoints.openai.api_server", config)
    huge = table.processes[7002].cmdline
    assert huge[0] == "python3" and len(huge[1]) == MAX_FILE_BYTES - len("python3") - 1


def test_an_unreadable_stat_is_skipped(tmp_path):
    root = tree(tmp_path)
    (root / "7001" / "stat").write_bytes(b"not a stat line")
    assert 7001 not in ProcfsSource(str(root)).read().processes


def test_a_missing_root_is_a_proc_error(tmp_path):
    with pytest.raises(ProcError, match=r"cannot read .*/nowhere: No such file or directory"):
        ProcfsSource(str(tmp_path / "nowhere")).read()


# --- the PID namespace ---------------------------------------------------------------------------


def test_a_container_namespace_is_not_the_host(tmp_path):
    namespace = ProcfsSource(str(tree(tmp_path, CONTAINER_NS))).read_namespace()
    assert namespace.own == CONTAINER_NS
    assert not namespace.is_host
    assert "pid:[4026532513], not the host's pid:[4026531836]" in namespace.reason()
    assert "hostPID: true" in namespace.reason()


def test_a_root_we_are_not_visible_in_is_not_the_host(tmp_path):
    root = tree(tmp_path)
    (root / "self").unlink()  # a /proc of a namespace we are not in: self resolves to nothing
    namespace = ProcfsSource(str(root)).read_namespace()
    assert namespace.own is None and not namespace.is_host
    assert namespace.reason().startswith(f"cannot read {root}/self/ns/pid")


def test_the_real_proc_namespace_is_the_one_the_kernel_shows():
    namespace = ProcfsSource("/proc").read_namespace()
    assert namespace.own == os.readlink("/proc/self/ns/pid")
    assert namespace.is_host == (os.readlink("/proc/self/ns/pid") == "pid:[4026531836]")


# --- the real /proc ------------------------------------------------------------------------------


def test_reads_this_process_and_its_threads_from_the_real_proc():
    with a_thread() as tid:
        table = ProcfsSource("/proc").read()
    me = table.processes[os.getpid()]
    assert me.ppid == os.getppid()
    assert me.exe == os.path.realpath(f"/proc/{os.getpid()}/exe")
    assert me.cmdline == tuple(Path("/proc/self/cmdline").read_bytes().decode().split("\0")[:-1])
    assert os.getpid() in me.thread_ids and tid in me.thread_ids
    assert table.processes[os.getppid()].pid == os.getppid()


def test_a_thread_s_id_is_not_listed_but_located_by_its_own_directory_s_inode():
    """The listing holds thread group leaders only; ``inodes`` finds a thread's /proc/TID (not its
    leader's, nor /proc/PID/task/TID's) and nothing for a pid that is not there."""
    source = ProcfsSource("/proc")
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have it
    with a_thread() as tid:
        assert tid not in source.listing()
        found = source.inodes([tid, gone, os.getpid()])
        assert found == {tid: os.stat(f"/proc/{tid}").st_ino, os.getpid(): source.listing()[os.getpid()]}
        assert found[tid] != os.stat(f"/proc/{os.getpid()}/task/{tid}").st_ino
    assert source.inodes([gone]) == {}


# --- reading again: only what may have changed ------------------------------------------------------

def _engine(p) -> bool:
    return p.comm.startswith("engine")


def _source(root: Path, settle_s: float = SETTLE_S) -> ProcfsSource:
    source = ProcfsSource(str(root), settle_s)
    source.watch(_engine)
    return source


def _exit(root: Path, pid: int) -> None:
    """The process is gone. Its directory is kept elsewhere, not deleted, so that this
    filesystem cannot hand its inode number to the next directory made (the kernel's /proc
    draws each from a counter): a new process under the same pid gets a new one, as in /proc."""
    graveyard = root.parent / "gone"
    graveyard.mkdir(exist_ok=True)
    os.rename(root / str(pid), graveyard / f"{pid}.{len(os.listdir(graveyard))}")


def _rewrite(root: Path, p: Proc) -> None:
    """The same process, changed (re-parented, exec'd, threads come and go): same directory."""
    d = root / str(p.pid)
    (d / "stat").write_text(stat_line(p.pid, p.comm, p.state, p.ppid, 1 + len(p.threads), p.start_ticks))
    (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in p.cmdline))
    shutil.rmtree(d / "task")
    for tid in [p.pid, *p.threads]:
        (d / "task" / str(tid)).mkdir(parents=True)


def test_a_reused_pid_is_read_as_the_new_process(tmp_path):
    root = make_proc(tmp_path / "proc", [Proc(500, "bash", ["bash"], threads=[501])])
    source = _source(root)
    assert source.read().processes[500].comm == "bash"
    _exit(root, 500)
    write_proc(root, Proc(500, "llama-server", ["llama-server", "-m", "x.gguf"], ppid=4242, threads=[502]))
    table = source.read()
    assert (table.processes[500].comm, table.processes[500].ppid) == ("llama-server", 4242)
    assert table.processes[500].thread_ids == (500, 502)


def test_a_known_process_is_not_read_again_unless_its_parent_died(tmp_path):
    """An old process's files are not opened again at the next read (only in its turn, below):
    what it changes (an exec, threads) is not seen yet; its parent dying (it is re-parented) is."""
    root = make_proc(tmp_path / "proc", [Proc(500, "sh", ["sh", "run.sh"]),
                                         Proc(600, "worker", ["worker"], ppid=500, threads=[601])])
    source = _source(root)
    first = source.read()
    _rewrite(root, Proc(600, "worker2", ["worker2"], ppid=500, threads=[601, 602]))
    assert source.read() == first
    _exit(root, 500)
    _rewrite(root, Proc(600, "worker2", ["worker2"], ppid=1, threads=[601, 602]))
    table = source.read()
    assert 500 not in table.processes
    assert table.processes[600] == ProcfsSource(str(root)).read().processes[600]
    assert table.processes[600].ppid == 1


def test_every_old_process_is_read_again_in_its_turn(tmp_path):
    """Each read reads again the old processes whose pid is its number modulo revisit_reads: an
    exec (into an engine or not) or a thread started by any of them is seen within that many
    reads, whatever its pid."""
    old = [Proc(pid, "sh", ["sh", "-c", "download && exec engine"], ppid=1, threads=[pid + 50])
           for pid in range(300, 320)]
    root = make_proc(tmp_path / "proc", old)
    source = ProcfsSource(str(root), revisit_reads=4)
    source.watch(_engine)
    source.read()
    for p in old:
        _rewrite(root, Proc(p.pid, "engine" if p.pid % 2 else "python3", ["x"], ppid=1, threads=[p.pid + 60]))
    fresh = _source(root).read()
    reads = [source.read() for _ in range(4)]
    assert reads[0] != fresh  # not all at once
    assert reads[-1] == fresh


def test_a_young_process_is_read_again_and_so_is_everything_under_an_engine(tmp_path):
    """A wrapper that execs into an engine soon after it starts is seen as the engine; an engine's
    tree (its workers, their threads, a worker turned zombie) is read at every read."""
    boot_ticks = 86400 * 100
    root = make_proc(tmp_path / "proc", [
        Proc(500, "entrypoint.sh", ["sh", "entrypoint.sh"], start_ticks=boot_ticks - 500),  # 5 s old
        Proc(700, "engine", ["engine"], start_ticks=1000),
        Proc(701, "worker", ["worker"], ppid=700, start_ticks=1001),
    ])
    source = _source(root)
    source.read()
    _rewrite(root, Proc(500, "engine-server", ["engine-server"], start_ticks=boot_ticks - 500))
    _rewrite(root, Proc(701, "worker", ["worker"], ppid=700, state="Z", threads=[702], start_ticks=1001))
    table = source.read()
    assert table.processes[500].comm == "engine-server"
    assert (table.processes[701].state, table.processes[701].thread_ids) == ("Z", (701, 702))
    assert table == _source(root).read()


@pytest.mark.parametrize("seed", range(12))
def test_read_again_after_churn_is_the_same_as_a_fresh_read(tmp_path, seed):
    """Random trees, and between reads: processes start (some under others, some young, some
    engines), exit (their children go to init), their pids are reused, and engines' trees
    change their threads, states and command lines. The kept read equals a fresh one."""
    rng = random.Random(seed)
    procs: dict[int, Proc] = {}
    next_pid = iter(range(1000, 100000, 7))

    def born(ppid: int | None = None) -> Proc:
        ppid = rng.choice([1, *procs]) if ppid is None else ppid
        engine = rng.random() < 0.15
        # Young (3 s) or old, never older than its parent.
        started = max(rng.choice([1000, 86400 * 100 - 300]), procs[ppid].start_ticks if ppid in procs else 0)
        return Proc(next(next_pid), "engine" if engine else rng.choice(["bash", "python3", "sshd"]),
                    [rng.choice(["a", "b"]), str(rng.randrange(100))], ppid=ppid,
                    threads=[next(next_pid) for _ in range(rng.randrange(3))], start_ticks=started)

    for _ in range(30):
        p = born()
        procs[p.pid] = p
    root = make_proc(tmp_path / "proc", list(procs.values()))
    source = _source(root)
    for _ in range(6):
        assert source.read() == _source(root).read()
        for _ in range(rng.randrange(1, 6)):
            p = born()
            procs[p.pid] = p
            write_proc(root, p)
        for pid in rng.sample(sorted(procs), 3):
            if pid not in procs:
                continue
            gone = procs.pop(pid)
            _exit(root, pid)
            for child in [c for c in procs.values() if c.ppid == pid]:
                child.ppid = 1
                _rewrite(root, child)
            if rng.random() < 0.5:  # the pid comes back as another process
                again = born()
                again.pid = gone.pid
                procs[again.pid] = again
                write_proc(root, again)
        for p in procs.values():  # young ones exec: a wrapper into its engine, or the other way
            if p.start_ticks > 1000 and rng.random() < 0.2:
                p.comm, p.cmdline = rng.choice([("python3", ["python3", "-c", "x"]), ("engine", ["engine"])])
                _rewrite(root, p)
        for pid in sorted(_under_engines(procs)):
            p = procs[pid]
            p.threads = [next(next_pid) for _ in range(rng.randrange(3))]
            p.state = rng.choice(["S", "R", "Z"])
            if p.comm != "engine":
                p.comm, p.cmdline = rng.choice([("python3", ["python3", "-c", "x"]), ("engine", ["engine"])])
            _rewrite(root, p)
    assert source.read() == _source(root).read()


def _under_engines(procs: dict[int, Proc]) -> set[int]:
    """The engines and every process under one."""
    def under(pid: int, seen: frozenset[int] = frozenset()) -> bool:
        p = procs.get(pid)
        return p is not None and pid not in seen and (_engine(p) or under(p.ppid, seen | {pid}))
    return {pid for pid in procs if under(pid)}


def test_a_wrapper_that_became_an_engine_keeps_its_workers_read_once_they_are_old(tmp_path):
    boot_ticks = 86400 * 100
    root = make_proc(tmp_path / "proc", [
        Proc(500, "entrypoint.sh", ["sh", "entrypoint.sh"], start_ticks=boot_ticks - 500),
        Proc(501, "worker", ["worker"], ppid=500, start_ticks=boot_ticks - 400),
    ])
    source = _source(root)
    source.read()
    _rewrite(root, Proc(500, "engine", ["engine"], start_ticks=boot_ticks - 500))  # exec'd, 5 s in
    source.read()
    (root / "uptime").write_text(f"{86400 + SETTLE_S + 10:.2f} 0.00\n")  # both old now
    _rewrite(root, Proc(501, "worker", ["worker"], ppid=500, threads=[502], start_ticks=boot_ticks - 400))
    assert source.read().processes[501].thread_ids == (501, 502)
