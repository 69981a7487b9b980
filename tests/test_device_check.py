"""scripts/device-check, run as on a real host: over the fake nvidia-smi and the C fake
libnvidia-ml serving the same machine, so both of our paths read it."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, fixture_bytes

SCRIPT = REPO / "scripts" / "device-check"
SCENARIO = "h100-mig-processes"


def test_device_check_leaves_the_drivers_outputs_both_reads_doctor_and_timings_in_one_folder(
        fake_nvidia_smi, fake_libnvml_env, tmp_path):
    smi = fake_nvidia_smi(fixture_bytes(f"{SCENARIO}.xml"), fixture_bytes(f"{SCENARIO}.L.txt"))
    env = {**os.environ, **fake_libnvml_env(SCENARIO), "NVIDIA_SMI": str(smi),
           "MIG_EXPORTER": f"{sys.executable} -m mig_exporter", "SCRAPES": "3", "GPM_INTERVAL_S": "0.2"}
    out = tmp_path / "check"
    done = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "nvidia-smi-q-x.xml").read_bytes() == fixture_bytes(f"{SCENARIO}.xml")
    assert (out / "nvidia-smi-L.txt").read_bytes() == fixture_bytes(f"{SCENARIO}.L.txt")
    assert (out / "mig-devices-kept.txt").read_text().splitlines() == [
        "mig_device elements: -q -x 4, -q -x -d MEMORY,PIDS 4", "kept"]
    for path in ("nvidia-smi", "nvml"):
        assert f'mig_exporter_read_success{{source="{path}"}} 1.0' in (out / f"read-{path}.prom").read_text()
    # The paths agree on every series but those only NVML gives: energy, and GPM's activity (nvidia-smi's
    # XML reads no activity: not_read). read takes a first GPM sample and waits a second, as doctor does,
    # so its NVML read has each GPU instance's activity over the C library: gpu_burn's (1002) busy.
    differences = [line for line in (out / "read-differences.txt").read_text().splitlines()
                   if line[:1] in "<>"]
    assert differences and all(line.startswith(("> mig_exporter_card_energy_joules_total",
                                                "< mig_exporter_device_activity_unknown",
                                                "> mig_exporter_device_activity_unknown",
                                                "> mig_exporter_device_activity_window_seconds",
                                                "> mig_exporter_device_graphics_activity_ratio",
                                                "> mig_exporter_device_sm_activity_ratio",
                                                "> mig_exporter_device_sm_occupancy_ratio",
                                                "> mig_exporter_device_tensor_activity_ratio",
                                                "> mig_exporter_device_dram_bandwidth_ratio")) for line in differences)
    nvml_read = (out / "read-nvml.prom").read_text()
    assert "first_sample" not in nvml_read
    busy = [line for line in nvml_read.splitlines()
            if line.startswith("mig_exporter_device_graphics_activity_ratio")]
    family = "mig_exporter_device_graphics_activity_ratio"
    assert busy == [f'{family}{{card="0",index="1000",mig_profile="3g.40gb"}} 0.0',
                    f'{family}{{card="0",index="1001",mig_profile="2g.20gb"}} 0.0',
                    f'{family}{{card="0",index="1002",mig_profile="1g.10gb"}} 0.99',
                    f'{family}{{card="0",index="1003",mig_profile="1g.10gb"}} 0.0'], busy
    # The raw GPM read beside ours: gpu_burn's GPU instance 9 busy, and no MIG memory read moved.
    raw = (out / "nvml-activity-raw.txt").read_text()
    assert "gpm supported: 1" in raw and "gpu instance 9 graphics: rc 0 value 99.0" in raw
    assert raw.count(": same") == 4 and "CHANGED" not in raw
    # doctor waited for a second GPM sample: activity, not "one sample so far".
    assert "activity: graphics 99%, SM 97%" in (out / "doctor.txt").read_text()
    assert (out / "nvidia-smi-pmon.txt.rc").read_text() == "0\n"
    # pmon timed, alone and under -i for the first card (this machine has one: no last card of its own)
    timings = (out / "nvidia-smi-pmon-timings.txt").read_text().splitlines()
    assert [line for line in timings if line.startswith("  ")] == [
        "  pmon -c 1 -s u: rc 0", "  pmon -c 1 -s u -i 0: rc 0"], timings
    assert all(float(line) >= 0 for line in timings if not line.startswith("  "))
    assert "1000 GPM samples allocated and filled: VmRSS" in raw and "resident bytes a sample" in raw
    assert "GPU 0" in (out / "doctor.txt").read_text() or "card 0" in (out / "doctor.txt").read_text()
    timings = (out / "scrape-timings.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in timings] == ["nvidia-smi", "nvml"]
    assert all("3 scrapes, read_success 1" in line for line in timings)
    # It only asked: every nvidia-smi call was a query.
    calls = [line.split()[1:] for line in (smi.parent / "calls.log").read_text().splitlines()]
    assert calls and all(args[0] in ("-q", "-L", "--version", "pmon", "dmon") for args in calls)
