"""The snapshot made of every nvidia-smi output we have is the one the parser made before
``<processes>`` were read the fast way (commit 3fd01ef): our fixtures, the real corpus, the
benchmark's scenarios, and some 900 variants bent in the ways XML allows (tests/smi_variants.py).
The expectations are digests that code wrote (tests/fixtures/nvidia-smi/snapshot-digests.json)."""

from __future__ import annotations

import json
import sys

import pytest

import smi_variants
from conftest import FIXTURES, REPO, SAMPLES, require_real_corpus

sys.path.insert(0, str(REPO))
from benchmarks import scenarios

EXPECTED = json.loads((FIXTURES / "snapshot-digests.json").read_text())


def _mismatches(group: str, cases: dict[str, tuple[bytes, bytes | None]]) -> list[str]:
    assert set(cases) == set(EXPECTED[group])
    return [name for name, (xml, listing) in cases.items()
            if smi_variants.digest(smi_variants.outcome(xml, listing)) != EXPECTED[group][name]]


def test_fixtures_and_their_variants_read_as_before():
    assert _mismatches("fixtures", smi_variants.fixture_cases(FIXTURES, SAMPLES)) == []


def test_the_real_corpus_and_its_variants_read_as_before():
    corpus = require_real_corpus()
    assert _mismatches("corpus", smi_variants.corpus_cases(corpus, FIXTURES)) == []


def test_the_benchmark_scenarios_read_as_before():
    assert _mismatches("scenarios", smi_variants.scenario_cases(scenarios)) == []


def test_the_variants_are_mostly_readable_and_cover_processes():
    # A comparison of parse errors alone would prove little.
    cases = smi_variants.fixture_cases(FIXTURES, SAMPLES)
    outcomes = [smi_variants.outcome(xml, listing) for xml, listing in cases.values()]
    read = [o for o in outcomes if o[0] == "Snapshot"]
    assert len(read) > 0.8 * len(outcomes)
    assert sum(1 for o in read if o[1]["processes"]) > 0.6 * len(outcomes)


@pytest.mark.parametrize("changed", ["pid", "used", "name"])
def test_a_changed_process_value_is_caught(changed):
    xml, listing = smi_variants.fixture_cases(FIXTURES, SAMPLES)["fixture:h100-mig-processes.xml"]
    bent = {"pid": xml.replace(b"<pid>21180</pid>", b"<pid>21181</pid>"),
            "used": xml.replace(b"<used_memory>2296 MiB", b"<used_memory>2297 MiB"),
            "name": xml.replace(b"/root/tools/memhog", b"/root/tools/memhog2")}[changed]
    assert bent != xml
    expected = EXPECTED["fixtures"]["fixture:h100-mig-processes.xml"]
    assert smi_variants.digest(smi_variants.outcome(bent, listing)) != expected
