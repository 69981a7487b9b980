"""The XID catalogue (model/xids.py) is the one word on each XID: the XID alerts fire on its
codes, their descriptions say its meaning and action, and docs/alerts.md's catalogue section
is written from it. Issue 37: 48, 94 and 95 must agree.
"""

from __future__ import annotations

import re
import subprocess
import sys

import yaml

from conftest import REPO
from mig_exporter.model.xids import ALERTS, CATALOGUE_VERSION, XIDS, XidEntry, alert_codes, describe

ALERTS_YML = REPO / "deploy" / "prometheus" / "alerts.yml"
DOCS = REPO / "docs" / "alerts.md"
SYNC = REPO / "scripts" / "sync-xid-docs"


def _xid_alerts() -> dict[str, dict]:
    rules = [rule for group in yaml.safe_load(ALERTS_YML.read_text())["groups"] for rule in group["rules"]]
    return {rule["alert"]: rule for rule in rules if rule.get("alert") in ALERTS}


def _chain(field: str) -> str:
    arms = "".join(
        f'{{{{ {"if" if i == 0 else "else if"} eq $labels.xid "{code}" }}}}{getattr(entry, field)}'
        for i, (code, entry) in enumerate(XIDS.items())
    )
    return arms + "{{ else }}see NVIDIA's XID catalogue{{ end }}"


def test_the_catalogue_has_every_code_the_issue_names():
    named = {13, 31, 43, 46, 48, 62, 63, 64, 74, 79, 92, 94, 95, 109, 110, 119, 120, 136, 140, 143, 158}
    # Also in NVIDIA's catalogue for Ampere and newer (61 is "Unused" there, so left out).
    also = {45, 68, 69, 144, 145, 146, 147, 148, 149, 150, 154}
    assert named | also <= set(XIDS)
    assert 61 not in XIDS
    assert "analyzing-xid-catalog" in CATALOGUE_VERSION and "R575" in CATALOGUE_VERSION


def test_each_entry_is_whole():
    for code, entry in XIDS.items():
        assert entry.code == code
        assert entry.severity in ("critical", "warning", "info"), code
        assert entry.alert in (*ALERTS, ""), code
        assert entry.meaning and entry.action and entry.mnemonic and entry.immediate, code
        assert "." not in entry.action.replace("nvidia-smi", ""), f"{code}: one sentence, no full stop"
    assert list(XIDS) == sorted(XIDS)


def test_an_unknown_code_gets_a_generic_warning():
    assert describe(79) is XIDS[79]
    unknown = describe(999)
    assert unknown == XidEntry(999, "see NVIDIA's XID catalogue", "warning", "see NVIDIA's XID catalogue", "")


def test_48_94_and_95_agree():
    """A contained error (48, then 94) costs the work that hit it and a reset when convenient;
    an uncontained one (95) the whole card, now. 48 alone waits for which of the two follows."""
    dbe, contained, uncontained = XIDS[48], XIDS[94], XIDS[95]
    assert [dbe.alert, contained.alert, uncontained.alert] == ["GPUMemoryErrorXID"] * 2 + ["GPUCriticalXID"]
    assert (dbe.severity, contained.severity, uncontained.severity) == ("warning", "warning", "critical")
    assert contained.action == "restart the work that hit it, other work is unaffected; reset the card when convenient"
    assert uncontained.action == "drain the card and reset it (nvidia-smi -r)"
    assert "94 (contained)" in dbe.action and "95 (uncontained)" in dbe.action
    immediate = (dbe.immediate, contained.immediate, uncontained.immediate)
    assert immediate == ("WORKFLOW_XID_48", "RESTART_APP", "RESET_GPU")


def test_the_alerts_fire_on_the_catalogues_codes_at_its_severity():
    alerts = _xid_alerts()
    assert set(alerts) == set(ALERTS)
    for name, rule in alerts.items():
        codes = re.search(r'xid=~"([0-9|]+)"', rule["expr"]).group(1).split("|")
        assert [int(code) for code in codes] == list(alert_codes(name)), name
        assert {XIDS[int(code)].severity for code in codes} == {rule["labels"]["severity"]}, name
    fired = {code for name in ALERTS for code in alert_codes(name)}
    assert {code for code, entry in XIDS.items() if not entry.alert} == set(XIDS) - fired == {45, 154}


def test_the_alerts_say_the_catalogues_meaning_and_action():
    for name, rule in _xid_alerts().items():
        description = rule["annotations"]["description"]
        assert _chain("meaning") in description, name
        assert _chain("action") in description, name
        assert description.index(_chain("meaning")) < description.index(_chain("action")), name


def test_the_docs_section_is_the_catalogue():
    text = DOCS.read_text()
    section = text[text.index("### XID catalogue") : text.index("\n## ", text.index("### XID catalogue"))]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(row.split("|")[1]) for row in rows] == list(XIDS)
    for row, entry in zip(rows, XIDS.values(), strict=True):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells == [
            str(entry.code), f"`{entry.mnemonic}`", entry.meaning, entry.severity, entry.action,
            f"`{entry.immediate}`", f"`{entry.alert}`" if entry.alert else "none",
        ]
    assert CATALOGUE_VERSION in section


def test_the_sync_script_has_nothing_to_write():
    result = subprocess.run([sys.executable, str(SYNC), "--check"], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
