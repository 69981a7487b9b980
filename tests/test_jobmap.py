"""Slurm job-map directories (dcgm-exporter's --hpc-job-mapping-dir, Princeton
jobstats' MIG-UUID files): the pure parser, the safe directory read, the
metrics, and an end-to-end read with a fake nvidia-smi."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from conftest import SAMPLES, sample_value, samples_of, scenario
from mig_exporter.core.deadline import Deadline
from mig_exporter.host import jobmap
from mig_exporter.host.jobmap import (
    MAX_FILE_BYTES,
    JobMapFile,
    SlurmJobMap,
    file_devices,
    job_map_reading,
    parse_job_ids,
)
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.readings import SlurmAllocation
from mig_exporter.sources.demo import DemoSource

H100 = scenario("h100-mig-processes")  # card 0 in MIG mode: 1000-1003
H100_CARD = "GPU-0e9558c1-530a-493a-fbb8-b64cb580fac2"
H100_MIG_1001 = "MIG-7cd8995e-feba-5903-8050-d09c5892503e"
DEMO = DemoSource().read()  # card 0 in MIG mode (1000-1002), card 1 whole
DEMO_MIG_1002 = "MIG-a2cbd390-b656-5a4d-8bad-821df997d529"


def _pairs(reading) -> set[tuple[int, str]]:
    return {(a.device_index, a.job) for a in reading.allocations}


# --- the pure parser -----------------------------------------------------------------------------

def test_job_ids_one_per_line_first_field_blank_lines_skipped():
    jobs, bad = parse_job_ids("4242\n\n  45916256 262563\n4242\n")
    assert jobs == ("4242", "45916256")
    assert bad == ()


def test_what_is_not_a_slurm_job_id_is_set_apart():
    # An array task's or a het job component's display form names no cgroup: its
    # $SLURM_JOB_ID is a number of its own. Bad lines are counted by number, never shown.
    jobs, bad = parse_job_ids("4242\njob1\n12a\n-5\n1234_\n1234_7\n99+1\n")
    assert jobs == ("4242",)
    assert bad == (2, 3, 4, 5, 6, 7)


def test_a_card_index_on_a_card_in_mig_mode_stands_for_all_its_instances():
    assert file_devices(H100, "0") == (1000, 1001, 1002, 1003)
    assert file_devices(DEMO, "1") == (1,)
    assert file_devices(DEMO, "2") == ()


def test_uuids_name_an_instance_or_a_whole_card():
    assert file_devices(H100, H100_MIG_1001) == (1001,)
    assert file_devices(H100, H100_CARD) == (1000, 1001, 1002, 1003)
    assert file_devices(H100, "MIG-00000000-0000-0000-0000-000000000000") == ()
    assert file_devices(H100, "0:1") == ()  # not a form dcgm-exporter or jobstats writes


def test_a_file_listing_two_jobs_gives_two_allocations_and_bad_lines_a_problem():
    files = [JobMapFile("1", "4242\n4243 1000\n"), JobMapFile(DEMO_MIG_1002, "777 262563\noops\n"),
             JobMapFile("7", "1\n")]
    reading = job_map_reading(DEMO, files)
    assert reading.allocations == (SlurmAllocation(1, "4242"), SlurmAllocation(1, "4243"),
                                   SlurmAllocation(1002, "777"))
    assert reading.read_success is True
    assert reading.problems == (
        "slurm job map: 1 file(s) name no device read (a card's index or a GPU-/MIG- UUID expected), first '7'",
        "slurm job map: 1 file(s) with 1 line(s) not starting with a numeric Slurm job id ($SLURM_JOB_ID) of at "
        f"most 64 digits, first '{DEMO_MIG_1002}' (1 line(s), first line 2)",
    )


# --- the directory -------------------------------------------------------------------------------

def test_gpu_index_and_mig_uuid_file_names_are_read(tmp_path):
    (tmp_path / "0").write_text("4242\n")
    (tmp_path / H100_MIG_1001).write_text("45916256 262563\n")
    (tmp_path / ".0.tmp").write_text("999\n")  # a prolog's file before its rename: not read
    reading = SlurmJobMap(str(tmp_path)).read(H100)
    assert _pairs(reading) == {(1000, "4242"), (1001, "4242"), (1002, "4242"), (1003, "4242"),
                               (1001, "45916256")}
    assert (reading.read_success, reading.problems) == (True, ())


def test_a_missing_directory_is_read_success_0_and_one_problem(tmp_path):
    reading = SlurmJobMap(str(tmp_path / "none")).read(H100)
    assert (reading.allocations, reading.read_success) == ((), False)
    assert reading.problems == (f"slurm job map: cannot read the directory {tmp_path / 'none'}: "
                                "No such file or directory",)


def test_a_file_in_place_of_the_directory_is_read_success_0(tmp_path):
    (tmp_path / "map").write_text("4242\n")
    reading = SlurmJobMap(str(tmp_path / "map")).read(H100)
    assert (reading.allocations, reading.read_success) == ((), False)
    assert reading.problems == (f"slurm job map: cannot read the directory {tmp_path / 'map'}: Not a directory",)


def test_an_empty_directory_reads_with_no_allocation(tmp_path):
    reading = SlurmJobMap(str(tmp_path)).read(H100)
    assert (reading.allocations, reading.read_success, reading.problems) == ((), True, ())


def test_a_hostile_directory_gives_a_problem_per_bad_entry_and_keeps_the_rest(tmp_path):
    outside = tmp_path / "secret"
    outside.write_text("31337\n")
    d = tmp_path / "map"
    d.mkdir()
    (d / "1").write_text("4242\n")  # the good file
    (d / DEMO_MIG_1002).write_text("777 262563\n")  # the good file
    (d / "0").write_bytes(b"1\n" * (MAX_FILE_BYTES // 2 + 1))  # just over the bound
    (d / "1001").symlink_to(outside)  # a link out of the directory
    (d / "1000").write_bytes(b"4242\n\xff\xfe\n")
    (d / "GPU-dir").mkdir()
    os.mkfifo(d / "fifo")
    (d / os.fsdecode(b"\xffname")).write_text("5\n")  # a name that is not UTF-8
    (d / "README").write_text("4242\n")
    reading = SlurmJobMap(str(d)).read(DEMO)
    assert _pairs(reading) == {(1, "4242"), (1002, "777")}
    assert reading.read_success is True
    assert reading.complete is False  # '0', card 0's file, was not read: its jobs are unknown
    assert sorted(reading.problems) == sorted([
        f"slurm job map file '0': larger than {MAX_FILE_BYTES} bytes, skipped",
        "slurm job map file '1000': not UTF-8 text (byte 5)",
        "slurm job map file '1001': a symbolic link, not followed",
        "slurm job map file 'GPU-dir': a directory, not a file",
        "slurm job map file 'fifo': not a regular file",
        "slurm job map: 2 file(s) name no device read (a card's index or a GPU-/MIG- UUID expected), "
        "first 'README'",
    ])


def test_a_huge_file_is_not_read_whole(tmp_path):
    (tmp_path / "1").write_bytes(b"4242\n" + b"9" * (64 * MAX_FILE_BYTES))
    reading = SlurmJobMap(str(tmp_path)).read(DEMO)
    assert (reading.allocations, reading.problems) == ((), (f"slurm job map file '1': larger than "
                                                            f"{MAX_FILE_BYTES} bytes, skipped",))


def test_no_budget_left_is_a_problem_and_what_was_read_stays(tmp_path):
    (tmp_path / "1").write_text("4242\n")
    reading = SlurmJobMap(str(tmp_path)).read(DEMO, Deadline.after(-1.0))
    assert reading.allocations == ()
    assert reading.read_success is True
    assert reading.problems == (f"slurm job map: the scrape's budget ran out after 0 of 1 files in {tmp_path}",)
    assert reading.complete is False


# --- read in part: allocations that may be missing -----------------------------------------------

def test_a_reading_is_complete_unless_a_device_s_file_went_unread_or_the_listing_stopped():
    files = [JobMapFile("1", "4242\n")]
    assert job_map_reading(DEMO, files).complete
    # A name that names no device hides no allocation, read or not.
    assert job_map_reading(DEMO, files, unread=["README", "7", "1000"]).complete
    assert not job_map_reading(DEMO, files, unread=["0"]).complete  # card 0: all its instances
    assert not job_map_reading(DEMO, files, unread=[DEMO_MIG_1002]).complete
    assert not job_map_reading(DEMO, files, listed_all=False).complete


def test_a_device_s_file_that_cannot_be_read_leaves_the_allocations_unknown(tmp_path):
    outside = tmp_path / "secret"
    outside.write_text("31337\n")
    d = tmp_path / "map"
    d.mkdir()
    (d / "0").write_text("4242\n")
    (d / DEMO_MIG_1002).write_bytes(b"777\n\xff\n")  # not UTF-8: its jobs are not known
    reading = SlurmJobMap(str(d)).read(DEMO)
    assert (_pairs(reading), reading.read_success, reading.complete) == (
        {(1000, "4242"), (1001, "4242"), (1002, "4242")}, True, False)
    (d / DEMO_MIG_1002).unlink()
    (d / "1").symlink_to(outside)  # whole card 1's file, a link: not followed, so not read
    assert not SlurmJobMap(str(d)).read(DEMO).complete
    (d / "1").unlink()
    # Bad entries whose names name no device leave nothing out.
    (d / "README").symlink_to(outside)
    (d / "GPU-dir").mkdir()
    (d / "7").write_bytes(b"\xff")
    reading = SlurmJobMap(str(d)).read(DEMO)
    assert (reading.complete, len(reading.problems)) == (True, 3)


def test_a_device_s_file_that_fails_to_read_leaves_the_allocations_unknown(tmp_path, monkeypatch):
    (tmp_path / "1").write_text("4242\n")

    def failing(fd: int, limit: int) -> bytes:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(jobmap, "read_fd", failing)
    reading = SlurmJobMap(str(tmp_path)).read(DEMO)
    assert reading.problems == ("slurm job map file '1': cannot read: Input/output error",)
    assert (reading.allocations, reading.read_success, reading.complete) == ((), True, False)


def test_more_files_than_the_bound_is_a_reading_in_part(tmp_path, monkeypatch):
    monkeypatch.setattr(jobmap, "MAX_FILES", 2)
    for name in ("README", "notes", "old"):  # none names a device, but what lies beyond is not known
        (tmp_path / name).write_text("4242\n")
    reading = SlurmJobMap(str(tmp_path)).read(DEMO)
    assert reading.problems[0] == f"slurm job map: more than 2 files in {tmp_path}: the rest are left out"
    assert reading.complete is False


def test_a_budget_spent_before_files_that_name_no_device_leaves_nothing_out(tmp_path):
    (tmp_path / "README").write_text("the prolog's notes\n")
    reading = SlurmJobMap(str(tmp_path)).read(DEMO, Deadline.after(-1.0))
    assert reading.problems == (f"slurm job map: the scrape's budget ran out after 0 of 1 files in {tmp_path}",)
    assert reading.complete is True


def test_a_file_an_epilog_removes_while_the_directory_is_read_is_no_allocation_and_no_problem(
        tmp_path, monkeypatch):
    (tmp_path / "0").write_text("4242\n")
    (tmp_path / "1").write_text("4243\n")
    read_entry = jobmap.read_entry

    def epilog_first(dir_fd: int, name: str) -> str:
        if name == "0":  # listed, then removed by the job's epilog before it is read
            os.unlink(name, dir_fd=dir_fd)
        return read_entry(dir_fd, name)

    monkeypatch.setattr(jobmap, "read_entry", epilog_first)
    reading = SlurmJobMap(str(tmp_path)).read(DEMO)
    assert (_pairs(reading), reading.problems, reading.complete) == ({(1, "4243")}, (), True)


def test_the_scrape_s_host_view_takes_a_reading_in_part_as_unknown_allocations(tmp_path):
    (tmp_path / "1").write_text("4242\n")
    (tmp_path / "0").write_bytes(b"\xff")
    outcome = Scraper(DemoSource(), job_map=SlurmJobMap(str(tmp_path))).read()
    assert outcome.job_map is not None and not outcome.job_map.complete
    assert outcome.host.allocated == {1: ("Slurm job 4242",)} and not outcome.host.allocations_known
    families = Scraper(DemoSource(), job_map=SlurmJobMap(str(tmp_path))).families()
    assert sample_value(families, "mig_exporter_slurm_job_map_read_success") == 1  # the directory was read


# --- the metrics ---------------------------------------------------------------------------------

def test_the_scrape_exports_slurm_allocations_beside_the_read(tmp_path):
    (tmp_path / "1").write_text("4242\n4243\n")
    (tmp_path / DEMO_MIG_1002).write_text("777 262563\n")
    (tmp_path / "9").write_text("5\n")
    families = Scraper(DemoSource(), job_map=SlurmJobMap(str(tmp_path))).families()
    rows = {tuple(s.labels[k] for k in ("index", "namespace", "pod", "container", "resource", "slurm_job"))
            for s in samples_of(families, "mig_exporter_device_allocation_info")}
    assert rows == {("1", "", "", "", "slurm", "4242"), ("1", "", "", "", "slurm", "4243"),
                    ("1002", "", "", "", "slurm", "777")}
    assert sample_value(families, "mig_exporter_slurm_job_map_read_success") == 1
    assert sample_value(families, "mig_exporter_read_problems") == 1  # the file named 9: no such card
    assert sample_value(families, "mig_exporter_read_success") == 1


def test_a_missing_directory_is_a_read_problem_and_the_gpu_read_stands(tmp_path):
    families = Scraper(DemoSource(), job_map=SlurmJobMap(str(tmp_path / "none"))).families()
    assert sample_value(families, "mig_exporter_slurm_job_map_read_success") == 0
    assert samples_of(families, "mig_exporter_device_allocation_info") == []
    assert sample_value(families, "mig_exporter_read_problems") == 1
    assert sample_value(families, "mig_exporter_read_success") == 1


def test_without_a_directory_nothing_slurm_is_exported():
    families = Scraper(DemoSource()).families()
    assert sample_value(families, "mig_exporter_slurm_job_map_read_success") is None
    assert samples_of(families, "mig_exporter_device_allocation_info") == []


# --- end to end ----------------------------------------------------------------------------------

def test_end_to_end_read_gives_the_slurm_allocation_series(fake_nvidia_smi, tmp_path):
    smi = fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes())
    job_map = tmp_path / "dcgm-job-map"
    job_map.mkdir()
    (job_map / "0").write_text("4242\n")  # card 0 is in MIG mode: all three instances
    (job_map / "1").write_text("5000\n5001\n")
    (job_map / "1001").symlink_to(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "mig_exporter", "read", "--nvidia-smi", str(smi), "--no-kubernetes",
         "--slurm.job-map-dir", str(job_map)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    families = list(text_string_to_metric_families(result.stdout))
    rows = {(s.labels["index"], s.labels["slurm_job"], s.labels["resource"], s.labels["pod"])
            for s in samples_of(families, "mig_exporter_device_allocation_info")}
    assert rows == {("1000", "4242", "slurm", ""), ("1001", "4242", "slurm", ""), ("1002", "4242", "slurm", ""),
                    ("1", "5000", "slurm", ""), ("1", "5001", "slurm", "")}
    assert sample_value(families, "mig_exporter_slurm_job_map_read_success") == 1
    # Each problem is logged once; the demo's pids are not in this host's /proc, which engines report too.
    logged = [line for line in result.stderr.splitlines() if "msg=\"read from nvidia-smi: " in line]
    assert [line for line in logged if "slurm" in line] == [
        line for line in logged if "msg=\"read from nvidia-smi: slurm job map file '1001': a symbolic link, "
        "not followed\"" in line]
    assert sum("slurm" in line for line in logged) == 1
    assert sample_value(families, "mig_exporter_read_problems", {"source": "nvidia-smi"}) == len(logged)
    assert "Traceback" not in result.stderr


def test_the_flag_reads_from_its_environment_variable(fake_nvidia_smi, tmp_path):
    smi = fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes())
    result = subprocess.run(
        [sys.executable, "-m", "mig_exporter", "read", "--nvidia-smi", str(smi), "--no-kubernetes"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "MIG_EXPORTER_SLURM_JOB_MAP_DIR": str(Path(tmp_path) / "none")})
    assert result.returncode == 0, result.stderr
    families = list(text_string_to_metric_families(result.stdout))
    assert sample_value(families, "mig_exporter_slurm_job_map_read_success") == 0


def test_thousands_of_stray_files_are_one_problem_a_read_with_their_count():
    """4096 files that are not job maps, and 4096 of bad lines: two lines for the log, not 8192."""
    strays = [JobMapFile(f"stray-{n:04}", "1\n") for n in range(4096)]
    bad = [JobMapFile("1", "x\n" * 3)] + [JobMapFile(DEMO_MIG_1002, "oops\n")] * 4095
    reading = job_map_reading(DEMO, [*strays, *bad])
    assert reading.problems == (
        "slurm job map: 4096 file(s) name no device read (a card's index or a GPU-/MIG- UUID expected), "
        "first 'stray-0000'",
        "slurm job map: 4096 file(s) with 4098 line(s) not starting with a numeric Slurm job id ($SLURM_JOB_ID) of "
        "at most 64 digits, first '1' (3 line(s), first line 1)",
    )


def test_a_job_id_longer_than_64_digits_is_refused():
    reading = job_map_reading(DEMO, [JobMapFile("1", f"{'9' * 64}\n{'9' * 65}\n{'9' * 100_000}\n")])
    assert reading.allocations == (SlurmAllocation(1, "9" * 64),)
    assert reading.problems == (
        "slurm job map: 1 file(s) with 2 line(s) not starting with a numeric Slurm job id ($SLURM_JOB_ID) of at "
        "most 64 digits, first '1' (2 line(s), first line 2)",
    )
