"""Run a reference engine in its own OS process and drive it over ZMQ (msgpack, no pickle).

`EngineProcess` spawns the process, which binds a REP socket on 127.0.0.1 and answers typed
commands. Every call has a timeout: a child that hangs or dies is killed and the call raises
`EngineTimeout`, so nothing waits forever.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from kvx import wire
from kvx.engine.engine import Engine, EngineConfig
from kvx.engine.scheduler import RequestOutput
from kvx.errors import ConfigError, ConfigProblem, RegistryError


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    kv_transfer_params: dict[str, Any] | None = None


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Step(msgspec.Struct, tag=True):
    pass


class CheckKV(msgspec.Struct, tag=True):
    pass


class Diagnose(msgspec.Struct, tag=True):
    pass


class Shutdown(msgspec.Struct, tag=True):
    pass


Command = AddRequest | Abort | Step | CheckKV | Diagnose | Shutdown


class Reply(msgspec.Struct):
    error: str | None = None
    outputs: list[RequestOutput] = []
    pending: bool = False
    mismatches: list[str] = []
    stats: dict[str, Any] = {}
    violations: list[str] = []
    diagnosis: list[str] = []


class EngineError(RuntimeError):
    """The engine process reported an error for a command."""


class EngineTimeout(EngineError):
    """The engine process did not answer in time (it was killed)."""


def _handle(engine: Engine, cmd: Command) -> Reply:
    if isinstance(cmd, AddRequest):
        engine.add_request(
            cmd.request_id, cmd.prompt_token_ids, cmd.max_tokens, cmd.kv_transfer_params
        )
        return Reply(pending=True)
    if isinstance(cmd, Abort):
        engine.abort_request(cmd.request_id)
        return Reply(pending=engine.has_pending_work())
    if isinstance(cmd, Step):
        outputs = engine.step()
        return Reply(
            outputs=outputs,
            pending=engine.has_pending_work(),
            stats=engine.stats(),
            violations=engine.take_violations(),
        )
    if isinstance(cmd, Diagnose):
        return Reply(diagnosis=engine.diagnose(), pending=engine.has_pending_work())
    if isinstance(cmd, CheckKV):
        return Reply(mismatches=engine.check_kv(), pending=engine.has_pending_work())
    return Reply()


def _serve(config_bytes: bytes, conn: Connection) -> None:
    """Child process main: build the engine, report the port, answer until Shutdown."""
    parent = os.getppid()
    try:
        engine = Engine(wire.decode(config_bytes, EngineConfig))
    except ConfigError as exc:  # bad input: the parent raises it again as a ConfigError
        conn.send(("config", [(p.path, p.message) for p in exc.problems]))
        return
    except RegistryError as exc:  # e.g. a connector's missing dependency
        conn.send(("config", [("kv_connector", str(exc))]))
        return
    except Exception as exc:
        conn.send(f"error: {type(exc).__name__}: {exc}")
        return
    context = zmq.Context()
    sock = context.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    try:
        while os.getppid() == parent:
            if not sock.poll(500):
                continue
            raw = sock.recv()
            cmd: Command | None = None
            try:
                cmd = wire.decode(raw, Command, max_bytes=1 << 20)  # type: ignore[arg-type]
                reply = _handle(engine, cmd)
            except Exception as exc:  # report, keep serving
                reply = Reply(error=f"{type(exc).__name__}: {exc}")
            sock.send(wire.encode(reply))
            if isinstance(cmd, Shutdown):
                break
    finally:
        try:
            engine.shutdown()
        finally:
            sock.close(0)
            context.term()


class EngineProcess:
    """A reference engine in a child process."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        name: str = "engine",
        timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.name = name
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_serve, args=(wire.encode(config), child_conn), name=name, daemon=True
        )
        self.process.start()
        child_conn.close()
        if not parent_conn.poll(start_timeout_s):
            self.kill()
            raise EngineTimeout(f"{name} did not start within {start_timeout_s:.0f}s")
        try:
            first = parent_conn.recv()
        except EOFError:
            self.kill()
            raise EngineError(
                f"{name} exited during start-up (exit code {self.process.exitcode})"
            ) from None
        if isinstance(first, tuple):
            self.process.join(5)
            raise ConfigError(
                ConfigProblem(path, f"{message} ({name})") for path, message in first[1]
            )
        if isinstance(first, str):
            self.process.join(5)
            raise EngineError(f"{name} failed to start: {first.removeprefix('error: ')}")
        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self._sock.connect(f"tcp://127.0.0.1:{first}")
        self.last_stats: dict[str, Any] = {}
        self.violations: list[str] = []  # contract violations reported by every step so far

    def _call(self, cmd: Command) -> Reply:
        if not self.process.is_alive():
            raise EngineError(f"{self.name} is not running (exit code {self.process.exitcode})")
        try:
            self._sock.send(wire.encode(cmd))
            reply = wire.decode(self._sock.recv(), Reply)
        except zmq.Again:
            self.kill()
            raise EngineTimeout(
                f"{self.name} did not answer {type(cmd).__name__} within "
                f"{self.timeout_s:.0f}s; the process was killed"
            ) from None
        if reply.error is not None:
            raise EngineError(f"{self.name}: {reply.error}")
        return reply

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int = 16,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        self._call(AddRequest(request_id, list(prompt_token_ids), max_tokens, kv_transfer_params))

    def abort_request(self, request_id: str) -> bool:
        return self._call(Abort(request_id)).pending

    def step(self) -> tuple[list[RequestOutput], bool]:
        """One engine step: its outputs and whether work is still pending."""
        reply = self._call(Step())
        self.last_stats = reply.stats
        self.violations += reply.violations
        return reply.outputs, reply.pending

    def diagnose(self) -> list[str]:
        """What keeps the engine busy (see `Engine.diagnose`)."""
        return self._call(Diagnose()).diagnosis

    def check_kv(self) -> list[str]:
        return self._call(CheckKV()).mismatches

    def close(self, timeout_s: float = 30.0) -> None:
        """Shut the engine down cleanly; kill it if it does not exit in time."""
        if self.process.is_alive():
            with contextlib.suppress(EngineError):
                self._call(Shutdown())
            self.process.join(timeout_s)
        self.kill()
        self._sock.close(0)
        self._context.term()

    def kill(self) -> None:
        """Kill the process now (fault injection, or cleanup after a timeout)."""
        if self.process.is_alive():
            self.process.kill()
            deadline = time.monotonic() + 10
            while self.process.is_alive() and time.monotonic() < deadline:
                self.process.join(0.1)


class LocalEngine:
    """The same handle as `EngineProcess` over an engine in this process (no isolation, no
    spawn cost; the conformance suite uses it where no process has to die)."""

    def __init__(self, config: EngineConfig, *, name: str = "engine") -> None:
        self.name = name
        self.engine = Engine(config)
        self.last_stats: dict[str, Any] = {}
        self.violations: list[str] = []  # contract violations reported by every step so far

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int = 16,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        self.engine.add_request(request_id, prompt_token_ids, max_tokens, kv_transfer_params)

    def abort_request(self, request_id: str) -> bool:
        self.engine.abort_request(request_id)
        return self.engine.has_pending_work()

    def step(self) -> tuple[list[RequestOutput], bool]:
        outputs = self.engine.step()
        self.last_stats = self.engine.stats()
        self.violations += self.engine.take_violations()
        return outputs, self.engine.has_pending_work()

    def diagnose(self) -> list[str]:
        return self.engine.diagnose()

    def check_kv(self) -> list[str]:
        return self.engine.check_kv()

    def close(self) -> None:
        self.engine.shutdown()


EngineHandle = EngineProcess | LocalEngine
