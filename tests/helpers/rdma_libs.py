"""A host with the distribution's RDMA libraries (libibverbs1 and its providers), made privately
for the tests that check kvx on such hosts. Debian's packages are fetched with `apt-get download`
and unpacked into a cache directory; only the processes a test starts see them, through
`LD_LIBRARY_PATH`. Nothing is installed system-wide: every NIXL process on the machine that does
not go through kvx (another checkout, raw NIXL) would then crash at exit.

`.ci/run` hides apt-get from PATH (CI installs nothing from Debian); as root on Debian the
download still works through apt-get's absolute path (after `apt-get update` when the machine
has no package index yet). Where neither is possible (no Debian, not root, no network),
`rdma_env` raises `RdmaLibsUnavailable` and the tests skip, saying why. On a host that already
has libibverbs1, the host is used as is.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

PACKAGES = ("libibverbs1", "ibverbs-providers", "libnl-3-200", "libnl-route-3-200")
FAULTHANDLER = {"PYTHONFAULTHANDLER": "1"}  # a crash in any Python process prints its stack


class RdmaLibsUnavailable(RuntimeError):
    """The RDMA libraries are not installed and cannot be fetched here."""


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found is None and os.access(f"/usr/bin/{name}", os.X_OK):
        found = f"/usr/bin/{name}"
    return found


def _cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"kvx-rdma-libs-{os.getuid()}"


def _download(apt_get: str, into: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [apt_get, "download", *PACKAGES], cwd=into, capture_output=True, text=True, timeout=300
    )


def _fetch(root: Path) -> None:
    apt_get, dpkg_deb = _tool("apt-get"), _tool("dpkg-deb")
    if apt_get is None or dpkg_deb is None:
        raise RdmaLibsUnavailable("libibverbs1 is not installed and apt-get/dpkg-deb are missing")
    if os.geteuid() != 0:
        raise RdmaLibsUnavailable("libibverbs1 is not installed and fetching it needs root")
    staging = Path(tempfile.mkdtemp(prefix="kvx-rdma-libs-"))
    try:
        debs = staging / "debs"
        debs.mkdir()
        got = _download(apt_get, debs)
        if got.returncode != 0:  # no package index yet on a fresh machine: read it once
            subprocess.run([apt_get, "update", "-qq"], capture_output=True, timeout=300)
            got = _download(apt_get, debs)
        if got.returncode != 0:
            raise RdmaLibsUnavailable(f"apt-get download {' '.join(PACKAGES)} failed: {got.stderr}")
        unpacked = staging / "root"
        for deb in sorted(debs.glob("*.deb")):
            subprocess.run([dpkg_deb, "-x", str(deb), str(unpacked)], check=True, timeout=60)
        try:
            unpacked.rename(root)  # atomic: a concurrent run finds all of it or nothing
        except OSError:
            if not root.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def rdma_lib_dirs() -> list[str]:
    """The directories holding the private copy of the libraries ([] when the host has them)."""
    if ctypes.util.find_library("ibverbs") and ctypes.util.find_library("efa"):
        return []
    root = _cache_dir() / "root"
    if not root.is_dir():
        root.parent.mkdir(exist_ok=True)
        _fetch(root)
    dirs = sorted({str(p.parent) for p in root.rglob("*.so.*") if "libibverbs/" not in str(p)})
    if not dirs:
        raise RdmaLibsUnavailable(f"{root} holds no libraries")
    return dirs


def rdma_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a child process on a host with the RDMA libraries."""
    env = dict(os.environ if base is None else base)
    dirs = rdma_lib_dirs()
    if dirs:
        env["LD_LIBRARY_PATH"] = ":".join([*dirs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    return {**env, **FAULTHANDLER}
