"""buildah over a private store, and the image built in it: shared by tests/test_container.py
(the image itself) and tests/test_release.py (the image pushed to a registry, pulled back by digest).

No registry is reachable here, so the Dockerfile's base image is made locally:
``debootstrap --variant=minbase bookworm`` (cached in ``.cache/bookworm-minbase.tar``),
imported into buildah as ``localhost/mig-exporter-test-base`` and given to the build
with ``--build-arg BASE_IMAGE=...``. The image is then built with ``buildah bud
--isolation=chroot``.

buildah never touches the machine's shared storage or state (``/var/lib/containers``,
``/run/containers``, ``/var/tmp``, ``/etc/cni``): every call gets ``--root``, ``--runroot``,
``TMPDIR`` and a containers.conf in a private directory, and runs where that directory is
mounted over /var/lib/containers (see ``_SHADOW_VAR_LIB_CONTAINERS``). ``Buildah.destroy``
removes every image and working container there, checks that none is left, then removes the
directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, require_tool

DOCKERFILE = REPO / "Dockerfile"
# Our own name for the debootstrapped base: never the Dockerfile's default (debian:12.11-slim),
# which another project's FROM would resolve to.
BASE_IMAGE = "localhost/mig-exporter-test-base"
# A TLS-intercepting proxy's CA, where the machine has one, for pip in the build.
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
CACHE = REPO / ".cache"
ROOTFS_TAR = CACHE / "bookworm-minbase.tar"


def run_group(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
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
        return run_group([*self.wrap, self.exe, "--root", str(self.root), "--runroot", str(self.runroot),
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
                run_group([self.exe, "unshare", "rm", "-rf", str(self.top)], 300)
        for r in removed:
            assert r.returncode == 0, r.stderr
        assert left == ([], []), f"left in the storage after rm/rmi --all: {left}"
        assert not self.top.exists(), f"{self.top} could not be removed"


def cached_rootfs_tar(tmp_path_factory: pytest.TempPathFactory) -> Path:
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
        run = run_group([require_tool("debootstrap"), "--variant=minbase", "bookworm", str(root)], 900)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        subprocess.run([tar, "-C", str(root), "--numeric-owner", "-cf", str(part), "."], check=True, timeout=300)
        with open(part, "rb") as f:
            os.fsync(f.fileno())
        os.replace(part, ROOTFS_TAR)
    finally:
        part.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    return ROOTFS_TAR


def build_base_image(buildah: Buildah, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Dockerfile's base, made locally from Debian bookworm (minbase), under our own name."""
    rootfs_tar = cached_rootfs_tar(tmp_path_factory)
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


def build_image(buildah: Buildah, base_image: str, name: str) -> str:
    """The repository's Dockerfile built over ``base_image`` as ``name``."""
    args = ["bud", "--isolation=chroot", "--pull-never", "--build-arg", f"BASE_IMAGE={base_image}",
            "-t", name, "-f", str(DOCKERFILE)]
    if HOST_CA.exists():
        args += ["--build-arg", "PIP_CERT=/run/host-ca.crt", "-v", f"{HOST_CA}:/run/host-ca.crt:ro"]
    built = buildah(*args, str(REPO))
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return name
