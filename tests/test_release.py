"""The release path (.github/workflows/release.yml), run here against a real OCI registry.

Debian's ``docker-registry`` (the CNCF Distribution registry) is started by this module on
127.0.0.1, on a free port, with a config file and storage of its own under the module's
temporary directory; never the system service. Then, as the workflow does:

1. the image is built (tests/buildah_store.py: ``buildah bud`` over the debootstrapped base,
   in a private store), and pushed to ``127.0.0.1:PORT/mig-exporter:VERSION``, its digest
   taken from ``buildah push --digestfile``;
2. the chart is packaged with that digest and pushed to ``oci://127.0.0.1:PORT/charts`` by
   ``scripts/release-chart``, the script the workflow runs (``--plain-http`` here: the
   registry speaks HTTP);
3. the chart is pulled back from the registry and rendered by Helm's own code: its DaemonSet
   runs ``127.0.0.1:PORT/mig-exporter@sha256:<the pushed digest>``;
4. that image is pulled by that digest into a second, empty private store, and run.

The registry is stopped at the end, and the last test checks that nothing was left outside the
temporary directories: no registry process, no Helm or container configuration, cache or
storage of the machine's touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helm_python import chart as helm
from helm_python import registry as helm_registry

from buildah_store import Buildah
from conftest import REPO, require_tool
from mig_exporter import __version__
from test_prometheus import _free_port, _stop

# The first run debootstraps the base and the build pip-installs: well past the default 120 s.
pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

RELEASE_CHART = REPO / "scripts" / "release-chart"
CHART = REPO / "deploy" / "helm" / "mig-exporter"
VERSION = __version__
HOME = Path.home()
# What a push, a pull or a build could write to outside our directories, were it not kept in them.
WATCHED = [HOME / ".docker", HOME / ".config" / "helm", HOME / ".cache" / "helm", HOME / ".local" / "share" / "helm",
           HOME / ".config" / "containers", HOME / ".local" / "share" / "containers",
           Path("/var/lib/containers"), Path("/run/containers"), Path("/etc/cni/net.d"),
           Path("/var/lib/docker-registry")]


def _state(path: Path) -> tuple[bool, list[str]]:
    """Whether ``path`` exists, and the names in it."""
    return path.exists(), sorted(os.listdir(path)) if path.is_dir() else []


@pytest.fixture(scope="module", autouse=True)
def machine_before() -> dict[Path, tuple[bool, list[str]]]:
    return {path: _state(path) for path in WATCHED}


class LocalRegistry:
    """``docker-registry serve`` with a config of ours: 127.0.0.1 on a free port, storage under
    ``top``; ``stop()`` ends it (TERM, then KILL) and waits for it."""

    def __init__(self, top: Path) -> None:
        self.exe = require_tool("docker-registry")
        self.top = top
        self.storage = top / "storage"
        self.storage.mkdir(parents=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = top / "registry.log"
        for _attempt in range(3):  # a free port can be taken between our look and the registry's bind
            self.port = _free_port()
            config = top / "config.yml"
            config.write_text(yaml.safe_dump({
                "version": 0.1,
                "log": {"level": "info", "accesslog": {"disabled": True}},
                "storage": {"filesystem": {"rootdirectory": str(self.storage)}, "delete": {"enabled": True}},
                "http": {"addr": f"127.0.0.1:{self.port}", "secret": "mig-exporter-release-test"},
            }))
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen([self.exe, "serve", str(config)], stdout=log, stderr=log,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            if self._ready(10.0):
                return
            self.stop()
        raise AssertionError(f"docker-registry did not start: {self.log.read_text()[-2000:]}")

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _ready(self, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            with contextlib.suppress(OSError), urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2) as answer:
                if answer.status == 200:
                    return True
            time.sleep(0.1)
        return False

    def get(self, path: str, accept: str = "*/*", method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(f"http://{self.host}{path}", method=method, headers={"Accept": accept})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, dict(answer.headers), answer.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[LocalRegistry]:
    started = LocalRegistry(tmp_path_factory.mktemp("registry"))
    yield started
    started.stop()
    assert not started.running()


@pytest.fixture(scope="module")
def helm_home(tmp_path_factory) -> Iterator[dict[str, str]]:
    """Helm's cache, configuration and data directories, for this process and the script's."""
    top = tmp_path_factory.mktemp("helm-home")
    env = {"HELM_CACHE_HOME": str(top / "cache"), "HELM_CONFIG_HOME": str(top / "config"),
           "HELM_DATA_HOME": str(top / "data")}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield env


@pytest.fixture(scope="module")
def buildah(shared_buildah) -> Buildah:
    """buildah over the run's private storage (tests/conftest.py, shared with test_container.py)."""
    return shared_buildah


@pytest.fixture(scope="module")
def image(shared_image) -> str:
    """The image test_container.py checks, built once a run: the one released."""
    return shared_image


@dataclass
class Pushed:
    reference: str  # REGISTRY/REPOSITORY, as the chart is given it
    digest: str


@pytest.fixture(scope="module")
def pushed_image(buildah, image, registry, tmp_path_factory) -> Pushed:
    """The image pushed to the registry as mig-exporter:VERSION, with the digest buildah pushed."""
    digestfile = tmp_path_factory.mktemp("push") / "digest"
    reference = f"{registry.host}/mig-exporter"
    pushed = buildah("push", "--tls-verify=false", "--digestfile", str(digestfile), image,
                     f"docker://{reference}:{VERSION}", timeout=300)
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    return Pushed(reference, digestfile.read_text().strip())


def release_chart(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """scripts/release-chart, as the workflow runs it (python scripts/release-chart ...)."""
    return subprocess.run([sys.executable, str(RELEASE_CHART), *args], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, **env}, cwd=REPO)


@pytest.fixture(scope="module")
def released_chart(pushed_image, registry, helm_home, tmp_path_factory) -> tuple[dict, Path]:
    """What scripts/release-chart printed, and where it kept the package."""
    output = tmp_path_factory.mktemp("dist")
    run = release_chart("--image", pushed_image.reference, "--digest", pushed_image.digest, "--version", VERSION,
                        "--destination", f"oci://{registry.host}/charts", "--plain-http", "--output", str(output),
                        env=helm_home)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout), output


@pytest.fixture(scope="module")
def pulled_chart(released_chart, registry, tmp_path_factory) -> Path:
    """The chart pulled back from the registry, as a user's ``helm pull oci://...`` gets it."""
    destination = tmp_path_factory.mktemp("pulled-chart")
    with helm_registry.RegistryClient(plain_http=True, credentials_file=destination / "credentials.json") as client:
        client.pull(f"oci://{registry.host}/charts/mig-exporter", version=VERSION, destination=destination,
                    plain_http=True)
    (archive,) = destination.glob("*.tgz")
    return archive


def test_the_registry_holds_the_image_under_the_pushed_digest(registry, pushed_image):
    assert pushed_image.digest.startswith("sha256:") and len(pushed_image.digest) == 7 + 64
    status, headers, body = registry.get(f"/v2/mig-exporter/manifests/{VERSION}", method="HEAD", accept=", ".join((
        "application/vnd.oci.image.manifest.v1+json", "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json")))
    assert status == 200
    assert headers["Docker-Content-Digest"] == pushed_image.digest
    status, _, body = registry.get("/v2/mig-exporter/tags/list")
    assert (status, json.loads(body)) == (200, {"name": "mig-exporter", "tags": [VERSION]})


def test_the_chart_in_the_registry_is_the_package_the_script_made(registry, released_chart, pulled_chart):
    printed, output = released_chart
    (archive,) = output.glob("*.tgz")
    assert archive.name == f"mig-exporter-{VERSION}.tgz"
    assert printed["chart"] == f"oci://{registry.host}/charts/mig-exporter:{VERSION}"
    assert printed["archive"] == str(archive)
    with helm_registry.RegistryClient(plain_http=True, credentials_file=output / "credentials.json") as client:
        assert client.tags(f"oci://{registry.host}/charts/mig-exporter") == [VERSION]
        assert client.resolve(printed["chart"])["digest"] == printed["chart_digest"]
    assert pulled_chart.read_bytes() == archive.read_bytes()


def test_the_pulled_chart_runs_the_pushed_image_by_its_digest(registry, pushed_image, released_chart, pulled_chart):
    printed, _ = released_chart
    expected = f"{registry.host}/mig-exporter@{pushed_image.digest}"
    assert printed["image"] == expected
    with helm.Chart.load(pulled_chart) as chart:
        assert (chart.metadata["version"], chart.metadata["appVersion"]) == (VERSION, VERSION)
        # Artifact Hub's image annotation names the tag pushed; the rest of Chart.yaml is the repo's.
        annotations = chart.metadata["annotations"]
        assert [i["image"] for i in yaml.safe_load(annotations["artifacthub.io/images"])] == [
            f"{pushed_image.reference}:{VERSION}"]
        assert annotations["artifacthub.io/prerelease"] == str("-" in VERSION).lower()
        source = yaml.safe_load((REPO / "deploy" / "helm" / "mig-exporter" / "Chart.yaml").read_text())
        assert {k: v for k, v in chart.metadata.items() if k not in ("annotations", "version", "appVersion")} == {
            k: v for k, v in source.items() if k not in ("annotations", "version", "appVersion")}
        image_values = chart.values["image"]
        assert (image_values["registry"], image_values["repository"], image_values["digest"]) == (
            registry.host, "mig-exporter", pushed_image.digest)
        rendered = chart.render(name="mig-exporter", namespace="mig-exporter", is_install=True)
    docs = [doc for path, text in rendered.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    (daemonset,) = [doc for doc in docs if doc["kind"] == "DaemonSet"]
    images = [c["image"] for c in daemonset["spec"]["template"]["spec"]["containers"]]
    assert images == [expected]


def test_the_image_pulled_by_that_digest_runs(registry, pushed_image, tmp_path):
    """Pulled into a second store that holds nothing else: what runs came from the registry."""
    store = Buildah(tmp_path / "pulled")
    try:
        reference = f"{pushed_image.reference}@{pushed_image.digest}"
        pulled = store("pull", "--tls-verify=false", f"docker://{reference}", timeout=300)
        assert pulled.returncode == 0, pulled.stderr[-3000:]
        image_id = pulled.stdout.split()[-1]
        inspected = store("inspect", "--type", "image", "--format", "{{.FromImageDigest}}", image_id)
        assert inspected.stdout.strip() == pushed_image.digest
        created = store("from", "--pull-never", image_id)
        assert created.returncode == 0, created.stderr
        container = created.stdout.strip()

        def run(*argv: str) -> subprocess.CompletedProcess[str]:
            return store("run", "--isolation", "chroot", container, "--", *argv, timeout=120)

        version = run("mig-exporter", "--version")
        assert (version.returncode, version.stdout.strip()) == (0, f"mig-exporter {VERSION}"), version.stderr
        demo = run("mig-exporter", "read", "--demo")
        assert demo.returncode == 0, demo.stderr
        assert 'mig_exporter_read_success{source="demo"} 1.0' in demo.stdout
        assert ('mig_exporter_device_memory_used_bytes{card="0",index="1000",mig_profile="3g.40gb"} 1.2229541888e+10'
                in demo.stdout)
    finally:
        store.destroy()
    assert not store.top.exists()


def test_the_script_refuses_a_chart_that_cannot_carry_the_digest(registry, pushed_image, helm_home, tmp_path):
    """A chart whose values lack image.digest would ship unpinned: refused, and nothing pushed."""
    chart = tmp_path / "mig-exporter"
    shutil.copytree(CHART, chart)
    values = chart / "values.yaml"
    text = values.read_text()
    assert '\n  digest: ""\n' in text
    values.write_text(text.replace('\n  digest: ""\n', "\n"))
    run = release_chart("--chart", str(chart), "--image", pushed_image.reference, "--digest", pushed_image.digest,
                        "--version", VERSION, "--destination", f"oci://{registry.host}/refused", "--plain-http",
                        "--output", str(tmp_path / "dist"), env=helm_home)
    assert run.returncode == 1
    assert "release-chart: the chart's values.yaml has no image.digest" in run.stderr
    assert run.stdout == ""
    status, _, body = registry.get("/v2/_catalog")
    assert status == 200 and "refused/mig-exporter" not in json.loads(body)["repositories"]


@pytest.mark.parametrize(("flag", "bad", "message"), [
    ("--digest", "sha256:abc", "is not sha256:<64 hex digits>"),
    ("--version", "v0.1.0", "is not a SemVer version"),
    ("--image", "ghcr.io/Owner/mig-exporter", "is not REGISTRY/REPOSITORY"),
    ("--destination", "ghcr.io/owner/charts", "is not oci://HOST/PATH"),
])
def test_the_script_refuses_a_malformed_argument(registry, helm_home, tmp_path, flag, bad, message):
    args = {"--image": f"{registry.host}/mig-exporter", "--digest": "sha256:" + "0" * 64, "--version": VERSION,
            "--destination": f"oci://{registry.host}/malformed", flag: bad}
    run = release_chart(*[x for pair in args.items() for x in pair], "--plain-http", "--output", str(tmp_path),
                        env=helm_home)
    assert run.returncode == 1
    assert run.stderr.startswith(f"release-chart: {flag} {bad!r} {message}")
    assert list(tmp_path.iterdir()) == []
    assert "malformed/mig-exporter" not in json.loads(registry.get("/v2/_catalog")[2])["repositories"]


def test_nothing_is_left_outside_the_test_directories(registry, machine_before, helm_home):
    """Last: the registry stops when told, and what the machine had is as it was."""
    pid = registry.proc.pid
    registry.stop()
    assert not registry.running()
    assert not Path(f"/proc/{pid}").exists()
    assert {path: _state(path) for path in WATCHED} == machine_before
    assert all(Path(d).is_relative_to(registry.top.parent) for d in helm_home.values())
