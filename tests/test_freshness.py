"""Fresh data only: the capacity rules count a node's devices free only while the node reports.

Real Prometheus servers (Debian's 2.42) over real ``mig-exporter serve`` processes, each over a
fake nvidia-smi whose 3g.40gb and 1g.10gb instances are free, with a /proc of the host's PID
namespace (so a device can be free at all). Three ways a node stops reporting, each of which left
its devices free under the old rules (issue 36):

- its exporter is killed behind a federating Prometheus: the leaf writes staleness markers, but
  federated samples carry their timestamps and a scrape writes no staleness marker for a series
  with an explicit timestamp (prometheus/prometheus#11565; 2.48's ``track_timestamps_staleness``,
  prometheus/prometheus#13060, is not in 2.42 and is off by default), so the global's instant
  selectors see the node's last samples for the 5 minutes of the lookback;
- its nvidia-smi fails (read_success 0; the device series leave the scrape);
- the Prometheus restarts while the target is down: a new scrape loop has no previous scrape to
  mark stale, so the samples from before the restart stay current for 5 minutes.

The rules run as shipped, but for their one parameter, the freshness window (``[1m]``,
capacity_rules.FRESH_WITHIN), set to these tests' intervals.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import yaml

from mig_exporter.capacity_rules import FRESH_WITHIN, NOT_REPORTING
from proc_tree import make_proc
from test_capacity import ALERTS, LISTING, ONE_G, THREE_G, free_three_g_xml
from test_prometheus import (
    JOB,
    STARTUP_S,
    Prometheus,
    _prometheus_binary,
    _target_after_scrapes,
    exporter,
    prometheus,
)

pytestmark = pytest.mark.prometheus

CLASSES = (THREE_G, "a100-80g-mig-2g.20gb", ONE_G, "a100-80g")
# The scenario node: 0/mig0 (3g.40gb) and 0/mig2 (1g.10gb) free, 0/mig1 and card 1 in use.
FREE = {THREE_G: 1, "a100-80g-mig-2g.20gb": 0, ONE_G: 1, "a100-80g": 0}
# A node that stopped reporting: each of its 4 devices unknown, none free.
SILENT_UNKNOWN = {c: 1 for c in CLASSES}
SILENT_FREE = {c: 0 for c in CLASSES}

# The freshness window for a 1 s scrape interval behind a 1 s federation: 2 scrape intervals
# (1 s each) plus the federation interval (1 s), as the rules' comment prescribes for [1m].
WINDOW_S = 3
EVAL_S = 1  # the rule evaluation interval of every Prometheus here

# The free-device rule as shipped before issue 36 (docs/capacity.md until then): an instant
# selector with the 5-minute lookback, and nothing that asks whether the node still reports.
OLD_FREE = """
count without (index, card, mig_profile, uuid, gpu_instance, compute_instance, name, device) (
  mig_exporter_device_info
  and ignoring (uuid, gpu_instance, compute_instance, class, name, device)
    (mig_exporter_device_processes == 0)
)
and ignoring (class, version) last_over_time(mig_exporter_build_info[3m])
"""

FREE_RULE = "instance_class:mig_exporter_devices_free:count"
UNKNOWN_RULE = "instance_class:mig_exporter_devices_unknown:count"
DEVICES_RULE = "instance_class:mig_exporter_devices:count"
MEMORY_RULE = "instance_class:mig_exporter_device_memory_free_bytes:sum"


def rules_with_window(directory: Path, window_s: int) -> Path:
    """A copy of deploy/prometheus/alerts.yml whose capacity group has ``[{window_s}s]`` for its
    freshness window: a text substitution of the group's every ``[1m]``, nothing else changed."""
    text = ALERTS.read_text()
    token = f"[{FRESH_WITHIN}]"
    assert token == "[1m]", f"capacity_rules.FRESH_WITHIN is {FRESH_WITHIN}: the rules file says [1m]"
    start = text.index("  - name: mig-exporter.capacity\n")
    end = text.find("\n  - name: ", start + 1)
    assert end > start, "the capacity group is expected before another group"
    group = text[start:end]
    groups = yaml.safe_load(text)["groups"]
    (capacity,) = [g for g in groups if g["name"] == "mig-exporter.capacity"]
    in_exprs = sum(str(r["expr"]).count(token) for r in capacity["rules"])
    replaced = group.count(token)
    assert replaced == in_exprs > 0, f"{replaced} {token} in the group's text, {in_exprs} in its expressions"
    copy = directory / "alerts.yml"
    copy.write_text(text[:start] + group.replace(token, f"[{window_s}s]") + text[end:])
    # The substitution touched the capacity group's expressions only.
    changed = yaml.safe_load(copy.read_text())["groups"]
    assert [g for g in changed if g["name"] != capacity["name"]] == [g for g in groups if g["name"] != capacity["name"]]
    (new,) = [g for g in changed if g["name"] == capacity["name"]]
    assert [str(r["expr"]).replace(f"[{window_s}s]", token) for r in new["rules"]] == [
        str(r["expr"]) for r in capacity["rules"]]
    return copy


def config(targets: list[str], *, rules: Path | None = None, external: dict[str, str] | None = None) -> str:
    """1 s scrapes of ``targets``' /metrics as job mig-exporter."""
    return yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": f"{EVAL_S}s",
                   **({"external_labels": external} if external else {})},
        **({"rule_files": [str(rules)]} if rules else {}),
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": targets}]}],
    })


def federating_config(leaf: Prometheus, rules: Path) -> str:
    """A global Prometheus that federates the exporter's series from ``leaf`` every second, as
    the Prometheus documentation's federation example does (honor_labels, match[])."""
    return yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": f"{EVAL_S}s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{
            "job_name": "federate",
            "honor_labels": True,
            "metrics_path": "/federate",
            "params": {"match[]": ['{__name__=~"mig_exporter_.*"}']},
            "static_configs": [{"targets": [leaf.url.removeprefix("http://")]}],
        }],
    })


def samples(server: Prometheus, selector: str, seconds: int = 60) -> dict[str, list[tuple[float, float]]]:
    """The raw samples of ``selector`` over the last ``seconds``, by class: one per evaluation for
    a recorded series."""
    data = server.get("/api/v1/query", query=f"{selector}[{seconds}s]")
    assert data["resultType"] == "matrix", data
    return {r["metric"].get("class", ""): [(float(t), float(v)) for t, v in r["values"]] for r in data["result"]}


def last_timestamp(server: Prometheus, selector: str) -> float:
    """When ``selector``'s newest raw sample was taken (the scrape's time, for a federated one the
    leaf's scrape's), seconds since the epoch."""
    (series,) = samples(server, selector).values()
    return series[-1][0]


def wait_until(what: str, check, timeout_s: float = STARTUP_S, every_s: float = 0.1):
    """Poll ``check`` until it returns a true value; that value."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if last := check():
            return last
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s}s")


def free_node(fake_nvidia_smi) -> Path:
    """A fake nvidia-smi of its own (so that it can be made to fail) for the free-3g scenario."""
    return fake_nvidia_smi(free_three_g_xml(), LISTING)


@contextmanager
def scenario_exporters(tmp_path: Path, smis: list[Path]) -> Iterator[list]:
    """An exporter over each fake nvidia-smi of ``smis``, seeing the host's PIDs."""
    proc = str(make_proc(tmp_path / "proc", []))
    with _all(exporter(smi, tmp_path, "--no-kubernetes", "--proc.root", proc) for smi in smis) as exporters:
        yield exporters


@contextmanager
def _all(managers) -> Iterator[list]:
    with ExitStack() as stack:
        yield [stack.enter_context(m) for m in managers]


def fail_from_now_on(smi: Path, failing: Path) -> None:
    """Make the fake nvidia-smi at ``smi`` fail from its next run on: the failing fake's script
    takes its place in one rename (a run in progress keeps the old one)."""
    staged = smi.with_name("nvidia-smi.failing")
    shutil.copy2(failing, staged)
    os.replace(staged, smi)


def by_class(server: Prometheus, rule: str, instance: str) -> dict[str, float]:
    """A node rule's value for each class on ``instance``, now."""
    return {r["metric"]["class"]: float(r["value"][1]) for r in server.query(f'{rule}{{instance="{instance}"}}')}


def node_counts(server: Prometheus, instance: str) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """free, unknown and devices by class of ``instance``, as the recording rules have them now."""
    return (by_class(server, FREE_RULE, instance), by_class(server, UNKNOWN_RULE, instance),
            by_class(server, DEVICES_RULE, instance))


def fleet(server: Prometheus, rule: str) -> dict[str, float]:
    """A fleet rule's value by class."""
    return {r["metric"]["class"]: float(r["value"][1]) for r in server.query(rule)}


def old_free(server: Prometheus, instance: str) -> dict[str, float]:
    return {r["metric"]["class"]: float(r["value"][1]) for r in server.query(OLD_FREE)
            if r["metric"]["instance"] == instance}


def test_a_killed_exporter_behind_a_federating_prometheus_is_unknown_within_the_window(fake_nvidia_smi, tmp_path):
    _prometheus_binary()
    rules = rules_with_window(tmp_path, WINDOW_S)
    (tmp_path / "leaf").mkdir()
    (tmp_path / "global").mkdir()
    with scenario_exporters(tmp_path, [free_node(fake_nvidia_smi) for _ in range(2)]) as (killed, kept), \
            prometheus("", tmp_path / "leaf", config([killed.address, kept.address],
                                                     external={"cluster": "eu-1"})) as leaf, \
            prometheus("", tmp_path / "global", federating_config(leaf, rules)) as glob:
        for e in (killed, kept):
            assert _target_after_scrapes(leaf, e.address)["health"] == "up"
        assert leaf.get("/api/v1/rules")["groups"] == []  # the leaf evaluates nothing

        def both_free() -> bool:
            return all(node_counts(glob, e.address)[0] == FREE for e in (killed, kept))

        wait_until("the global counts both nodes' free devices", both_free)
        (series,) = glob.query(f'{FREE_RULE}{{instance="{killed.address}",class="{THREE_G}"}}')
        # The leaf's external label and the exporter's target labels, kept through federation and the rule.
        assert series["metric"] == {"__name__": FREE_RULE, "class": THREE_G, "cluster": "eu-1",
                                    "instance": killed.address, "job": JOB}
        assert fleet(glob, "class:mig_exporter_devices_free:count")[THREE_G] == 2
        assert node_counts(glob, killed.address)[1] == {c: 0 for c in CLASSES}

        # Federated samples arrive up to a scrape interval plus a federation interval late: with
        # the window at 3 s a reporting node stays free at every evaluation, it does not flicker.
        steady_from = time.time()
        time.sleep(3 * EVAL_S)
        for e in (killed, kept):
            steady = samples(glob, f'{FREE_RULE}{{instance="{e.address}",class="{THREE_G}"}}', 10)[THREE_G]
            values = [v for t, v in steady if t >= steady_from]
            assert len(values) >= 2 and set(values) == {1.0}, steady
        # Why: the age of the global's newest read of each node, every 100 ms of those 3 s.
        ages = {r["metric"]["instance"]: float(r["value"][1]) for r in glob.query(
            "max_over_time((time() - timestamp(mig_exporter_read_success))[3s:100ms])")}
        assert ages.keys() == {killed.address, kept.address} and max(ages.values()) < WINDOW_S, ages

        killed.process.kill()  # SIGKILL: no goodbye, the port closes
        killed_at = time.time()
        assert killed.process.wait(timeout=5) == -9

        def silent() -> tuple | None:
            free, unknown, devices = node_counts(glob, killed.address)
            return (free, unknown, devices) if free == SILENT_FREE and unknown == SILENT_UNKNOWN else None

        _, _, devices = wait_until("the killed node's devices counted unknown", silent, 15)
        seen_after_s = time.time() - killed_at
        assert devices == SILENT_UNKNOWN  # its 4 devices, as of its last read

        # At this same moment the old rule still counts the killed node's free devices: the global
        # holds its last federated samples, with no staleness marker (prometheus/prometheus#11565).
        assert old_free(glob, killed.address) == {THREE_G: 1, ONE_G: 1}
        assert len(glob.query(f'mig_exporter_device_info{{instance="{killed.address}"}}')) == 4
        # The leaf, which scraped it, wrote staleness markers: there the old rule has dropped it.
        assert old_free(leaf, killed.address) == {}
        assert leaf.query(f'up{{instance="{killed.address}"}}')[0]["value"][1] == "0"

        # The kept node still reports, and is still free.
        assert node_counts(glob, kept.address)[0] == FREE
        assert fleet(glob, "class:mig_exporter_devices_free:count") == FREE
        assert fleet(glob, "class:mig_exporter_devices_unknown:count") == SILENT_UNKNOWN

        # In Prometheus' own time: the killed node's last federated read was taken at t_s (a leaf
        # scrape, before the kill); it counted free until that read left the 3 s window, and the
        # first evaluation after (one evaluation interval at most) counted it 0: free at every
        # evaluation before, 0 at every evaluation since.
        t_s = last_timestamp(glob, f'mig_exporter_read_success{{instance="{killed.address}"}}')
        assert t_s <= killed_at
        history = [(t, v) for t, v in samples(glob, f'{FREE_RULE}{{instance="{killed.address}",class="{THREE_G}"}}')[
            THREE_G] if t >= steady_from]
        first_zero = next(t for t, v in history if v == 0)
        assert [v for t, v in history] == [1.0 if t < first_zero else 0.0 for t, v in history]
        counted_free_for_s = first_zero - t_s
        assert WINDOW_S < counted_free_for_s <= WINDOW_S + EVAL_S, (t_s, first_zero)
        # In the test's wall clock: the window (3 s) and an evaluation (1 s) after the kill, with
        # 2 s for the query and for a loaded machine.
        assert seen_after_s <= WINDOW_S + EVAL_S + 2, seen_after_s
        print(f"steady: newest federated read at most {max(ages.values()):.3f} s old; "
              f"killed node: last read {killed_at - t_s:.3f} s before the kill; "
              f"counted free {counted_free_for_s:.3f} s after that read (Prometheus time); "
              f"seen unknown in the global {seen_after_s:.3f} s after the kill (wall clock)")


def test_a_node_whose_nvidia_smi_fails_counts_its_devices_unknown(fake_nvidia_smi, tmp_path):
    """A read that fails: read_success 0, the device series leave the scrape. In the leaf, which
    evaluates the rules too, and in a global that federates it: 0 free, its devices as of its last
    good read unknown. A node that never read well has no devices: nothing free, nothing unknown."""
    _prometheus_binary()
    rules = rules_with_window(tmp_path, WINDOW_S)
    (tmp_path / "leaf").mkdir()
    (tmp_path / "global").mkdir()
    failing = fake_nvidia_smi(mode="fail", list_mode="fail")
    smis = [free_node(fake_nvidia_smi), free_node(fake_nvidia_smi), failing]
    with scenario_exporters(tmp_path, smis) as (good, failed, never), \
            prometheus("", tmp_path / "leaf", config([good.address, failed.address, never.address], rules=rules,
                                                     external={"cluster": "eu-1"})) as leaf, \
            prometheus("", tmp_path / "global", federating_config(leaf, rules)) as glob:
        servers = {"leaf": leaf, "global": glob}
        for e in (good, failed, never):
            assert _target_after_scrapes(leaf, e.address)["health"] == "up"
        for name, server in servers.items():
            wait_until(f"{name} counts the free devices",
                       lambda s=server: all(node_counts(s, e.address)[0] == FREE for e in (good, failed)))
            # No good read, no devices: nothing of the node in any capacity rule.
            assert node_counts(server, never.address) == ({}, {}, {}), name
            assert server.query(f'mig_exporter_read_success{{instance="{never.address}"}}')[0]["value"][1] == "0"

        counted_from = time.time()
        fail_from_now_on(smis[1], failing)
        failed_at = time.time()

        def read_failed(server: Prometheus) -> bool:
            return server.query(f'mig_exporter_read_success{{instance="{failed.address}"}} == 0') != []

        seen_after_s: dict[str, float] = {}
        for name, server in servers.items():
            wait_until(f"{name}: the failed node's devices unknown",
                       lambda s=server: read_failed(s) and node_counts(s, failed.address)[:2] == (
                           SILENT_FREE, SILENT_UNKNOWN), 15)
            seen_after_s[name] = time.time() - failed_at
        for name, server in servers.items():
            free, unknown, devices = node_counts(server, failed.address)
            assert (free, unknown, devices) == (SILENT_FREE, SILENT_UNKNOWN, SILENT_UNKNOWN), name
            assert server.query(f'{MEMORY_RULE}{{instance="{failed.address}"}}') == [], name
            assert node_counts(server, good.address)[0] == FREE, name
            assert node_counts(server, never.address) == ({}, {}, {}), name
            assert fleet(server, "class:mig_exporter_devices_free:count") == FREE, name
            # fleet's "not reporting" line: the node that failed and the one that never read.
            not_reporting = {r["metric"]["instance"] for r in server.query(
                NOT_REPORTING.replace(f"[{FRESH_WITHIN}]", f"[{WINDOW_S}s]"))}
            assert not_reporting == {failed.address, never.address}, name
        # The old rule: the leaf's staleness markers drop the failed node's device series; the
        # global keeps the last federated ones, free, for the 5 minutes of the lookback.
        assert old_free(leaf, failed.address) == {}
        assert old_free(glob, failed.address) == {THREE_G: 1, ONE_G: 1}
        assert all(t <= WINDOW_S + EVAL_S + 2 for t in seen_after_s.values()), seen_after_s
        # In Prometheus' time, from the leaf's first failed read (t_f) to the first evaluation that
        # counted the node 0 free: in the leaf, the next evaluation; in the global, the next
        # federation and the next evaluation. Each with a scrape's timeout (1 s) for the sample to
        # be stored after its timestamp. The window plays no part: read_success says 0 at once.
        t_f = min(t for t, v in samples(leaf, f'mig_exporter_read_success{{instance="{failed.address}"}}', 30)[""]
                  if v == 0 and t >= failed_at - 1)
        lag: dict[str, float] = {}
        for name, server in servers.items():
            selector = f'{FREE_RULE}{{instance="{failed.address}",class="{THREE_G}"}}'
            history = [(t, v) for t, v in samples(server, selector, 30)[THREE_G] if t >= counted_from]
            lag[name] = next(t for t, v in history if v == 0 and t >= t_f) - t_f
            assert [v for t, v in history if t < t_f] == [1.0] * len([t for t, _ in history if t < t_f])
            assert {v for t, v in history if t >= t_f + lag[name]} == {0.0}
        assert lag["leaf"] <= EVAL_S + 1 and lag["global"] <= 1 + EVAL_S + 1, lag
        print("failed read seen unknown after " + ", ".join(f"{k} {v:.3f} s" for k, v in seen_after_s.items())
              + " (wall clock); first 0-free evaluation after the first failed read: "
              + ", ".join(f"{k} {v:.3f} s" for k, v in lag.items()) + " (Prometheus time)")
        assert "couldn't communicate with the NVIDIA driver" in failed.log.text()


def test_a_prometheus_restarted_while_the_target_is_down_never_counts_it_free(fake_nvidia_smi, tmp_path):
    """Prometheus stops (SIGTERM), the exporter is killed, Prometheus starts again on its data:
    the target is down, and a new scrape loop writes no staleness marker for the samples from
    before the restart. No evaluation after the restart counts the node free."""
    _prometheus_binary()
    rules = rules_with_window(tmp_path, WINDOW_S)
    with scenario_exporters(tmp_path, [free_node(fake_nvidia_smi)]) as (node,):
        with prometheus(node.address, tmp_path, rule_files=(rules,)) as before:
            assert _target_after_scrapes(before, node.address)["health"] == "up"
            wait_until("the node's devices counted free", lambda: node_counts(before, node.address)[0] == FREE)
        assert before.process.returncode == 0, before.log()
        stopped_at = time.time()
        node.process.kill()
        assert node.process.wait(timeout=5) == -9
        # The target stays down for longer than the window before Prometheus is back: the
        # question is whether anything but the age of the node's newest read counts it.
        time.sleep(max(0.0, stopped_at + WINDOW_S + 0.5 - time.time()))

        restart_at = time.time()
        with prometheus(node.address, tmp_path, rule_files=(rules,)) as after:
            ready_at = time.time()
            # What was recorded before the restart, read before the first evaluation since: the
            # recorded series, too, carry no staleness marker across a restart.
            early = {r["metric"]["class"]: float(r["value"][1])
                     for r in after.query(f'{FREE_RULE}{{instance="{node.address}"}}')}
            t_s = last_timestamp(after, f'mig_exporter_read_success{{instance="{node.address}"}}')
            assert t_s < stopped_at and restart_at - t_s > WINDOW_S

            # Every evaluation since the restart, as recorded: (time, class) -> free devices.
            recorded: dict[tuple[float, str], float] = {}

            def poll() -> None:
                for cls, history in samples(after, f'{FREE_RULE}{{instance="{node.address}"}}', 30).items():
                    recorded.update({(t, cls): v for t, v in history if t > restart_at})

            def evaluated() -> bool:
                poll()
                return len(recorded) >= len(CLASSES)

            wait_until("the first evaluation after the restart", evaluated, every_s=0.25)
            first_eval = min(t for t, _ in recorded)
            assert {cls: v for (t, cls), v in recorded.items() if t == first_eval} == SILENT_FREE
            free, unknown, devices = node_counts(after, node.address)
            assert (free, unknown, devices) == (SILENT_FREE, SILENT_UNKNOWN, SILENT_UNKNOWN)
            # The samples from before the restart are there with no staleness marker: the old
            # rule counts the node free still.
            assert len(after.query(f'mig_exporter_device_info{{instance="{node.address}"}}')) == 4
            assert old_free(after, node.address) == {THREE_G: 1, ONE_G: 1}
            # The first scrape after the restart comes later than the first evaluation: until then
            # the rules have nothing from the target but its samples from before the restart.
            wait_until("the target seen down", lambda: after.query(f'up{{instance="{node.address}"}} == 0'))
            first_scrape = samples(after, f'up{{instance="{node.address}"}}', 30)[""]
            down_at = min(t for t, v in first_scrape if t > restart_at)

            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                poll()
                assert set(recorded.values()) == {0.0}, recorded
                time.sleep(0.25)
            assert len({t for t, _ in recorded}) >= 4, recorded

            # Every evaluation since the restart, each class: 0 free, 1 unknown.
            now = time.time()
            for rule, expected in ((FREE_RULE, SILENT_FREE), (UNKNOWN_RULE, SILENT_UNKNOWN)):
                data = after.get("/api/v1/query_range", query=f'{rule}{{instance="{node.address}"}}',
                                 start=f"{first_eval:.3f}", end=f"{now:.3f}", step="0.25")
                assert data["resultType"] == "matrix"
                values = {r["metric"]["class"]: {float(v) for _, v in r["values"]} for r in data["result"]}
                assert values == {c: {n} for c, n in expected.items()}, (rule, values)
                assert all(len(r["values"]) >= 4 * (now - first_eval) - 1 for r in data["result"])
            print(f"restart: node's last read {restart_at - t_s:.3f} s before the restart; Prometheus ready "
                  f"{ready_at - restart_at:.3f} s after it, first evaluation {first_eval - restart_at:.3f} s after it, "
                  f"first scrape (up 0) {down_at - restart_at:.3f} s after it; "
                  f"free as recorded before the restart, read right at ready: {early}")
