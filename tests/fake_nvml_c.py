"""The fake libnvidia-ml.so.1 in C (tests/fake_libnvml/): built here, and its scenario files.

``build()`` compiles tests/fake_libnvml/fake_libnvml.c with the system's gcc into a private
temporary directory, once per source hash (never into the repository), and returns the
directory to put on ``LD_LIBRARY_PATH``: a process started with it loads ours where it asks for
``libnvidia-ml.so.1``, as pynvml does. ``write_scenario()`` writes what the library serves from
a ``FakeNvmlScenario`` of tests/fake_nvml.py, the Python fake's own scenarios, so the two fakes
answer from one description; ``environment()`` is the environment a process needs for both.

Two error modes exist only here, where a real shared library is needed to show them:
``hang=("nvmlDeviceGetPowerUsage", 3)`` (that call answers 3 times, then never returns) and
``grow={(0, 2): 50}`` (the compute list of card 0's MIG slot 2, ``None`` for the card itself,
gains 50 entries once it was sized once: a list that grew between pynvml's sizing call and its
read). Needs no pytest: the benchmarks import it too.

GPM's counters count by the library's fake clock: ``CLOCK_MONOTONIC`` (the Python fake's
``time.monotonic``) unless the scenario names a file, ``clock_file=path``, whose number (seconds)
is the clock at each sample, and which ``set_clock(path, seconds)`` writes; a process that
loaded the library may also hold it with its ``fakeNvmlSetClock(double)``. ``later=((30.0,
scenario_b),)`` gives the activity scripts of ``scenario_b`` from 30 s on, as the Python fake's
``set_scenario`` does at that time (only the scripts: cards and GPU instances stay as they are).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from fake_nvml import (
    GPM_PERCENT_METRICS,
    FakeCard,
    FakeMemory,
    FakeMig,
    FakeNvmlScenario,
    FakeProcess,
    field_answers,
)

SOURCE_DIR = Path(__file__).resolve().parent / "fake_libnvml"
SONAME = "libnvidia-ml.so.1"
SCENARIO_VARIABLE = "FAKE_NVML_SCENARIO"
CFLAGS = ("-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-pthread",
          "-fvisibility=hidden", f"-Wl,-soname,{SONAME}")
_LISTS = (("C", "compute_processes"), ("G", "graphics_processes"), ("M", "mps_processes"))


class BuildError(RuntimeError):
    """gcc is missing or refused the source."""


def source_hash() -> str:
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for path in sorted(SOURCE_DIR.glob("*.c")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def build() -> Path:
    """The directory holding our libnvidia-ml.so.1, compiled if this source was not yet."""
    cache = Path(tempfile.gettempdir()) / f"mig-exporter-fake-libnvml-{os.getuid()}"
    cache.mkdir(mode=0o700, exist_ok=True)
    if cache.stat().st_uid != os.getuid() or cache.stat().st_mode & 0o077:
        raise BuildError(f"{cache} is not private to this user; remove it")
    target = cache / source_hash()
    if (target / SONAME).exists():
        return target
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError("gcc not found: the C fake libnvidia-ml needs the system's gcc")
    work = Path(tempfile.mkdtemp(dir=cache, prefix="build-"))
    try:
        result = subprocess.run([gcc, *CFLAGS, "-o", str(work / SONAME), *map(str, sorted(SOURCE_DIR.glob("*.c")))],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise BuildError(f"gcc failed:\n{result.stderr}")
        try:
            work.rename(target)  # atomic: a concurrent build of the same source loses quietly
        except OSError:
            if not (target / SONAME).exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _text(value: str) -> str:
    """A string as one token: bytes outside printable ASCII, and ``%``, as ``%XX``. Lone
    surrogates stand for the raw bytes of a name that is not UTF-8, as in the Python fake."""
    data = value.encode("utf-8", errors="surrogateescape")
    return "".join(chr(b) if 0x21 <= b <= 0x7E and b != 0x25 else f"%{b:02X}" for b in data) or "%00"


def _memory(memory: FakeMemory | None) -> list[str]:
    if memory is None:
        return []
    return [f"memory {memory.total_bytes} {memory.reserved_bytes} {memory.used_bytes} {memory.free_bytes}"]


_RETIRED_PER_LINE = 32  # addresses on one "retired" line; the library appends lines of one cause


def _optional(value: int | bool | None) -> str:
    return "-" if value is None else str(int(value))


def _health(card: FakeCard, driver_version: str) -> list[str]:
    """A card's FakeHealth as scenario lines; what it leaves None gets no line (NOT_SUPPORTED). Its
    fields go at the ids of ``driver_version``'s header, as the Python fake answers them
    (``field_answers``), the library itself knowing no field's name."""
    health = card.health
    lines = [f"field {fid} {kind} {value}" if value is not None else f"field_error {fid} {code}"
             for fid, (code, value, kind) in field_answers(card, driver_version).items()]
    if health.margin_c is not None:
        lines.append(f"margin {health.margin_c}")
    lines += [f"threshold {kind} {c}" for kind, c in health.thresholds_c.items()]
    if (health.clocks_event_reasons, health.supported_clocks_event_reasons) != (None, None):
        lines.append(f"clock_events {_optional(health.clocks_event_reasons)} "
                     f"{_optional(health.supported_clocks_event_reasons)}")
    if health.performance_state is not None:
        lines.append(f"pstate {health.performance_state}")
    lines += [f"clock {kind} {mhz}" for kind, mhz in health.clocks_mhz.items()]
    lines += [f"max_clock {kind} {mhz}" for kind, mhz in health.max_clocks_mhz.items()]
    if health.fan_percent is not None:
        lines.append(f"fan {health.fan_percent}")
    if any(limit is not None for limit in health.power_limits_mw):
        lines.append("power_limits " + " ".join(map(_optional, health.power_limits_mw)))
    if health.ecc_mode is not None:
        lines.append(f"ecc_mode {int(health.ecc_mode[0])} {int(health.ecc_mode[1])}")
    lines += [f"ecc {error} {counter} {location} {count}"
              for (error, counter, location), count in health.ecc_counts.items()]
    if (sram := health.sram) is not None:
        lines.append(f"sram {sram.volatile_parity} {sram.volatile_secded} {sram.volatile_correctable} "
                     f"{sram.aggregate_parity} {sram.aggregate_secded} {sram.aggregate_correctable} "
                     f"{int(sram.threshold_exceeded)}")
    if health.remapped_rows is not None:
        lines.append("remapped " + " ".join(map(_optional, health.remapped_rows)))
    if health.remapper_histogram is not None:
        lines.append("histogram " + " ".join(map(str, health.remapper_histogram)))
    if health.retired_pages is not None:  # {} too: the call is supported, and no page retired
        lines += [f"retired {cause} " + " ".join(f"{a:#x}" for a in pages[i:i + _RETIRED_PER_LINE])
                  for cause, pages in (health.retired_pages or {0: ()}).items()
                  for i in range(0, max(len(pages), 1), _RETIRED_PER_LINE)]
    if health.retired_pending is not None:
        lines.append(f"retired_pending {int(health.retired_pending)}")
    if health.repair_pending is not None:
        lines.append(f"repair {int(health.repair_pending[0])} {int(health.repair_pending[1])}")
    if health.unrepairable_memory is not None:
        lines.append(f"unrepairable {int(health.unrepairable_memory)}")
    if health.pcie_link is not None:
        lines.append("pcie_link " + " ".join(map(str, health.pcie_link)))
    if card.serial is not None:
        lines.append(f"serial {_text(card.serial)}")
    return [line.rstrip() for line in lines]


def _device(errors: Mapping[str, int], lists: FakeCard | FakeMig) -> list[str]:
    lines = [f"error {_text(name)} {code}" for name, code in errors.items()]
    for letter, attribute in _LISTS:
        process: FakeProcess
        for process in getattr(lists, attribute):
            used = "-" if process.used_bytes is None else str(process.used_bytes)
            lines.append(f"process {letter} {process.pid} {used}")
    return lines


def _scripts(card: FakeCard) -> dict[str, Mapping[int, float]]:
    """The card's activity scripts by target: "-" the whole card, else a GPU instance id (its
    compute instances carry one script, FakeCard checks) and those without a compute instance."""
    scripts: dict[str, Mapping[int, float]] = {"-": card.activity}
    for mig in card.mig_devices:
        scripts.setdefault(str(mig.gpu_instance_id), mig.activity)
    for gi in card.empty_gpu_instances:
        scripts.setdefault(str(gi), {})
    return scripts


def _activity(card: FakeCard) -> list[str]:
    """GPM support, the activity scripts (since always), the metrics' own return codes, the GPU
    instances without a compute instance, and nvmlDeviceGetProcessUtilization's samples."""
    lines = ["gpm 1"] if card.gpm_supported else []
    lines += [f"activity {target} {metric} {float(percent)!r} -"
              for target, script in _scripts(card).items() for metric, percent in script.items()]
    lines += [f"gpm_error {metric} {code}" for metric, code in card.gpm_metric_errors.items()]
    lines += [f"gpu_instance {gi}" for gi in card.empty_gpu_instances]
    lines += [f"putil {u.pid} {u.timestamp_us} {u.sm_percent} {u.memory_percent} {u.encoder_percent} "
              f"{u.decoder_percent}" for u in card.process_samples]
    lines += [f"pactivity {pid} {_shares(shares)} -" for pid, shares in card.process_activity.items()]
    lines.append(f"putil_period {card.process_sample_period_us}")
    if card.process_samples_merged:
        lines.append("putil_merged")
    return lines


def _shares(shares: Sequence[int]) -> str:
    """A process_activity entry, (sm, mem) or (sm, mem, enc, dec), as pactivity's four numbers."""
    return " ".join(str(int(s)) for s in (*shares, 0, 0, 0, 0)[:4])


def _scripts_only(card: FakeCard, after: FakeCard) -> bool:
    """Whether ``after`` is ``card`` but for its activity scripts: all a later line can change."""
    if len(after.mig_devices) != len(card.mig_devices):
        return False
    kept = dataclasses.replace(after, activity=card.activity, process_activity=card.process_activity,
                               mig_devices=tuple(dataclasses.replace(m, activity=c.activity)
                                                 for m, c in zip(after.mig_devices, card.mig_devices, strict=True)))
    order = [pid for pid in card.process_activity if pid in after.process_activity]
    return kept == card and order == [pid for pid in after.process_activity if pid in card.process_activity]


def _later_activity(card: FakeCard, from_s: float, pids: Sequence[int]) -> list[str]:
    """The card's scripts from ``from_s`` on: every percent metric, and every process of ``pids`` (those
    scripted on the card at any time), so that one the new script leaves out is idle from then, as
    under the Python fake's set_scenario."""
    return [f"activity {target} {metric} {float(script.get(metric, 0.0))!r} {float(from_s)!r}"
            for target, script in _scripts(card).items() for metric in sorted(GPM_PERCENT_METRICS)] + [
        f"pactivity {pid} {_shares(card.process_activity.get(pid, ()))} {float(from_s)!r}" for pid in pids]


def scenario_text(scenario: FakeNvmlScenario, *, hang: tuple[str, int] | None = None,
                  grow: Mapping[tuple[int, int | None], int] | None = None, clock_file: Path | None = None,
                  later: Sequence[tuple[float, FakeNvmlScenario]] = (),
                  wall_clock: Sequence[tuple[float | None, float]] = ()) -> str:
    """The file the C library reads at nvmlInit (format: tests/fake_libnvml/README.md). ``wall_clock``:
    (from fake time, or None since always; the wall clock less the fake clock from then on), as the
    Python fake's set_wall_clock and step_wall_clock; without it, the real wall clock's offset."""
    if scenario.missing_functions:
        # A shared object's symbols are fixed at build time; the Python fake covers this.
        raise ValueError("the C fake libnvidia-ml cannot leave functions out (missing_functions)")
    lines = ["# fake libnvidia-ml scenario, written by tests/fake_nvml_c.py",
             f"driver {_text(scenario.driver_version)}", f"cuda {scenario.cuda_version}",
             f"nvml_version {_text(scenario.nvml_version_text)}"]
    if scenario.init_error is not None:
        lines.append(f"init_error {scenario.init_error}")
    if scenario.r535_struct_mismatch:
        lines.append("r535_struct_mismatch")
    lines += [f"system_error {_text(name)} {code}" for name, code in scenario.system_errors.items()]
    if hang is not None:
        lines.append(f"hang {_text(hang[0])} {hang[1]}")
    if clock_file is not None:
        lines.append(f"clock_file {_text(str(clock_file))}")
    lines += [f"wall_clock {float(offset)!r} {'-' if at is None else repr(float(at))}" for at, offset in wall_clock]
    lines += [f"process_name {pid} {_text(name)}" for pid, name in scenario.process_names.items()]
    for _, after in later:
        if len(after.cards) != len(scenario.cards) or not all(
                _scripts_only(card, changed) for card, changed in zip(scenario.cards, after.cards, strict=True)):
            raise ValueError("later scenarios change activity scripts only (GPM's and the processes', those of both "
                             "in the same order): give them the same cards otherwise")
    grow = dict(grow or {})
    for index, card in enumerate(scenario.cards):
        lines += ["card", f"name {_text(card.name)}", f"uuid {_text(card.uuid)}",
                  f"pci {_text(card.pci_bus_id)} {card.pci_device_id:#x} {card.pci_subsystem_id:#x}",
                  *_memory(card.memory), f"max_mig {card.max_mig_devices}"]
        if card.mig_mode is not None:
            lines.append(f"mig_mode {int(card.mig_mode[0])} {int(card.mig_mode[1])}")
        if card.temperature_c is not None:
            lines.append(f"temperature {card.temperature_c}")
        if card.power_mw is not None:
            lines.append(f"power {card.power_mw}")
        if card.gpu_util_percent is not None:
            lines.append(f"utilization {card.gpu_util_percent} {card.memory_util_percent}")
        lines += _health(card, scenario.driver_version) + _device(card.errors, card) + _activity(card)
        pids = list(dict.fromkeys(pid for s in (scenario, *(after for _, after in later))
                                  for pid in s.cards[index].process_activity))
        for from_s, after in later:
            lines += _later_activity(after.cards[index], from_s, pids)
        if (index, None) in grow:
            lines.append(f"grow C {grow.pop((index, None))}")
        for mig in card.mig_devices:
            lines += [f"mig {mig.index} {mig.gpu_instance_id} {mig.compute_instance_id} {_text(mig.profile)} "
                      f"{_text(mig.uuid)}", *_memory(mig.memory), *_device(mig.errors, mig)]
            if mig.sram_uncorrectable_volatile is not None:
                lines.append(f"sram_unc {mig.sram_uncorrectable_volatile}")
            if (index, mig.index) in grow:
                lines.append(f"grow C {grow.pop((index, mig.index))}")
    if grow:
        raise ValueError(f"grow names devices the scenario lacks: {sorted(grow, key=str)}")
    return "\n".join(lines) + "\n"


def write_scenario(path: Path, scenario: FakeNvmlScenario, **modes: object) -> Path:
    path.write_text(scenario_text(scenario, **modes))  # type: ignore[arg-type]
    return path


def set_clock(clock_file: Path, seconds: float) -> None:
    """Set the fake clock of a library whose scenario names ``clock_file``: whole, never half written
    where the library reads it."""
    partial = clock_file.with_name(clock_file.name + ".partial")
    partial.write_text(f"{float(seconds)!r}\n")
    os.replace(partial, clock_file)


def environment(library_dir: Path, scenario_file: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (os.environ) with our library first on the loader's path and the scenario named."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(library_dir), env.get("LD_LIBRARY_PATH")) if p)
    env[SCENARIO_VARIABLE] = str(scenario_file)
    return env


# -- XID events (src/mig_exporter/sources/xid.py) -------------------------------------------------


def xid_lines(*events: tuple[int, int, int | None, int | None, int]) -> str:
    """Scenario lines queueing XID events, to append to a scenario file: each ``(card, xid,
    gpu_instance_id, compute_instance_id, after_ms)``, the ids ``None`` for an event on no MIG
    instance; delivered to a wait on a set where the card is registered, once ``after_ms`` have
    passed since the library read the file (tests/fake_libnvml/fake_libnvml.c's XID region)."""
    return "".join(f"xid {card} {xid} {'-' if gi is None else gi} {'-' if ci is None else ci} {after}\n"
                   for card, xid, gi, ci, after in events)
