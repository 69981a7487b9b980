"""docs/metrics.md and the code agree; the README gives its two commands."""

from __future__ import annotations

import re

from conftest import REPO, scenario

from mig_exporter.attribution import EngineWatch
from mig_exporter.engines import DEFAULT_SETTINGS
from mig_exporter.errors import CommandFailed
from mig_exporter.procfs import ProcfsSource
from mig_exporter.scrape import Scraper
from mig_exporter.source_demo import DemoProcs, DemoSource
from proc_tree import CONTAINER_NS, make_proc

SCENARIOS = ["h100-mig-processes", "h200-shared-gpu-instance", "a100-mig-nothing-carved", "a100-mig-pending",
             "na-memory"]


class _Source:
    name = "nvidia-smi"

    def __init__(self, snapshot=None, error=None):
        self.snapshot, self.error = snapshot, error

    def read(self, timeout_s=None):
        if self.error:
            raise self.error
        return self.snapshot

    def ready(self):
        return True, ""

    def describe(self):
        return ""


def _documented() -> dict[str, tuple[str, set[str]]]:
    rows = {}
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        m = re.match(r"^\| `(mig_exporter_[a-z_]+)` \| (\w+) \| ([^|]*) \|", line)
        if m:
            labels = set(re.findall(r"`([a-z_]+)`", m.group(3)))
            rows[m.group(1)] = (m.group(2), labels)
    return rows


def _emitted(tmp_path) -> dict[str, tuple[str, set[str]]]:
    """Every family the code emits over all scenarios, a failed read and the
    demo, with and without engines: the demo's host, a /proc outside the host
    namespace, and a failed GPU read beside a readable /proc."""
    failing = _Source(error=CommandFailed("nvidia-smi: exit status 9"))
    scrapers = [Scraper(_Source(scenario(name))) for name in SCENARIOS]
    scrapers += [Scraper(DemoSource()), Scraper(failing)]
    container = str(make_proc(tmp_path / "container", [], namespace=CONTAINER_NS))
    scrapers += [
        Scraper(DemoSource(), EngineWatch(DEFAULT_SETTINGS, DemoProcs())),
        Scraper(DemoSource(), EngineWatch(DEFAULT_SETTINGS, ProcfsSource(container))),
        Scraper(failing, EngineWatch(DEFAULT_SETTINGS, DemoProcs())),
    ]
    found: dict[str, tuple[str, set[str]]] = {}
    for scraper in scrapers:
        for family in scraper.families():
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = {k for s in family.samples for k in s.labels}
            kind, seen = found.get(name, (family.type, set()))
            found[name] = (kind, seen | labels)
    return found


def test_every_emitted_metric_is_documented_with_its_type_and_labels(tmp_path):
    assert _emitted(tmp_path) == _documented()


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
