"""docs/metrics.md and the code agree, for /metrics and /probe; the README gives its two commands."""

from __future__ import annotations

import dataclasses
import re

import pytest

import fake_nvml as fake_nvml_scenarios
from conftest import REPO, require_real_corpus, scenario
from kube_node import PODS, make_kubelet_logs
from mig_exporter.config.file import ProbeTarget, parse_config
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import CommandFailed
from mig_exporter.engines.attribution import EngineReader
from mig_exporter.engines.rules import DEFAULT_SETTINGS
from mig_exporter.host.jobmap import SlurmJobMap
from mig_exporter.host.owners import OwnerReader
from mig_exporter.host.procfs import ProcfsSource
from mig_exporter.kubernetes.podresources import PodResourcesClient
from mig_exporter.kubernetes.pods import PodReader
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.scrape import ReadOutcome, Scraper
from mig_exporter.model.health import XidSeen
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from mig_exporter.sources.demo import DemoProcs, DemoSource
from mig_exporter.sources.kmsg import KmsgReader
from mig_exporter.sources.nvml import NvmlSource
from mig_exporter.web.probe import Prober, ProbeResult
from proc_tree import CONTAINER_NS, make_proc
from test_activity_families import _shared_gi, _two_on_one_card
from test_owners import HPC
from test_pods import demo_proc
from test_source_nvml import NVML_ONLY_FAMILIES

SCENARIOS = ["h100-mig-processes", "h200-shared-gpu-instance", "a100-mig-nothing-carved", "a100-mig-pending",
             "na-memory"]


class _Source:
    def __init__(self, snapshot=None, error=None, name="nvidia-smi"):
        self.snapshot, self.error, self.name = snapshot, error, name

    def read(self, deadline=None):
        if self.error:
            raise self.error
        return self.snapshot

    def ready(self):
        return True, ""

    def describe(self):
        return ""


def _documented(section: str = "/metrics") -> dict[str, tuple[str, set[str]]]:
    """The metric table of docs/metrics.md: the main one (``/metrics``), or the one under the
    ``## /probe`` heading."""
    text = (REPO / "docs" / "metrics.md").read_text()
    main, _, probe = text.partition("\n## /probe\n")
    rows = {}
    for line in (probe if section == "/probe" else main).splitlines():
        m = re.match(r"^\| `([a-z_]+)` \| (\w+) \| ([^|]*) \|", line)
        if m:
            labels = set(re.findall(r"`([a-z_]+)`", m.group(3)))
            rows[m.group(1)] = (m.group(2), labels)
    return rows


def _kinds(families) -> dict[str, tuple[str, set[str]]]:
    found: dict[str, tuple[str, set[str]]] = {}
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels}
        kind, seen = found.get(name, (family.type, set()))
        found[name] = (kind, seen | labels)
    return found


def _prober() -> Prober:
    config = parse_config("probe_targets:\n  gpu-a: {command: [nvidia-smi]}\n", "mig.yml")
    return Prober(config, config_file="mig.yml")


def _emitted(tmp_path, kubelet, nvml_snapshots) -> dict[str, tuple[str, set[str]]]:
    """Every family /metrics emits over all scenarios, the real corpus, the NVML-only
    scenarios, an XID listener, a failed read and the demo, with and without engines (the
    demo's host, a /proc outside the host namespace, a failed GPU read beside a readable /proc), with pods (the
    Kubernetes node of kube_node.py), with a Slurm job-map directory, with
    owners (a Slurm and systemd host), and with a config file, the probe counters."""
    failing = _Source(error=CommandFailed("nvidia-smi: exit status 9"))
    scrapers = [Scraper(_Source(scenario(name))) for name in SCENARIOS]
    scrapers += [Scraper(DemoSource()), Scraper(failing)]
    container = str(make_proc(tmp_path / "container", [], namespace=CONTAINER_NS))
    scrapers += [
        Scraper(DemoSource(), EngineReader(DEFAULT_SETTINGS, DemoProcs())),
        Scraper(DemoSource(), EngineReader(DEFAULT_SETTINGS, ProcfsSource(container))),
        Scraper(failing, EngineReader(DEFAULT_SETTINGS, DemoProcs())),
        Scraper(DemoSource(), pods=PodReader(str(demo_proc(tmp_path / "node")), PodResourcesClient(kubelet.socket_path),
                                            str(make_kubelet_logs(tmp_path / "log")))),
        Scraper(DemoSource(), job_map=SlurmJobMap(str(_job_map(tmp_path / "job-map")))),
        Scraper(DemoSource(), owners=OwnerReader(str(make_proc(tmp_path / "hpc", HPC)))),
    ]
    scrapers += [Scraper(_Source(snapshot)) for snapshot in _real_corpus()]
    scrapers += [Scraper(_Source(snapshot, name="nvml")) for snapshot in nvml_snapshots]
    # Activity as the NVML path reads it where measured (issue 39): GPM on a Hopper in MIG mode, and
    # the per-process samples of a whole card.
    scrapers += [Scraper(_Source(snapshot, name="nvml")) for snapshot in (_shared_gi(), _two_on_one_card())]
    xids = Scraper(_Source(scenario("h100-mig-processes"), name="nvml"))
    xids.xids = _Xids()  # type: ignore[assignment]
    scrapers.append(xids)
    kernel_log = Scraper(DemoSource())  # the kernel's XID lines, as --demo reads them
    kernel_log.kmsg = KmsgReader(str(REPO / "src" / "mig_exporter" / "samples" / "demo-kmsg.txt"))
    scrapers.append(kernel_log)
    families = [f for scraper in scrapers for f in scraper.families()]
    # A whole /metrics answer: the scrape's families, then what it costs (mig_exporter_scrape_series).
    families += Exporter(Scraper(DemoSource())).answer(Deadline.after(30)).families
    return _kinds([*families, *_prober().collect()])


class _Xids:
    """What serve's XID listener hands a scrape: one XID 48 on card 0."""

    def seen(self, snapshot):
        return [XidSeen(card=0, device_index=1000, xid=48, seen=1, last_seconds=1.7e9)]


def _real_corpus():
    """Every real nvidia-smi -q -x output: the card-health families the samples leave out
    (retirement, repairs, clock-event counters) come from drivers that write them."""
    corpus = require_real_corpus()
    return [snapshot_from_smi(path.read_bytes(), None) for path in sorted(corpus.glob("*.xml"))]


@pytest.fixture
def nvml_snapshots(fake_nvml_lib):
    """The NVML-only scenarios read through the real pynvml over the fake libnvidia-ml: the
    energy counter and the MIG instances' own ECC count are NVML's."""
    snapshots = []
    # A 590 driver's H100, which answers whether it has unrepairable memory, and a card lost.
    h100 = fake_nvml_scenarios.h100_r570_sram_split()
    (card,) = h100.cards
    on_590 = dataclasses.replace(h100, driver_version="590.44.01", cards=(
        dataclasses.replace(card, health=dataclasses.replace(card.health, unrepairable_memory=False)),))
    for fake in (fake_nvml_scenarios.demo(), fake_nvml_scenarios.pascal_page_retirement(), h100, on_590,
                 fake_nvml_scenarios.one_lost_one_no_permission()):
        fake_nvml_lib(fake)
        snapshots.append(NvmlSource().read())
    return snapshots


def _job_map(directory):
    directory.mkdir()
    (directory / "1").write_text("4242\n")
    return directory


def _emitted_by_probe() -> dict[str, tuple[str, set[str]]]:
    """Every family /probe emits over all scenarios, the real corpus and a failed read."""
    target = ProbeTarget("gpu-a", ("nvidia-smi",))
    outcomes = [ReadOutcome(scenario(name), 0.2) for name in SCENARIOS]
    outcomes += [ReadOutcome(snapshot, 0.2) for snapshot in _real_corpus()]
    # Every real 570+ output writes sram_threshold_exceeded N/A (no ECC): one as a card with ECC writes it.
    ecc_card = (require_real_corpus() / "telegraf-dual-rtx-a5000-v13-drv590.xml").read_bytes()
    outcomes.append(ReadOutcome(snapshot_from_smi(ecc_card.replace(
        b"<sram_threshold_exceeded>N/A<", b"<sram_threshold_exceeded>No<"), None), 0.2))
    outcomes.append(ReadOutcome(None, 0.2, "nvidia-smi: exit status 9"))
    return _kinds([f for outcome in outcomes for f in ProbeResult(target, outcome, 0.2).collect()])


def test_every_emitted_metric_is_documented_with_its_type_and_labels(tmp_path, fake_kubelet, nvml_snapshots):
    assert _emitted(tmp_path, fake_kubelet(PODS), nvml_snapshots) == _documented()


def test_every_probe_metric_is_documented_and_the_rest_are_those_of_metrics():
    emitted = _emitted_by_probe()
    own = {name: kind for name, kind in emitted.items() if name.startswith("probe_")}
    assert own == _documented("/probe")
    shared = {name: kind for name, kind in emitted.items() if not name.startswith("probe_")}
    # A probe reads nvidia-smi: the NVML-only families have no rows there, so they are not emitted at all.
    nvml_only = {f"{family}_total" for family in NVML_ONLY_FAMILIES}
    assert not nvml_only & shared.keys()
    assert all(labels for _, labels in shared.values())
    assert shared == {name: _documented()[name] for name in shared}
    assert {name.split("_")[2] for name in shared} == {"device", "process", "card"}


def test_the_config_examples_in_the_docs_are_valid():
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "probe.md").read_text(), re.S)
    blocks += re.findall(r"```yaml\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    configs = [b for b in blocks if "probe_targets:" in b]
    assert len(configs) == 2, "docs/probe.md and the README each show a config file"
    for text in configs:
        assert parse_config(text).probe_targets


def test_readme_first_screen_gives_the_two_commands():
    readme = (REPO / "README.md").read_text()
    first_screen = "\n".join(readme.splitlines()[:40])
    blocks = re.findall(r"```(?:sh|bash|console)\n(.*?)```", first_screen, re.S)
    commands = [line for block in blocks for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, commands
    assert "pip install ." in commands[0] and "mig-exporter serve --demo" in commands[0]
    assert commands[1] == "./scripts/test"
    assert "python -m pytest" in (REPO / "scripts" / "test").read_text()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert commands[1] in ci_lines, "CI must run the README's test command"


def test_the_readme_pip_line_names_every_runtime_dependency():
    import tomllib

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0] for d in dependencies}
    (line,) = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("pip install .")]
    assert all(name in line for name in names), f"{line!r} leaves out some of {sorted(names)}"


def test_the_readme_names_every_debian_package_scripts_test_installs():
    script = (REPO / "scripts" / "test").read_text()
    packages = set()
    for tools in re.findall(r"^\s*tools\+?=\(([^)]*)\)", script, re.M):
        packages |= {tool.split(":", 1)[1] for tool in tools.split()}
    assert packages == {"prometheus", "victoria-metrics", "systemd", "wrk", "iproute2", "chromium", "buildah",
                        "debootstrap", "docker-registry", "nodejs", "npm"}
    first_screen = "\n".join((REPO / "README.md").read_text().splitlines()[:40])
    assert all(f"`{package}`" in first_screen for package in packages)
    assert "sudo" in first_screen and "sudo" in script


def test_the_readme_gives_each_commands_own_log_level_default():
    from mig_exporter.cli import cli

    defaults = {name: next(p.default for p in cli.commands[name].params if p.name == "log_level")
                for name in ("serve", "read", "doctor")}
    assert defaults == {"serve": "info", "read": "warning", "doctor": "warning"}
    row = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `--log.level`"))
    assert "`info` for `serve`, `warning` for `read` and `doctor`" in row


def test_the_readme_lists_every_status_the_server_refuses_with():
    server = (REPO / "src" / "mig_exporter" / "web" / "server.py").read_text()
    codes = {int(c) for c in re.findall(r"_fail\((\d{3})", server)}
    readme = (REPO / "README.md").read_text()
    listed = re.search(r"Every answer that is not a success \(([^)]*)\)", readme.replace("\n", " "))
    assert listed, "the README lists the refusals it logs"
    assert codes <= {int(c) for c in re.findall(r"\d{3}", listed.group(1))}
