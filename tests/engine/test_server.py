"""EngineProcess (an engine in a spawned child process) and `kvx demo` end to end."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvx.contract.types import RequestStatus
from kvx.engine import Engine, EngineConfig, RequestOutput
from kvx.engine.server import EngineError, EngineProcess, EngineTimeout

CONFIG = EngineConfig(num_layers=2, num_kv_heads=2, head_size=8, block_size=16, num_blocks=16)
PROMPTS = {"a": [(5 * i + 3) % 1000 for i in range(21)], "b": [(11 * i) % 1000 for i in range(9)]}
KVX = Path(sys.executable).parent / "kvx"


def summary(outputs: list[RequestOutput]) -> list[tuple[object, ...]]:
    return [
        (o.request_id, o.new_token_ids, o.output_token_ids, o.finished, o.status) for o in outputs
    ]


def in_process_run() -> list[list[tuple[object, ...]]]:
    engine = Engine(CONFIG)
    steps = []
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, 3)
    while engine.has_pending_work():
        steps.append(summary(engine.step()))
    return steps


def children_named(name: str) -> list[mp.process.BaseProcess]:
    return [p for p in mp.active_children() if p.name == name]


@pytest.mark.timeout(90)
def test_engine_process_serves_add_step_check_kv_and_reports_errors() -> None:
    expected = in_process_run()
    engine = EngineProcess(CONFIG, name="srv-test", timeout_s=30)
    try:
        assert engine.process.is_alive() and engine.process.pid != os.getpid()
        for rid, prompt in PROMPTS.items():
            engine.add_request(rid, prompt, 3)
        with pytest.raises(EngineError) as info:
            engine.add_request("a", [1, 2], 1)
        assert str(info.value) == "srv-test: ValueError: request id 'a' is already in use"
        with pytest.raises(EngineError, match=r"^srv-test: ValueError: request 'e' has an empty"):
            engine.add_request("e", [], 1)
        steps = []
        pending = True
        while pending:
            outputs, pending = engine.step()
            steps.append(summary(outputs))
            assert engine.check_kv() == []
            assert len(steps) < 20
        assert steps == expected  # same outputs as the same engine in this process
        finished = [o for outputs in steps for o in outputs if o[3]]
        assert [(o[0], o[4]) for o in finished] == [
            ("a", RequestStatus.FINISHED_LENGTH_CAPPED),
            ("b", RequestStatus.FINISHED_LENGTH_CAPPED),
        ]
        assert engine.last_stats["steps"] == len(steps)
        assert engine.last_stats["free_blocks"] == 16
        engine.add_request("c", PROMPTS["a"], 5)
        assert engine.abort_request("c") is True  # the abort is reported by the next step
        outputs, pending = engine.step()
        assert summary(outputs) == [("c", [], [], True, RequestStatus.FINISHED_ABORTED)]
    finally:
        engine.close()
    assert not engine.process.is_alive() and engine.process.exitcode is not None
    assert children_named("srv-test") == []


@pytest.mark.timeout(60)
def test_kill_then_call_raises_quickly() -> None:
    engine = EngineProcess(CONFIG, name="srv-kill", timeout_s=30)
    try:
        engine.kill()
        assert not engine.process.is_alive()
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"^srv-kill is not running \(exit code -9\)$"):
            engine.step()
        with pytest.raises(EngineError, match="srv-kill is not running"):
            engine.add_request("a", [1], 1)
        assert time.monotonic() - start < 2
    finally:
        engine.close()
    assert children_named("srv-kill") == []


@pytest.mark.timeout(60)
def test_a_hung_child_times_out_and_is_killed() -> None:
    engine = EngineProcess(CONFIG, name="srv-hang", timeout_s=2)
    try:
        assert engine.process.pid is not None
        os.kill(engine.process.pid, signal.SIGSTOP)  # alive, but never answers
        start = time.monotonic()
        with pytest.raises(EngineTimeout, match=r"^srv-hang did not answer Step within 2s; the"):
            engine.step()
        assert time.monotonic() - start < 15
        assert not engine.process.is_alive()
        with pytest.raises(EngineError, match="srv-hang is not running"):
            engine.check_kv()
    finally:
        if engine.process.is_alive() and engine.process.pid is not None:
            os.kill(engine.process.pid, signal.SIGCONT)
        engine.close()
    assert children_named("srv-hang") == []


@pytest.mark.timeout(60)
def test_bad_config_fails_at_start_with_the_childs_message() -> None:
    start = time.monotonic()
    with pytest.raises(EngineError) as info:
        EngineProcess(
            EngineConfig(num_layers=2, num_kv_heads=2, head_size=8, layout="NDH"), name="srv-bad"
        )
    assert type(info.value) is EngineError
    assert str(info.value).startswith(
        "srv-bad failed to start: ValueError: KVCacheSpec.layout: 'NDH' is not a registered "
        'layout (did you mean "NHD"?); known: '
    )
    assert time.monotonic() - start < 45
    deadline = time.monotonic() + 10
    while children_named("srv-bad") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert children_named("srv-bad") == []


# -- kvx demo --------------------------------------------------------------------------------


def kvx(*args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [str(KVX), *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def summary_row(stdout: str, metric: str) -> str:
    """The value of `metric` in the demo's summary table."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(f"│ {metric} ")]
    return line.split("│")[-2].strip()


@pytest.mark.timeout(120)
def test_kvx_demo_end_to_end() -> None:
    assert KVX.exists()
    result = kvx("demo", "--prompts", "3", "--max-tokens", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary_row(result.stdout, "outputs identical to baseline") == "yes"
    assert summary_row(result.stdout, "KV byte checks") == "passed"
    assert summary_row(result.stdout, "requests") == "3"
    assert "3 prompts, layout NHD, block size 16" in result.stdout


@pytest.mark.timeout(120)
def test_kvx_demo_with_tp2_and_hnd() -> None:
    # 3 prompts: the shortest two fill no block, and a demo that moves no KV fails
    result = kvx("demo", "--tp", "2:2", "--layout", "HND", "--prompts", "3", "--max-tokens", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(TP 2) to decode (TP 2), 3 prompts, layout HND" in result.stdout
    assert summary_row(result.stdout, "outputs identical to baseline") == "yes"
    assert summary_row(result.stdout, "requests") == "3"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "x"], "--tp: 'x' is not of the form P:D with integers 1-16, e.g. 2:1"),
        (["--tp", "2:0"], "--tp: '2:0' is not of the form P:D with integers 1-16, e.g. 2:1"),
        (["--prompts", "0"], "argument --prompts: '0' is not allowed: use a whole number of 1"),
    ],
)
def test_kvx_demo_bad_arguments_exit_2(args: list[str], message: str) -> None:
    result = kvx("demo", *args, timeout=50)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
