""".github/workflows: actionlint and zizmor (offline) find nothing, and each finds what a broken copy
breaks; the release workflow runs scripts/release-chart (tests/test_release.py runs it against a
local registry) with the image's pushed digest, and installs the helm-python-sdk the tests use.

Both tools come with the test extra (pyproject.toml). actionlint runs without shellcheck and
pyflakes (``-shellcheck= -pyflakes=``), so its answer does not depend on what else the machine has.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from conftest import REPO, require_tool

WORKFLOWS = REPO / ".github" / "workflows"
RELEASE = WORKFLOWS / "release.yml"
# uses: owner/action@<40 hex>  # vX.Y.Z
PINNED = re.compile(r"uses: (?P<action>[\w.-]+/[\w.-]+)@(?P<sha>[0-9a-f]{40})  # (?P<tag>v\d+)(\.\d+)*$", re.MULTILINE)


def actionlint(*files: Path, cwd: Path = REPO) -> tuple[int, list[dict]]:
    result = subprocess.run([require_tool("actionlint"), "-shellcheck=", "-pyflakes=", "-format", "{{json .}}",
                             *map(str, files)], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    return result.returncode, json.loads(result.stdout or "[]")


def zizmor(directory: Path) -> tuple[int, list[dict], str]:
    result = subprocess.run([require_tool("zizmor"), "--offline", "--no-progress", "--format", "json",
                             str(directory)], capture_output=True, text=True, timeout=60, check=False)
    return result.returncode, json.loads(result.stdout or "[]"), result.stderr


def workflow_files() -> list[Path]:
    files = sorted([*WORKFLOWS.glob("*.yml"), *WORKFLOWS.glob("*.yaml")])
    assert RELEASE in files
    return files


def test_actionlint_finds_nothing():
    assert actionlint(*workflow_files()) == (0, [])


def test_actionlint_finds_nothing_with_each_action_at_its_release_tag(tmp_path):
    """With each pinned commit replaced by the major tag its comment names, actionlint knows the
    actions: their inputs and outputs (steps.build.outputs.digest) and their Node runtime."""
    for path in workflow_files():
        text = path.read_text()
        assert len(PINNED.findall(text)) == text.count("uses: "), f"{path.name}: a uses: without # vX.Y.Z"
        tagged = PINNED.sub(lambda m: f"uses: {m['action']}@{m['tag']}", text)
        copy = _copy(tmp_path / path.stem, tagged, path.name)
        assert actionlint(copy, cwd=copy.parents[2]) == (0, [])


def test_zizmor_finds_nothing():
    code, findings, stderr = zizmor(WORKFLOWS)
    assert (code, findings) == (0, []), stderr
    assert f"completed {RELEASE}" in stderr


def _copy(top: Path, text: str, name: str = "release.yml") -> Path:
    """``text`` written as TOP/.github/workflows/NAME; its path."""
    workflows = top / ".github" / "workflows"
    workflows.mkdir(parents=True)
    (workflows / name).write_text(text)
    return workflows / name


def _replace(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, 1)
    return edit


CHECKOUT = "actions/checkout@de0fac2e4500dabe0009e67214ff5f5447ce83dd  # v6.0.2"
BROKEN = {
    # a mutable tag: any push to it changes what runs
    "unpinned action": (_replace(CHECKOUT, "actions/checkout@v6"), "zizmor", "unpinned-uses"),
    # an attacker's commit message in a shell line
    "template injection": (_replace('version="${GITHUB_REF_NAME#v}"',
                                    'version="${{ github.event.head_commit.message }}"'),
                           "zizmor", "template-injection"),
    # the checkout's default leaves the token in .git/config for every later step
    "credentials persisted": (_replace("        with:\n          persist-credentials: false\n", ""),
                              "zizmor", "artipacked"),
    # every scope writable, for a job that asks for nothing narrower
    "excessive permissions": (lambda text: _replace("permissions: {}", "permissions: write-all")(_replace(
        "    permissions:\n      contents: read   # check out the tagged commit\n"
        "      packages: write  # push the image to ghcr.io\n", "")(text)), "zizmor", "excessive-permissions"),
    "a job that needs no job": (_replace("needs: image", "needs: images"), "actionlint", "job-needs"),
    "an output of no step": (_replace("steps.build.outputs.digest", "steps.built.outputs.digest"),
                             "actionlint", "expression"),
    "untrusted input in a run": (_replace('version="${GITHUB_REF_NAME#v}"',
                                          'version="${{ github.event.head_commit.message }}"'),
                                 "actionlint", "expression"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_tool_finds_what_a_broken_copy_breaks(name, tmp_path):
    edit, tool, expected = BROKEN[name]
    broken = _copy(tmp_path, edit(RELEASE.read_text()))
    if tool == "zizmor":
        code, findings, stderr = zizmor(broken.parent)
        assert code != 0, stderr
        assert expected in {f["ident"] for f in findings}
    else:
        code, errors = actionlint(broken, cwd=tmp_path)
        assert code == 1
        assert expected in {e["kind"] for e in errors}


def _release() -> dict:
    doc = yaml.safe_load(RELEASE.read_text())
    doc["on"] = doc.pop(True)  # YAML 1.1 reads the key `on` as true
    return doc


def _step(job: dict, run_contains: str) -> dict:
    (step,) = [s for s in job["steps"] if run_contains in s.get("run", "")]
    return step


def test_a_tag_push_builds_both_platforms_and_pushes_them_to_ghcr():
    doc = _release()
    assert doc["on"] == {"push": {"tags": ["v*"]}}
    assert doc["permissions"] == {}
    image = doc["jobs"]["image"]
    assert image["permissions"] == {"contents": "read", "packages": "write"}
    (build,) = [s for s in image["steps"] if s.get("id") == "build"]
    assert build["uses"].startswith("docker/build-push-action@")
    assert build["with"]["platforms"] == "linux/amd64,linux/arm64"
    assert (build["with"]["push"], build["with"]["file"]) == (True, "Dockerfile")
    assert image["outputs"]["digest"] == "${{ steps.build.outputs.digest }}"
    names = _step(image, "GITHUB_OUTPUT")
    assert names["env"] == {"OWNER": "${{ github.repository_owner }}"}
    assert 'owner="${OWNER,,}"' in names["run"]
    assert 'echo "image=ghcr.io/${owner}/mig-exporter"' in names["run"]
    assert 'echo "charts=oci://ghcr.io/${owner}/charts"' in names["run"]


def test_the_chart_step_is_the_script_the_tests_run_with_the_pushed_digest():
    chart = _release()["jobs"]["chart"]
    assert chart["needs"] == "image"
    assert chart["permissions"] == {"contents": "read", "packages": "write"}
    step = _step(chart, "scripts/release-chart")
    assert step["run"].split() == ["python", "scripts/release-chart", "--image", '"$IMAGE"', "--digest", '"$DIGEST"',
                                   "--version", '"$VERSION"', "--destination", '"$CHARTS"', "--output", "dist"]
    assert {k: step["env"][k] for k in ("IMAGE", "DIGEST", "VERSION", "CHARTS")} == {
        k: f"${{{{ needs.image.outputs.{k.lower()} }}}}" for k in ("IMAGE", "DIGEST", "VERSION", "CHARTS")}
    assert step["env"]["REGISTRY_PASSWORD"] == "${{ secrets.GITHUB_TOKEN }}"


def test_the_release_installs_the_helm_sdk_the_tests_use():
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    (pin,) = [req for req in extra if req.startswith("helm-python-sdk")]
    install = _step(_release()["jobs"]["chart"], "pip install")
    assert install["run"].split()[-3:] == ["--require-hashes", "-r", ".github/release-requirements.txt"]
    # Each requirement pinned to one version, with the hash of its wheel: a job that may push
    # packages installs nothing it has not named byte for byte.
    text = (REPO / ".github" / "release-requirements.txt").read_text()
    lines = [line.strip() for line in text.replace("\\\n", " ").splitlines()
             if line.strip() and not line.startswith("#")]
    requirements = {line.split()[0]: line.split()[1:] for line in lines}
    assert set(requirements) == {pin, "PyYAML==6.0.4"}
    for name, options in requirements.items():
        hashes = [o for o in options if o.startswith("--hash=sha256:")]
        assert hashes and all(len(h.removeprefix("--hash=sha256:")) == 64 for h in hashes), name


def test_the_release_script_is_ruff_clean():
    """scripts/release-chart is Python without a .py name, so `ruff check .` passes it by."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                             "scripts/release-chart"], cwd=REPO, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
