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
from mig_exporter.nvidia_smi.build import ReadMemo

sys.path.insert(0, str(REPO))
from benchmarks import scenarios

EXPECTED = json.loads((FIXTURES / "snapshot-digests.json").read_text())


def _mismatches(group: str, cases: dict[str, tuple[bytes, bytes | None]], memo: ReadMemo | None = None) -> list[str]:
    assert set(cases) == set(EXPECTED[group])
    return [name for name, (xml, listing) in cases.items()
            if smi_variants.digest(smi_variants.outcome(xml, listing, memo)) != EXPECTED[group][name]]


# Each group read without a memo, then through one memo in order, each case twice: the
# first read of a case finds the report before it in the memo (a variant shares most of its
# sections with its neighbours), the second finds its own sections.
MEMO_MODES = ["no memo", "memo"]


def _check(group: str, cases: dict[str, tuple[bytes, bytes | None]], mode: str) -> None:
    if mode == "no memo":
        assert _mismatches(group, cases) == []
        return
    memo = ReadMemo()
    for rounds in range(2):
        assert _mismatches(group, cases, memo) == [], f"round {rounds}"
    twice = ReadMemo()
    wrong = []
    for name, (xml, listing) in cases.items():
        for _ in range(2):
            if smi_variants.digest(smi_variants.outcome(xml, listing, twice)) != EXPECTED[group][name]:
                wrong.append(name)
    assert wrong == []


@pytest.mark.parametrize("mode", MEMO_MODES)
def test_fixtures_and_their_variants_read_as_before(mode):
    _check("fixtures", smi_variants.fixture_cases(FIXTURES, SAMPLES), mode)


@pytest.mark.parametrize("mode", MEMO_MODES)
def test_the_real_corpus_and_its_variants_read_as_before(mode):
    corpus = require_real_corpus()
    _check("corpus", smi_variants.corpus_cases(corpus, FIXTURES), mode)


@pytest.mark.parametrize("mode", MEMO_MODES)
def test_the_benchmark_scenarios_read_as_before(mode):
    _check("scenarios", smi_variants.scenario_cases(scenarios), mode)


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
