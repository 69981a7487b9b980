"""The container image: hadolint finds nothing, and a real build runs.

No registry is reachable here, so the Dockerfile's base image is made locally:
``debootstrap --variant=minbase bookworm`` (cached in ``.cache/bookworm-minbase.tar``),
imported into buildah as ``localhost/mig-exporter-test-base`` and given to the build
with ``--build-arg BASE_IMAGE=...``. The image is then built with ``buildah bud
--isolation=chroot`` and smoke-run with ``buildah run --isolation chroot``
(``podman run`` does not work on these machines).

buildah never touches the machine's shared storage or state (``/var/lib/containers``,
``/run/containers``, ``/var/tmp``, ``/etc/cni``): every call gets ``--root``, ``--runroot``,
``TMPDIR`` and a containers.conf in a private directory made for this module, and runs where
that directory is mounted over /var/lib/containers (see ``_SHADOW_VAR_LIB_CONTAINERS``). The
module's teardown removes every image and working container there, checks that none is left,
then removes the directory, whether the build passed or not. The store and the builds are
tests/buildah_store.py's, which tests/test_release.py shares.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from buildah_store import BASE_IMAGE, DOCKERFILE, Buildah
from conftest import SHARED_IMAGE, require_tool

# The first run debootstraps the base and the build pip-installs: well past the default 120 s.
pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

IMAGE = SHARED_IMAGE


@pytest.fixture(scope="module")
def buildah(shared_buildah) -> Buildah:
    """buildah over the run's private storage (tests/conftest.py, shared with test_release.py)."""
    return shared_buildah


@pytest.fixture(scope="module")
def image(shared_image) -> str:
    """The image, built once a run over the debootstrapped base (``BASE_IMAGE``)."""
    return shared_image


@pytest.fixture(scope="module")
def base_image(image) -> str:
    return BASE_IMAGE


@pytest.fixture
def container(buildah, image):
    created = buildah("from", "--pull-never", image)
    assert created.returncode == 0, created.stderr
    name = created.stdout.strip()
    yield name
    buildah("rm", name)


def _run(buildah: Buildah, container: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return buildah("run", "--isolation", "chroot", container, "--", *argv, timeout=120)


def test_hadolint_finds_nothing():
    hadolint = require_tool("hadolint")
    result = subprocess.run([hadolint, str(DOCKERFILE)], check=False, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_the_dockerfile_takes_its_base_from_the_build_arg():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S+$", text, re.MULTILINE)
    assert re.findall(r"^FROM (\S+)", text, re.MULTILINE) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]


def test_the_image_runs_as_nobody_with_the_toolkit_settings(buildah, image):
    inspected = buildah("inspect", "--type", "image", "--format",
                        "{{.OCIv1.Config.User}}|{{.OCIv1.Config.Entrypoint}}|{{.OCIv1.Config.Cmd}}|{{.OCIv1.Config.Env}}",
                        image)
    user, entrypoint, cmd, env = inspected.stdout.strip().split("|")
    assert user == "65534:65534"
    assert entrypoint == "[mig-exporter]" and cmd == "[serve]"
    assert "NVIDIA_VISIBLE_DEVICES=all" in env and "NVIDIA_DRIVER_CAPABILITIES=utility" in env


def test_the_build_used_our_base_in_a_private_storage(buildah, image):
    """The store is ours, it holds our names only (no docker.io/library/debian), and the
    image's bottom layer is the debootstrapped base's."""
    info = json.loads(buildah("info").stdout)["store"]
    assert (info["GraphRoot"], info["RunRoot"]) == (str(buildah.root), str(buildah.runroot))
    named = {n for n in buildah.images() if n != "<none>"}
    assert named == {f"{BASE_IMAGE}:latest", IMAGE}
    assert not any(n.startswith("docker.io/") for n in named)

    def layers(name: str) -> list[str]:
        out = buildah("inspect", "--type", "image", name)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["OCIv1"]["rootfs"]["diff_ids"]

    base = layers(BASE_IMAGE)
    assert len(base) == 1 and layers(image)[0] == base[0]


def test_version(buildah, container):
    result = _run(buildah, container, "mig-exporter", "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "mig-exporter 0.1.0"


def test_demo_read_prints_the_series(buildah, container):
    result = _run(buildah, container, "mig-exporter", "read", "--demo")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert 'mig_exporter_read_success{source="demo"} 1.0' in out
    assert 'mig_exporter_device_memory_used_bytes{card="0",index="1000",mig_profile="3g.40gb"} 1.2229541888e+10' in out
    assert ('mig_exporter_process_info{card="1",container="",container_id="",index="1",mig_profile="",'
            'namespace="",pid="50102",pod="",process_name="/usr/local/bin/llama-server",process_type="G",slurm_job="",'
            'slurm_step="",systemd_unit="",user=""} 1.0') in out


def test_the_image_can_speak_to_the_kubelet(buildah, container):
    """grpcio, which the kubelet pod-resources client needs, is installed and loads; protobuf is not needed."""
    result = _run(buildah, container, "python", "-c",
                  "import grpc, importlib.util; print(grpc.__version__, importlib.util.find_spec('google'))")
    assert result.returncode == 0, result.stderr
    version, protobuf = result.stdout.split()
    assert version.split(".")[0] == "1" and protobuf == "None"
    assert _run(buildah, container, "id", "-u").stdout.strip() == "65534"


def test_read_source_nvml_answers_from_a_libnvidia_ml_mounted_into_the_image(buildah, container, tmp_path):
    """The C fake libnvidia-ml.so.1 (tests/fake_libnvml/) bind-mounted into the run and found
    through LD_LIBRARY_PATH, as the NVIDIA container toolkit mounts the driver's: the image's
    pynvml loads it, and the read equals the nvidia-smi fixture's."""
    from fake_nvml import SCENARIOS
    from fake_nvml_c import SONAME, build, write_scenario

    mounted = tmp_path / "nvml"
    mounted.mkdir(mode=0o755)
    shutil.copy(build() / SONAME, mounted / SONAME)  # the build cache is private to root; the image runs as nobody
    write_scenario(mounted / "scenario.txt", SCENARIOS["h100-mig-processes"]())
    for path in (mounted, *mounted.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    tmp_path.chmod(0o755)
    result = buildah("run", "--isolation", "chroot", "-v", f"{mounted}:/opt/fake-nvml:ro", container, "--",
                     "env", "LD_LIBRARY_PATH=/opt/fake-nvml", "FAKE_NVML_SCENARIO=/opt/fake-nvml/scenario.txt",
                     "mig-exporter", "read", "--source", "nvml", timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert 'mig_exporter_read_success{source="nvml"} 1.0' in out
    assert ('mig_exporter_device_memory_used_bytes{card="0",index="1002",mig_profile="1g.10gb"} 7.856979968e+09'
            in out)
    assert 'pid="21198"' in out and 'process_name="./gpu_burn"' in out
    # Without the library the same image says why, and fails the read.
    bare = _run(buildah, container, "mig-exporter", "read", "--source", "nvml")
    assert bare.returncode == 1
    assert "NVML_ERROR_LIBRARY_NOT_FOUND" in bare.stderr


def test_the_private_storage_is_removed_with_everything_in_it(tmp_path):
    """What the module's teardown does to its storage: an image and a working container
    in, nothing left after (the module's own teardown checks the same of its storage)."""
    store = Buildah(tmp_path / "buildah")
    created = store("from", "scratch")
    assert created.returncode == 0, created.stderr
    assert store("commit", created.stdout.strip(), f"{BASE_IMAGE}-cleanup").returncode == 0
    assert store("from", "--pull-never", f"{BASE_IMAGE}-cleanup").returncode == 0
    assert f"{BASE_IMAGE}-cleanup:latest" in store.images() and len(store.containers()) == 2
    store.destroy()
    assert not store.top.exists()
