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
then removes the directory, whether the build passed or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, require_tool

# The first run debootstraps the base and the build pip-installs: well past the default 120 s.
pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

DOCKERFILE = REPO / "Dockerfile"
IMAGE = "localhost/mig-exporter:test"
# Our own name for the debootstrapped base: never the Dockerfile's default (debian:12.11-slim),
# which another project's FROM would resolve to.
BASE_IMAGE = "localhost/mig-exporter-test-base"
# A TLS-intercepting proxy's CA, where the machine has one, for pip in the build.
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
CACHE = REPO / ".cache"
ROOTFS_TAR = CACHE / "bookworm-minbase.tar"


def _run_group(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """subprocess.run, but a timeout kills the whole process group (buildah's and
    debootstrap's children too), so nothing keeps writing into storage being removed."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:  # the timeout, or pytest-timeout's or the user's interrupt
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# buildah (1.28, as root) writes its blob-info cache to /var/lib/containers/cache whatever --root says,
# and its network setup creates /etc/cni/net.d/cni.lock. So, as root, each call runs in a mount
# namespace of its own where a private directory is bind-mounted over /var/lib/containers (where
# that does not exist, /var/lib is read-only there, and the cache is kept in memory), and a
# containers.conf of ours (CONTAINERS_CONF) puts the CNI directory and big temporary files in the
# private directory too. ("$0" is the private directory, "$@" the buildah command.)
_SHADOW_VAR_LIB_CONTAINERS = """set -e
if [ -d /var/lib/containers ]; then
    mount --bind "$0" /var/lib/containers
else
    mount --bind /var/lib /var/lib
    mount -o remount,bind,ro /var/lib
fi
exec "$@"
"""


class Buildah:
    """buildah over a private vfs storage under ``top``: root, runroot, TMPDIR, containers.conf
    and what buildah would write under /var/lib/containers; nothing of the machine's."""

    def __init__(self, top: Path) -> None:
        self.exe = require_tool("buildah")
        self.top = top
        self.root, self.runroot, self.tmp = top / "root", top / "runroot", top / "tmp"
        self.shadow, self.cni = top / "var-lib-containers", top / "cni"
        for d in (self.root, self.runroot, self.tmp, self.shadow, self.cni):
            d.mkdir(parents=True)
        conf = top / "containers.conf"
        conf.write_text(f'[network]\nnetwork_config_dir = "{self.cni}"\n\n'
                        f'[engine]\nimage_copy_tmp_dir = "{self.tmp}"\n')
        self.env = {**os.environ, "TMPDIR": str(self.tmp), "CONTAINERS_CONF": str(conf),
                    "XDG_DATA_HOME": str(top / "xdg-data")}  # rootless buildah's blob-info cache
        self.wrap = ([require_tool("unshare"), "--mount", "--propagation", "private", "--",
                      "/bin/sh", "-c", _SHADOW_VAR_LIB_CONTAINERS, str(self.shadow)]
                     if os.geteuid() == 0 else [])

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return _run_group([*self.wrap, self.exe, "--root", str(self.root), "--runroot", str(self.runroot),
                           "--storage-driver=vfs", *args], timeout, self.env)

    def images(self) -> list[str]:
        """The names of every image (``<none>`` for an unnamed one), intermediate ones too."""
        listed = self("images", "--all", "--json", timeout=60)
        assert listed.returncode == 0, listed.stderr
        return [name for img in json.loads(listed.stdout or "[]") for name in img.get("names") or ["<none>"]]

    def containers(self) -> list[str]:
        """The ids of every container in the storage, working containers or not."""
        listed = self("containers", "--all", "--quiet", timeout=60)
        assert listed.returncode == 0, listed.stderr
        return listed.stdout.split()

    def destroy(self) -> None:
        """Remove every container and image, check none is left, then remove the storage."""
        try:
            removed = [self("rm", "--all", timeout=300), self("rmi", "--all", "--force", timeout=300)]
            left = (self.images(), self.containers())
        finally:
            shutil.rmtree(self.top, ignore_errors=True)
            if self.top.exists() and os.geteuid() != 0:  # rootless: layers owned by subordinate ids
                _run_group([self.exe, "unshare", "rm", "-rf", str(self.top)], 300)
        for r in removed:
            assert r.returncode == 0, r.stderr
        assert left == ([], []), f"left in the storage after rm/rmi --all: {left}"
        assert not self.top.exists(), f"{self.top} could not be removed"


def _cached_rootfs_tar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``debootstrap --variant=minbase bookworm`` as a tarball, made once and kept in .cache.
    It is written to a temporary name and renamed, so an interrupted run leaves no half
    tarball; a tarball tar cannot read to its end is made again."""
    CACHE.mkdir(exist_ok=True)
    for part in CACHE.glob(f"{ROOTFS_TAR.name}.*.part"):  # left by a killed run
        pid = part.name[len(ROOTFS_TAR.name) + 1:-len(".part")]
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            part.unlink(missing_ok=True)
    tar = require_tool("tar")
    if ROOTFS_TAR.exists():
        listed = subprocess.run([tar, "-tf", str(ROOTFS_TAR)], check=False, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, timeout=300)
        if listed.returncode == 0:
            return ROOTFS_TAR
        ROOTFS_TAR.unlink()
    root = tmp_path_factory.mktemp("rootfs")
    part = CACHE / f"{ROOTFS_TAR.name}.{os.getpid()}.part"
    try:
        run = _run_group([require_tool("debootstrap"), "--variant=minbase", "bookworm", str(root)], 900)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        subprocess.run([tar, "-C", str(root), "--numeric-owner", "-cf", str(part), "."], check=True, timeout=300)
        with open(part, "rb") as f:
            os.fsync(f.fileno())
        os.replace(part, ROOTFS_TAR)
    finally:
        part.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    return ROOTFS_TAR


@pytest.fixture(scope="module")
def buildah(tmp_path_factory) -> Iterator[Buildah]:
    """buildah over this module's private storage; everything in it is removed at the end,
    whether the builds and tests passed or not, and the removal is checked."""
    store = Buildah(tmp_path_factory.mktemp("buildah"))
    yield store
    store.destroy()


@pytest.fixture(scope="module")
def base_image(buildah, tmp_path_factory) -> str:
    """The Dockerfile's base, made locally from Debian bookworm (minbase), under our own name."""
    rootfs_tar = _cached_rootfs_tar(tmp_path_factory)
    context = tmp_path_factory.mktemp("base")
    try:
        try:
            os.link(rootfs_tar, context / "rootfs.tar")
        except OSError:  # another filesystem
            shutil.copy(rootfs_tar, context / "rootfs.tar")
        (context / "Containerfile").write_text('FROM scratch\nADD rootfs.tar /\nCMD ["bash"]\n')
        built = buildah("bud", "--isolation=chroot", "--pull-never", "-t", BASE_IMAGE,
                        "-f", str(context / "Containerfile"), str(context))
    finally:
        shutil.rmtree(context, ignore_errors=True)
    assert built.returncode == 0, built.stderr[-3000:]
    return BASE_IMAGE


@pytest.fixture(scope="module")
def image(buildah, base_image) -> str:
    args = ["bud", "--isolation=chroot", "--pull-never", "--build-arg", f"BASE_IMAGE={base_image}",
            "-t", IMAGE, "-f", str(DOCKERFILE)]
    if HOST_CA.exists():
        args += ["--build-arg", "PIP_CERT=/run/host-ca.crt", "-v", f"{HOST_CA}:/run/host-ca.crt:ro"]
    built = buildah(*args, str(REPO))
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return IMAGE


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
