"""Per-process activity on whole cards, on the nvidia-smi path: ``nvidia-smi pmon -c 1 -s u``,
parsed by nvidia_smi/pmon.py from real captures (tests/fixtures/nvidia-smi-pmon/, with their
sources), and run by the nvidia-smi source through a fake nvidia-smi, beside the memory read it
must never cost."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from conftest import (
    FIXTURES,
    PMON_HEADER,
    SAMPLES,
    FakeSmi,
    calls,
    fixture_bytes,
    idle_pmon,
    left_behind,
    pmon_row,
)
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import CommandFailed, CommandTimeout
from mig_exporter.model.snapshot import PlacedProcessActivity, ProcessActivity
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from mig_exporter.nvidia_smi.pmon import parse_pmon, whole_card_processes, with_process_activity
from mig_exporter.sources.command import OutputBudget, run_commands
from mig_exporter.sources.demo import DemoSource
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource

pytestmark = pytest.mark.timeout(60)

PMON = FIXTURES.parent / "nvidia-smi-pmon"
PMON_ARGV = "pmon -c 1 -s u -i"
DEMO_PMON = f"{PMON_ARGV} 1"  # the demo's whole card; card 0 is in MIG mode


def capture(name: str) -> bytes:
    return (PMON / name).read_bytes()


def idle(pid: int) -> ProcessActivity:
    """A process pmon printed at `-`: no sample, idle where it is read (a whole card)."""
    return ProcessActivity(pid, 0.0, 0.0)


def unknown(pid: int) -> ProcessActivity:
    return ProcessActivity(pid, None, None)


# The whole H100 of capture A, as -q -x would list it: a100-mig-pending.xml's whole card (MIG
# current Disabled) with its one process replaced by the capture's three, with the memory its
# --query-compute-apps gives them.
CAPTURE_A_PROCESSES = ((11327, "/root/tools/memhog", 2566), (11328, "/root/tools/memhog", 1542),
                       (11345, "./gpu_burn", 15690))


def whole_h100_xml() -> bytes:
    xml = fixture_bytes("a100-mig-pending.xml").decode()
    listed = "".join(
        "\t\t\t<process_info>\n\t\t\t\t<gpu_instance_id>N/A</gpu_instance_id>\n"
        "\t\t\t\t<compute_instance_id>N/A</compute_instance_id>\n"
        f"\t\t\t\t<pid>{pid}</pid>\n\t\t\t\t<type>C</type>\n\t\t\t\t<process_name>{name}</process_name>\n"
        f"\t\t\t\t<used_memory>{mib} MiB</used_memory>\n\t\t\t</process_info>\n"
        for pid, name, mib in CAPTURE_A_PROCESSES)
    xml, count = re.subn(r"<processes>\n.*?</processes>", f"<processes>\n{listed}\t\t</processes>", xml,
                         flags=re.DOTALL)
    assert count == 1
    return xml.encode()


def demo_smi(fake_nvidia_smi: FakeSmi, **kwargs) -> Path:
    """The demo's node through the fake: card 0 in MIG mode, card 1 whole, each with two processes."""
    return fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes(), **kwargs)


def pmon_runs(fake: Path) -> int:
    return sum(1 for _, args in calls(fake) if args.startswith("pmon"))


# --- the parser, on real captures ----------------------------------------------------------------

def test_a_whole_h100_gives_its_busy_process_values_and_its_idle_ones_none() -> None:
    """Capture A (utkuozdemir/nvidia_gpu_exporter, H100, 590.48.01, MIG disabled): five samples,
    in each two memhogs at `-` and gpu_burn at sm 99, mem 10."""
    parsed = parse_pmon(capture("nvgpuexp-h100-80gb-drv590.load.pmon.txt"))
    assert parsed.error is None and parsed.problems == ()
    assert dict(parsed.cards) == {0: (idle(11327), idle(11328), ProcessActivity(11345, 0.99, 0.10))}


def test_a_card_in_mig_mode_prints_every_process_at_dash() -> None:
    """Capture B (the same H100 in MIG mode, same load): gpu_burn computes, and pmon prints `-`,
    which would read idle on a whole card: the join never takes a card in MIG mode (below)."""
    parsed = parse_pmon(capture("nvgpuexp-h100-80gb-mig-drv590.load.pmon.txt"))
    assert parsed.problems == ()
    assert dict(parsed.cards) == {0: (idle(21180), idle(21181), idle(21198))}


def test_a_card_without_a_process_is_in_the_output_with_no_rows() -> None:
    parsed = parse_pmon(capture("nvgpuexp-h100-80gb-mig-drv590.idle.pmon.txt"))
    assert (dict(parsed.cards), parsed.problems, parsed.error) == ({0: ()}, (), None)


def test_windows_rows_with_spaced_names_cut_at_15_and_a_header_mid_sample_all_read() -> None:
    """RTX 2080 SUPER on Windows, 610.62: 21 processes a sample, 19 of them C+G, names such as
    `NVIDIA Overlay.`, and the header again every 44 rows. The last row of a pid is its newest."""
    text = capture("nvgpuexp-rtx-2080-super-wddm-drv610.load.pmon.txt")
    assert text.count(b"# gpu ") == 3
    parsed = parse_pmon(text)
    assert parsed.problems == ()
    (rows,) = parsed.cards.values()
    assert len(rows) == 21
    by_pid = {row.pid: row for row in rows}
    # The last sample of each ffmpeg: sm 3, mem 1 beside enc 49 and `-`: measured shares, kept.
    assert by_pid[12940] == ProcessActivity(12940, 0.03, 0.01)
    assert by_pid[13820] == ProcessActivity(13820, 0.03, 0.01)
    assert by_pid[15964] == idle(15964)  # "NVIDIA Overlay.": a name with a space
    assert sum(1 for row in rows if row == idle(row.pid)) == 19


def first_sample(text: bytes) -> bytes:
    """The first sample of a `pmon -c 5` capture: its header and rows up to a pid's second row."""
    lines, seen = [], set()
    for line in text.splitlines(keepends=True):
        fields = line.split()
        if not line.startswith(b"#") and len(fields) > 1:
            if fields[1] in seen:
                break
            seen.add(fields[1])
        lines.append(line)
    return b"".join(lines)


def test_a_process_busy_on_a_media_engine_only_is_unknown_never_idle() -> None:
    """The Windows capture's first sample: ffmpeg 12940 encodes at enc 99 with sm and mem at `-`
    (NVENC works, the SMs hardly): its SM and memory shares read unknown, so nothing calls the
    transcoder idle; ffmpeg 13820 beside it at sm 7, mem 3 keeps its measured shares."""
    text = first_sample(capture("nvgpuexp-rtx-2080-super-wddm-drv610.load.pmon.txt"))
    assert b" 12940     C      -      -     99 " in text and text.count(b"12940") == 1
    parsed = parse_pmon(text)
    assert parsed.problems == ()
    by_pid = {row.pid: row for row in parsed.cards[0]}
    assert len(by_pid) == 21
    assert by_pid[12940] == unknown(12940)
    assert by_pid[13820] == ProcessActivity(13820, 0.07, 0.03)
    assert by_pid[2140] == idle(2140)  # dwm.exe: no engine busy


@pytest.mark.parametrize("media", [("99", "-", "-", "-"), ("-", "12", "-", "-"), ("-", "-", "3", "-"),
                                   ("-", "-", "-", "40"), ("-", "N/A", "-", "-")])
def test_any_media_engine_busy_or_unreadable_makes_zero_sm_and_mem_unknown(media: tuple[str, ...]) -> None:
    row = "    0      11345     C      -      0 " + " ".join(f"{v:>6}" for v in media) + "    ffmpeg\n"
    assert parse_pmon(PMON_HEADER + row.encode()).cards == {0: (unknown(11345),)}


def test_an_older_driver_without_jpg_and_ofa_reads_enc_and_dec() -> None:
    header = (b"# gpu        pid  type    sm   mem   enc   dec   command\n"
              b"# Idx          #   C/G     %     %     %     %   name\n")
    rows = (b"    0       7372     C     -     -     2     -   ffmpeg\n"
            b"    0       7373     C     -     -     -     -   idle\n"
            b"    0       7374     C     2     0     2     -   ffmpeg\n")
    assert parse_pmon(header + rows).cards == {
        0: (unknown(7372), idle(7373), ProcessActivity(7374, 0.02, 0.0))}


def test_an_older_driver_with_fb_first_reads_sm_and_mem_by_name() -> None:
    """NordicHPC/sonar's `pmon -c 1 -s mu`: 8 columns plus `fb`, which comes first with `-s mu`;
    two header pairs, the rows under the second. fb (7669 MB...) is never read as sm."""
    parsed = parse_pmon(capture("sonar-4gpu-s-mu.pmon.txt"))
    assert parsed.problems == ()
    assert dict(parsed.cards) == {
        0: (idle(447153), idle(447160), idle(506826), ProcessActivity(1864615, 0.40, 0.0)),
        1: (idle(1864615), ProcessActivity(2233095, 0.84, 0.23)),
        2: (idle(1864615), idle(1448150)),
        3: (idle(1864615), ProcessActivity(2233469, 0.90, 0.23)),
    }


def test_fb_after_dec_and_no_line_end_after_the_last_row() -> None:
    parsed = parse_pmon(capture("datarhei-2x-l4-s-um.pmon.txt"))
    assert parsed.problems == ()
    assert dict(parsed.cards) == {
        0: (ProcessActivity(7372, 0.02, 0.0), ProcessActivity(12176, 0.05, 0.02), ProcessActivity(29591, 0.02, 0.01)),
        1: (ProcessActivity(20035, 0.08, 0.02), ProcessActivity(20141, 0.02, 0.01)),
    }


def test_fb_and_ccpm_after_ofa() -> None:
    parsed = parse_pmon(capture("handwritten-2x-s-um-fb-ccpm.pmon.txt"))
    assert parsed.problems == ()
    assert dict(parsed.cards) == {0: (idle(2355), idle(3816), ProcessActivity(740204, 0.42, 0.17)), 1: ()}


def test_every_capture_reads_without_a_problem() -> None:
    for path in sorted(PMON.glob("*.pmon.txt")):
        parsed = parse_pmon(path.read_bytes())
        assert (parsed.error, parsed.problems) == (None, ()), path.name
        assert parsed.cards, path.name


# --- the parser, on what is not pmon -------------------------------------------------------------

@pytest.mark.parametrize("text, error", [
    (b"", "nvidia-smi pmon printed nothing"),
    (b"   \n\n", "nvidia-smi pmon printed nothing"),
    (b"    0      11345     C     99     10      -      -      -      -    gpu_burn\n",
     "nvidia-smi pmon printed no column header (# gpu pid ...)"),
    (os.urandom(4096), "nvidia-smi pmon printed no column header (# gpu pid ...)"),
    (b"# gpu pid type fb command\n# Idx # C/G MB name\n    0   11 C  120 x\n",
     "nvidia-smi pmon's header has no sm and mem columns"),
])
def test_output_without_a_header_to_read_it_by_is_an_error_not_an_exception(text: bytes, error: str) -> None:
    parsed = parse_pmon(text)
    assert parsed.error == error
    assert dict(parsed.cards) == {}


def test_random_bytes_never_raise() -> None:
    for _ in range(200):
        parse_pmon(os.urandom(512))
        parse_pmon(PMON_HEADER + os.urandom(512))


def test_lines_that_are_no_row_are_skipped_and_counted_in_one_problem_line() -> None:
    """A process's row whose values are no percent (120, cut short) makes that process unknown; a
    line that names a card but no process puts the card's unprinted processes in doubt; one that
    names no card, every card's."""
    text = (PMON_HEADER
            + b"Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error\n"
            + pmon_row(0, 11345, sm=99, mem=10, command="gpu_burn")
            + b"    0      11346     C    120     10      -      -      -      -    too_busy\n"  # past 100 %
            + b"    0          0     C      1      1      -      -      -      -    pid_zero\n"
            + b"    0 4294967295     C      1      1      -      -      -      -    no_pid\n"
            + "    0      ²1347     C      1      1      -      -      -      -    superscript\n".encode()
            + b"    0 " + b"9" * 5000 + b"     C      1      1      -      -      -      -    long\n"
            + b"    0      11348     C\n"  # cut short
            + pmon_row(1, 2, sm=0, mem=0, command="kthreadd"))
    parsed = parse_pmon(text)
    assert dict(parsed.cards) == {0: (ProcessActivity(11345, 0.99, 0.10), unknown(11346), unknown(11348)),
                                  1: (ProcessActivity(2, 0.0, 0.0),)}
    assert (parsed.partial_cards, parsed.stray_lines) == ({0}, 1)
    (problem,) = parsed.problems
    assert problem.startswith("nvidia-smi pmon: 7 line(s) not understood, their processes' activity unknown; "
                              "the first, line 3: 'Unable to determine the device handle")


def test_a_row_before_any_header_is_skipped() -> None:
    parsed = parse_pmon(pmon_row(0, 5, sm=1, mem=1) + PMON_HEADER + pmon_row(0, 6, sm=2, mem=2))
    assert dict(parsed.cards) == {0: (ProcessActivity(6, 0.02, 0.02),)}
    assert len(parsed.problems) == 1
    assert not parsed.printed_every_process(0), "pid 5 may be card 0's"


def test_the_newest_sample_of_a_process_wins() -> None:
    parsed = parse_pmon(PMON_HEADER + pmon_row(0, 7, sm=50, mem=5) + pmon_row(0, 8) + pmon_row(0, 7))
    assert parsed.cards[0] == (idle(7), idle(8))


def test_crlf_and_an_empty_command_read() -> None:
    row = pmon_row(0, 9, sm=4, mem=2, command="").rstrip(b" \n") + b"\r\n"
    assert parse_pmon(PMON_HEADER.replace(b"\n", b"\r\n") + row).cards == {0: (ProcessActivity(9, 0.04, 0.02),)}


# --- the join onto a snapshot --------------------------------------------------------------------

def demo_snapshot():
    return snapshot_from_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes())


def test_only_whole_cards_with_processes_are_asked_for() -> None:
    assert whole_card_processes(demo_snapshot()) == {1: (50102, 50318)}  # card 0 is in MIG mode
    mig = snapshot_from_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"))
    assert whole_card_processes(mig) == {}


def test_a_listed_process_at_dash_or_absent_is_idle_and_an_unlisted_row_is_left_out() -> None:
    pmon = parse_pmon(PMON_HEADER
                      + pmon_row(0, 48213, sm=30, mem=3)  # a MIG card: never taken, whatever it says
                      + pmon_row(1, 50102, kind="G")  # `-`: idle
                      + pmon_row(1, 61000, sm=80, mem=20))  # not in -q -x: gone, or not ours
    snapshot = with_process_activity(demo_snapshot(), pmon)
    assert snapshot.process_activity == (PlacedProcessActivity(50102, 1, 0.0, 0.0),
                                         PlacedProcessActivity(50318, 1, 0.0, 0.0))  # absent: idle
    assert snapshot.problems == demo_snapshot().problems


def test_a_whole_card_pmon_did_not_print_is_unknown_with_a_problem_line() -> None:
    snapshot = with_process_activity(demo_snapshot(), parse_pmon(PMON_HEADER + pmon_row(0, 48213)))
    assert snapshot.process_activity == ()
    assert snapshot.problems[-1] == "card 1: not in nvidia-smi pmon's output; its processes' activity unknown"


@pytest.mark.parametrize("value", ["105", "N/A", "9x", "-1", "²"])
def test_a_listed_process_whose_value_cannot_be_read_is_left_out_never_idle(value: str) -> None:
    """Only `-` (or no row, where every line of the card was read) is idle: a value that is no
    percent leaves that process's activity unknown, its neighbour's is still taken."""
    row = f"    1      50318     C {value:>6}     41      -      -      -      -    python3\n".encode()
    snapshot = with_process_activity(demo_snapshot(), parse_pmon(PMON_HEADER + pmon_row(1, 50102) + row))
    assert snapshot.process_activity == (PlacedProcessActivity(50102, 1, 0.0, 0.0),)
    assert snapshot.problems[-1].startswith("nvidia-smi pmon: 1 line(s) not understood, their processes' "
                                            "activity unknown; the first, line 4: ")


@pytest.mark.parametrize("line", [
    b"    1      \xb2 C      5      5      -      -      -      -    x\n",  # names card 1, no pid
    b"    1\n",
    b"WARNING: something nvidia-smi says\n",  # names no card: every card in doubt
])
def test_a_listed_process_not_printed_beside_a_line_not_understood_is_unknown(line: bytes) -> None:
    """pmon printed a line for the card (or for no card) that could not be read: a listed process
    it did not print may be that line, so it is unknown, not idle."""
    snapshot = with_process_activity(demo_snapshot(), parse_pmon(PMON_HEADER + pmon_row(1, 50102) + line))
    assert snapshot.process_activity == (PlacedProcessActivity(50102, 1, 0.0, 0.0),)  # 50318: left out
    # A line naming another card leaves card 1's absent process idle.
    other = with_process_activity(demo_snapshot(), parse_pmon(PMON_HEADER + pmon_row(1, 50102) + b"    0\n"))
    assert other.process_activity == (PlacedProcessActivity(50102, 1, 0.0, 0.0),
                                      PlacedProcessActivity(50318, 1, 0.0, 0.0))


def test_a_listed_process_busy_on_a_media_engine_only_is_left_out() -> None:
    rows = (b"    1      50102     G      -      -     99      -      -      -    llama-server\n"
            + pmon_row(1, 50318, sm=63, mem=41))
    snapshot = with_process_activity(demo_snapshot(), parse_pmon(PMON_HEADER + rows))
    assert snapshot.process_activity == (PlacedProcessActivity(50318, 1, 0.63, 0.41),)


def test_a_failed_or_unreadable_pmon_is_one_problem_line_and_no_activity() -> None:
    failed = with_process_activity(demo_snapshot(), "nvidia-smi pmon -c 1 -s u: exit status 9: No devices found")
    assert failed.process_activity == ()
    assert failed.problems[-1] == ("nvidia-smi pmon failed, process activity unknown: "
                                   "nvidia-smi pmon -c 1 -s u: exit status 9: No devices found")
    unreadable = with_process_activity(demo_snapshot(), parse_pmon(b"garbage\n"))
    assert unreadable.process_activity == ()
    assert unreadable.problems[-1] == ("nvidia-smi pmon printed no column header (# gpu pid ...); "
                                       "process activity unknown")
    # The memory read is the same either way.
    assert failed.devices == unreadable.devices == demo_snapshot().devices
    assert failed.processes == demo_snapshot().processes


def test_a_node_with_no_whole_card_is_left_as_it_is() -> None:
    mig = snapshot_from_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"))
    assert with_process_activity(mig, "failed") is mig


# --- the source, through a fake nvidia-smi --------------------------------------------------------

def test_per_process_activity_on_a_whole_card_matches_the_capture(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_nvidia_smi(whole_h100_xml(), fixture_bytes("a100-mig-pending.L.txt"),
                           pmon=capture("nvgpuexp-h100-80gb-drv590.load.pmon.txt"))
    snapshot = NvidiaSmiSource(str(fake), timeout_s=10).read()

    assert snapshot.problems == ()
    assert snapshot.process_activity == (
        PlacedProcessActivity(11327, 0, 0.0, 0.0),  # memhog: `-`, memory held and nothing computed
        PlacedProcessActivity(11328, 0, 0.0, 0.0),
        PlacedProcessActivity(11345, 0, 0.99, 0.10),  # gpu_burn
    )
    assert {p.pid: p.used_bytes for p in snapshot.processes} == {
        pid: mib * 1024 * 1024 for pid, _, mib in CAPTURE_A_PROCESSES}
    assert [args for _, args in calls(fake) if args.startswith("pmon")] == [f"{PMON_ARGV} 0"]


def test_a_card_in_mig_mode_beside_a_whole_card_gets_none(fake_nvidia_smi: FakeSmi) -> None:
    fake = demo_smi(fake_nvidia_smi, pmon=(SAMPLES / "demo-pmon.txt").read_bytes())
    snapshot = NvidiaSmiSource(str(fake), timeout_s=10).read()
    assert snapshot.problems == ()
    # Card 0's processes (48213, 51877) are in MIG mode: none; card 1's from the sample.
    assert snapshot.process_activity == (PlacedProcessActivity(50102, 1, 0.0, 0.0),
                                         PlacedProcessActivity(50318, 1, 0.63, 0.41))


def test_pmon_runs_after_the_first_read_then_beside_the_others(fake_nvidia_smi: FakeSmi) -> None:
    fake = demo_smi(fake_nvidia_smi)
    source = NvidiaSmiSource(str(fake), timeout_s=10)
    first = source.read()
    assert calls(fake)[-1][1] == DEMO_PMON, "not foreseen: run after -q -x and -L"
    second = source.read()
    assert pmon_runs(fake) == 2
    # The default fake prints every process at `-`: idle, both times.
    assert first.process_activity == second.process_activity == (
        PlacedProcessActivity(50102, 1, 0.0, 0.0), PlacedProcessActivity(50318, 1, 0.0, 0.0))


def test_pmon_is_never_run_when_every_card_is_in_mig_mode(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"))
    source = NvidiaSmiSource(str(fake), timeout_s=10)
    for _ in range(3):
        snapshot = source.read()
        assert snapshot.process_activity == ()
        assert snapshot.problems == ()
    assert sorted(args for _, args in calls(fake)) == ["-L"] * 3 + ["-q -x"] * 3


def test_pmon_is_not_run_for_a_whole_card_without_processes(fake_nvidia_smi: FakeSmi) -> None:
    xml = re.sub(rb"<processes>.*?</processes>", b"<processes>\n\t\t</processes>", whole_h100_xml(), flags=re.DOTALL)
    fake = fake_nvidia_smi(xml, fixture_bytes("a100-mig-pending.L.txt"))
    snapshot = NvidiaSmiSource(str(fake), timeout_s=10).read()
    assert (snapshot.process_activity, snapshot.problems, pmon_runs(fake)) == ((), (), 0)


# --- more than 4 whole cards: pmon asked per group of at most 4 (-i) ---------------------------

UUID = "GPU-2e2425ba-9682-1709-05f4-ec5a399fc47"


def whole_cards_xml(cards: int, idle_cards: tuple[int, ...] = ()) -> tuple[bytes, bytes]:
    """A node of ``cards`` whole A100s (a100-mig-pending.xml's card, its mode change pending), card
    N with one process, pid 900 + N, but the ``idle_cards`` with none; and its -L."""
    xml = fixture_bytes("a100-mig-pending.xml").decode()
    start, end = xml.index("\t<gpu id="), xml.index("</gpu>") + len("</gpu>\n")
    card = xml[start:end]
    assert card.count(UUID) == 1 and card.count("<pid>900</pid>") == 1
    bare = re.sub(r"<processes>.*?</processes>", "<processes>\n\t\t</processes>", card, flags=re.DOTALL)
    gpus = "".join((bare if n in idle_cards else card.replace("<pid>900</pid>", f"<pid>{900 + n}</pid>"))
                   .replace(UUID + "f", f"{UUID}{n:x}") for n in range(cards))
    listing = "".join(f"GPU {n}: NVIDIA A100-SXM4-80GB (UUID: {UUID}{n:x})\n" for n in range(cards))
    return (xml[:start] + gpus + xml[end:]).encode(), listing.encode()


def group_smi(fake_nvidia_smi: FakeSmi, cards: int, pmon: bytes, by_group: dict[str, bytes] | None = None,
              **kwargs) -> Path:
    """The fake for ``whole_cards_xml(cards)``, printing ``pmon`` for a pmon run, or ``by_group``'s
    output for the run whose -i list it names (``fail`` there: exit 9)."""
    xml, listing = whole_cards_xml(cards)
    fake = fake_nvidia_smi(xml, listing, pmon=pmon, **kwargs)
    if by_group:
        cases = "".join(
            f"    *'-i {cards}') echo 'Failed to initialize NVML: Unknown Error' >&2; exit 9 ;;\n" if out == b"fail"
            else f"    *'-i {cards}') cat {fake.parent / ('pmon-' + cards.replace(',', '-') + '.txt')} ;;\n"
            for cards, out in by_group.items())
        for cards, out in by_group.items():
            (fake.parent / f"pmon-{cards.replace(',', '-')}.txt").write_bytes(out)
        text = fake.read_text()
        plain = f"  pmon) cat {fake.parent / 'pmon.txt'} ;;"
        assert plain in text
        fake.write_text(text.replace(plain, f'  pmon) case "$*" in\n{cases}'
                                            f"    *) cat {fake.parent / 'pmon.txt'} ;;\n  esac ;;"))
    return fake


def test_pmon_is_asked_for_the_whole_cards_with_processes_four_at_a_time(fake_nvidia_smi: FakeSmi) -> None:
    """pmon monitored at most 4 devices on older drivers (16 in NVIDIA's current documentation), and
    without -i it shows the first of them only: six whole cards are asked as 0-3 and 4-5, side by
    side, both times the same."""
    rows = b"".join(pmon_row(n, 900 + n, sm=10 * n, mem=n) for n in range(6))
    fake = group_smi(fake_nvidia_smi, 6, PMON_HEADER + rows)
    source = NvidiaSmiSource(str(fake), timeout_s=10)
    for _ in range(2):  # after -q -x and -L, then beside them
        snapshot = source.read()
        assert snapshot.problems == ()
        assert snapshot.process_activity == tuple(
            PlacedProcessActivity(900 + n, n, n / 10, n / 100) for n in range(6))
    asked = [args for _, args in calls(fake) if args.startswith("pmon")]
    assert sorted(asked) == [f"{PMON_ARGV} 0,1,2,3"] * 2 + [f"{PMON_ARGV} 4,5"] * 2


def test_each_card_is_taken_from_its_own_run_and_a_failed_run_costs_only_its_cards(
        fake_nvidia_smi: FakeSmi) -> None:
    """A run's output is read for the cards it was asked for only (a row of another card in it is
    not taken), and a run that fails leaves its own cards' processes unknown."""
    everyone = PMON_HEADER + b"".join(pmon_row(n, 900 + n, sm=50, mem=5) for n in range(9))
    fake = group_smi(fake_nvidia_smi, 9, everyone, by_group={
        "0,1,2,3": everyone,
        "4,5,6,7": PMON_HEADER + b"".join(pmon_row(n, 900 + n, sm=70, mem=7) for n in range(4, 8)),
        "8": b"fail",
    })
    source = NvidiaSmiSource(str(fake), timeout_s=10)
    for _ in range(2):
        snapshot = source.read()
        assert snapshot.process_activity == (
            *(PlacedProcessActivity(900 + n, n, 0.5, 0.05) for n in range(4)),
            *(PlacedProcessActivity(900 + n, n, 0.7, 0.07) for n in range(4, 8)))
        (problem,) = snapshot.problems
        assert problem == (f"nvidia-smi pmon failed, process activity unknown: {fake} {PMON_ARGV} 8: exit status 9: "
                           "Failed to initialize NVML: Unknown Error")
    assert sorted(args for _, args in calls(fake) if args.startswith("pmon")) == [
        f"{PMON_ARGV} 0,1,2,3"] * 2 + [f"{PMON_ARGV} 4,5,6,7"] * 2 + [f"{PMON_ARGV} 8"] * 2


def test_a_card_that_gains_processes_is_asked_after_the_others(fake_nvidia_smi: FakeSmi) -> None:
    """The runs beside -q -x are the last read's cards; a card with processes this read finds
    besides those is asked after them, in what the read has left."""
    rows = PMON_HEADER + b"".join(pmon_row(n, 900 + n, sm=20, mem=2) for n in range(6))
    fake = group_smi(fake_nvidia_smi, 6, rows)
    source = NvidiaSmiSource(str(fake), timeout_s=10)
    source.read()
    # Cards 4 and 5 lose their processes: asked for beside -q -x (foreseen), then left alone.
    (fake.parent / "q.xml").write_bytes(whole_cards_xml(6, idle_cards=(4, 5))[0])
    assert [a.pid for a in source.read().process_activity] == [900, 901, 902, 903]
    (fake.parent / "q.xml").write_bytes(whole_cards_xml(6)[0])
    assert [a.pid for a in source.read().process_activity] == [900, 901, 902, 903, 904, 905]
    logged = [args.removeprefix(PMON_ARGV + " ") for _, args in calls(fake)]
    # Four runs a read; the runs after the others start once those have ended, so they log last.
    first, second, third = logged[0:4], logged[4:8], logged[8:12]
    assert len(logged) == 12
    assert sorted(first[:2]) == ["-L", "-q -x"] and sorted(first[2:]) == ["0,1,2,3", "4,5"]
    assert sorted(second) == ["-L", "-q -x", "0,1,2,3", "4,5"]
    assert sorted(third[:3]) == ["-L", "-q -x", "0,1,2,3"] and third[3] == "4,5"


def assert_memory_read_intact(snapshot) -> None:
    expected = demo_snapshot()
    assert snapshot.devices == expected.devices
    assert snapshot.processes == expected.processes
    assert snapshot.cards == expected.cards


def test_a_hung_pmon_leaves_the_memory_read_intact_within_the_deadline(fake_nvidia_smi: FakeSmi) -> None:
    fake = demo_smi(fake_nvidia_smi, pmon_mode="hang")
    source = NvidiaSmiSource(str(fake), timeout_s=2.0)
    for when in ("after -q -x and -L", "beside them"):
        started = time.monotonic()
        snapshot = source.read()
        elapsed = time.monotonic() - started
        # pmon has half the time left: the read answers well before its own 2 s.
        assert elapsed < 1.6, f"{when}: {elapsed:.2f}s"
        assert_memory_read_intact(snapshot)
        assert snapshot.process_activity == ()
        (problem,) = snapshot.problems
        assert problem.startswith(f"nvidia-smi pmon failed, process activity unknown: {fake} {DEMO_PMON}: "
                                  "timed out after"), problem
    assert pmon_runs(fake) == 2
    live, zombies = left_behind([pid for pid, _ in calls(fake)])
    assert (live, zombies) == ([], [])


@pytest.mark.parametrize("pmon_mode, reason", [
    ("fail", f"{DEMO_PMON}: exit status 9: Failed to initialize NVML: Unknown Error"),
    ("garbage", "nvidia-smi pmon printed no column header"),
    ("flood", "bytes, its share of the read's output cap of 262144 bytes; process group killed"),
])
def test_a_failed_pmon_is_a_problem_line_and_the_memory_read_answers(fake_nvidia_smi: FakeSmi, pmon_mode: str,
                                                                      reason: str) -> None:
    fake = demo_smi(fake_nvidia_smi, pmon_mode=pmon_mode, stderr="Failed to initialize NVML: Unknown Error")
    source = NvidiaSmiSource(str(fake), timeout_s=5, max_output_bytes=256 * 1024)
    for _ in range(2):  # after the others, then beside them
        snapshot = source.read()
        assert_memory_read_intact(snapshot)
        assert snapshot.process_activity == ()
        (problem,) = snapshot.problems
        assert reason in problem, problem
        assert "\n" not in problem
    live, zombies = left_behind([pid for pid, _ in calls(fake)])
    assert (live, zombies) == ([], [])


def test_a_failed_query_kills_a_pmon_beside_it(fake_nvidia_smi: FakeSmi) -> None:
    fake = demo_smi(fake_nvidia_smi, pmon_mode="hang")
    source = NvidiaSmiSource(str(fake), timeout_s=4)
    source.read()  # foresees pmon for the next read
    fake.write_text(fake.read_text().replace(f"  -q) cat {fake.parent / 'q.xml'}",
                                             "  -q) echo 'NVIDIA-SMI has failed' >&2; exit 9", 1))
    started = time.monotonic()
    with pytest.raises(CommandFailed, match="exit status 9: NVIDIA-SMI has failed"):
        source.read()
    assert time.monotonic() - started < 1.0, "pmon was not killed with the failed -q -x"
    live, zombies = left_behind([pid for pid, _ in calls(fake)])
    assert (live, zombies) == ([], [])


# --- the fake's default and the demo ---------------------------------------------------------------

def test_the_fake_prints_every_listed_process_idle_by_default() -> None:
    text = idle_pmon((SAMPLES / "demo.xml").read_bytes())
    assert parse_pmon(text).cards == {0: (idle(48213), idle(51877)), 1: (idle(50102), idle(50318))}
    assert b"llama-server   \n" in text
    assert parse_pmon(idle_pmon(b"not xml")).cards == {}


def test_the_demo_shows_a_busy_and_an_idle_process_on_its_whole_card() -> None:
    snapshot = DemoSource().read()
    assert snapshot.process_activity == (
        PlacedProcessActivity(50102, 1, 0.0, 0.0),  # the Vulkan llama-server: 20 GiB held, nothing computed
        PlacedProcessActivity(50318, 1, 0.63, 0.41),  # train.py: the card's 63 % and 41 %
    )
    assert snapshot.problems == demo_snapshot().problems
    card = next(c for c in snapshot.cards if c.index == 1)
    assert card.utilization_ratio == pytest.approx(0.63)


# --- a command's own deadline (sources/command.py) -----------------------------------------------

def test_a_command_with_a_sooner_deadline_is_killed_alone() -> None:
    budget = OutputBudget(1024, shared=False)
    started = time.monotonic()
    first, hung = run_commands([(["sh", "-c", "sleep 0.6; echo done"], budget),
                                (["sleep", "30"], OutputBudget(1024, shared=False))],
                               Deadline.after(5), sooner=[None, Deadline.after(0.2)])
    assert time.monotonic() - started < 2.0
    assert not isinstance(first, Exception) and first.stdout == b"done\n"
    assert isinstance(hung, CommandTimeout) and "timed out after 0.2s" in str(hung)
