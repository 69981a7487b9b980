"""The container image: hadolint finds nothing, and a real build runs.

No registry is reachable here, so the Dockerfile's base image is made locally:
``debootstrap --variant=minbase bookworm``, imported into buildah and tagged as
the Dockerfile's ``FROM``. The image is then built with ``buildah bud
--isolation=chroot`` and smoke-run with ``buildah run --isolation chroot``
(``podman run`` does not work on these machines).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, require_tool

pytestmark = pytest.mark.container

DOCKERFILE = REPO / "Dockerfile"
IMAGE = "localhost/mig-exporter:test"
# A TLS-intercepting proxy's CA, where the machine has one, for pip in the build.
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
CACHE = REPO / ".cache"


def _buildah(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("buildah"), "--storage-driver=vfs", *args], capture_output=True, text=True,
                          timeout=timeout)


def _base_image() -> str:
    m = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert m, "the Dockerfile names its base in ARG BASE_IMAGE"
    return m.group(1)


@pytest.fixture(scope="module")
def base_image(tmp_path_factory) -> str:
    """The Dockerfile's FROM, made locally from Debian bookworm (minbase)."""
    name = _base_image()
    qualified = f"docker.io/library/{name}"
    if _buildah("inspect", "--type", "image", qualified).returncode == 0:
        return qualified
    CACHE.mkdir(exist_ok=True)
    rootfs_tar = CACHE / "bookworm-minbase.tar"
    if not rootfs_tar.exists():
        root = tmp_path_factory.mktemp("rootfs")
        run = subprocess.run([require_tool("debootstrap"), "--variant=minbase", "bookworm", str(root)],
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        subprocess.run(["tar", "-C", str(root), "-cf", str(rootfs_tar), "."], check=True, timeout=300)
    context = tmp_path_factory.mktemp("base")
    shutil.copy(rootfs_tar, context / "rootfs.tar")
    (context / "Containerfile").write_text('FROM scratch\nADD rootfs.tar /\nCMD ["bash"]\n')
    built = _buildah("bud", "--isolation=chroot", "-t", qualified, "-f", str(context / "Containerfile"), str(context))
    assert built.returncode == 0, built.stderr[-3000:]
    return qualified


@pytest.fixture(scope="module")
def image(base_image) -> str:
    args = ["bud", "--isolation=chroot", "--pull-never", "-t", IMAGE, "-f", str(DOCKERFILE)]
    if HOST_CA.exists():
        args += ["--build-arg", "PIP_CERT=/run/host-ca.crt", "-v", f"{HOST_CA}:/run/host-ca.crt:ro"]
    built = _buildah(*args, str(REPO))
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return IMAGE


@pytest.fixture
def container(image):
    created = _buildah("from", "--pull-never", image)
    assert created.returncode == 0, created.stderr
    name = created.stdout.strip()
    yield name
    _buildah("rm", name)


def _run(container: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return _buildah("run", "--isolation", "chroot", container, "--", *argv, timeout=120)


def test_hadolint_finds_nothing():
    hadolint = require_tool("hadolint")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_the_image_runs_as_nobody_with_the_toolkit_settings(image):
    inspected = _buildah("inspect", "--type", "image", "--format",
                         "{{.OCIv1.Config.User}}|{{.OCIv1.Config.Entrypoint}}|{{.OCIv1.Config.Cmd}}|{{.OCIv1.Config.Env}}",
                         image)
    user, entrypoint, cmd, env = inspected.stdout.strip().split("|")
    assert user == "65534:65534"
    assert entrypoint == "[mig-exporter]" and cmd == "[serve]"
    assert "NVIDIA_VISIBLE_DEVICES=all" in env and "NVIDIA_DRIVER_CAPABILITIES=utility" in env


def test_version(container):
    result = _run(container, "mig-exporter", "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "mig-exporter 0.1.0"


def test_demo_read_prints_the_series(container):
    result = _run(container, "mig-exporter", "read", "--demo")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert 'mig_exporter_read_success{source="demo"} 1.0' in out
    assert 'mig_exporter_device_memory_used_bytes{card="0",index="1000",mig_profile="3g.40gb"} 1.2229541888e+10' in out
    assert ('mig_exporter_process_info{card="1",container="",container_id="",index="1",mig_profile="",'
            'namespace="",pid="50102",pod="",process_name="/usr/local/bin/llama-server",process_type="G"} 1.0') in out


def test_the_image_can_speak_to_the_kubelet(container):
    """grpcio, which the kubelet pod-resources client needs, is installed and loads; protobuf is not needed."""
    result = _run(container, "python", "-c",
                  "import grpc, importlib.util; print(grpc.__version__, importlib.util.find_spec('google'))")
    assert result.returncode == 0, result.stderr
    version, protobuf = result.stdout.split()
    assert version.split(".")[0] == "1" and protobuf == "None"
    assert _run(container, "id", "-u").stdout.strip() == "65534"
