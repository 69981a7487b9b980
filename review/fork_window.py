"""Review of issue 17's NVML name cache (run by hand, as root, where a pids cgroup can be made):
forks that a pids cgroup refuses advance the kernel's pid cursor (alloc_pid comes before
cgroup_can_fork in copy_process) without counting in /proc/stat's ``processes``, so the
cursor can go all the way round while PidSample.window vouches for nearly every pid.

    PYTHONPATH=src python review/fork_window.py   # prints FAIL when a reused pid is vouched for
"""
import os
import sys

from mig_exporter.sources.nvml import PidSample

CG = "/sys/fs/cgroup/pids/review-fork-window"


def last_pid() -> int:
    with open("/proc/sys/kernel/ns_last_pid") as f:
        return int(f.read())


def walk_to(low: int, high: int) -> None:
    """Refused forks, in the pids cgroup, until the cursor lies in [low, high)."""
    helper = os.fork()
    if helper == 0:
        with open(f"{CG}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
        while not (low <= last_pid() < high):
            try:
                c = os.fork()
            except OSError:
                continue
            if c == 0:
                os._exit(0)
            os.waitpid(c, 0)
        os._exit(0)
    os.waitpid(helper, 0)


def main() -> int:
    os.makedirs(CG, exist_ok=True)
    with open(f"{CG}/pids.max", "w") as f:
        f.write("1")
    old = os.fork()  # the GPU process the last read listed and named
    if old == 0:
        os._exit(0)
    os.waitpid(old, 0)  # (it exits after the sample below in real life; here, before)
    earlier = PidSample.now()
    walk_to(old - 40, old - 1)  # all the way round, to just before the old pid
    new = 0
    while new < old:  # ordinary forks until one is handed the old pid (or passes it)
        new = os.fork()
        if new == 0:
            os._exit(0)
        os.waitpid(new, 0)
    walk_to(earlier.last_pid + 2000, earlier.last_pid + 2200)  # the cursor ends just past the first sample
    later = PidSample.now()
    window = earlier.window(later)
    vouched = window is not None and (old in window[0]) == window[1]
    print(f"old pid {old}, then pid {new}; cursor {earlier.last_pid} -> {later.last_pid}; "
          f"forks counted {later.forks_after - earlier.forks_before}; window {window}")
    print("FAIL: the reused pid is vouched for" if new == old and vouched else "ok")
    return 1 if new == old and vouched else 0


if __name__ == "__main__":
    sys.exit(main())
