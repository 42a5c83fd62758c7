"""The native kernel is built in this install and chosen by default; KVX_LAYOUTS_NATIVE steers it.

A broken C build must fail here (CI), not quietly fall back to the slower PyTorch path.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import subprocess
import sys
import sysconfig
from unittest.mock import patch

import numpy as np
import pytest
import torch

from kvx.layouts import NHD, _kernels, kv_postprocess_blksize_and_layout_on_receive

CHOICE = (
    "import warnings; warnings.simplefilter('error');"
    "from kvx.layouts import _kernels; print(_kernels.native is not None)"
)


def python_with(env_value: str | None, code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != _kernels.NATIVE_ENV}
    if env_value is not None:
        env[_kernels.NATIVE_ENV] = env_value
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


def test_native_module_is_built() -> None:
    module = _kernels.load_native("1")
    assert module.__file__ is not None
    assert module.__file__.endswith(sysconfig.get_config_var("EXT_SUFFIX"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("value", "chosen"), [(None, "True"), ("1", "True"), ("0", "False")])
def test_env_chooses_the_kernel_without_warnings(value: str | None, chosen: str) -> None:
    out = python_with(value, CHOICE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == chosen


@pytest.mark.timeout(60)
def test_bad_env_value_names_the_variable() -> None:
    out = python_with("yes", "import kvx.layouts._kernels")
    assert out.returncode != 0
    assert "KVX_LAYOUTS_NATIVE must be 0, 1 or unset, got 'yes'" in out.stderr


def test_missing_build_warns_once_or_fails_when_required() -> None:
    with patch.dict(sys.modules, {"kvx.layouts._native": None}):
        with pytest.warns(RuntimeWarning, match=r"native kernel not built .* KVX_LAYOUTS_NATIVE=0"):
            assert _kernels.load_native(None) is None
        with pytest.raises(ImportError, match="KVX_LAYOUTS_NATIVE=1 but the native kernel"):
            _kernels.load_native("1")


def test_transforms_call_the_native_kernel() -> None:
    kernel = _kernels.load_native("1")
    cache = NHD.allocate(8, 16, 2, 8, dtype=torch.bfloat16)[0]
    calls = []
    real = kernel.gather_scatter

    def counting(*args: object) -> None:
        calls.append(args)
        real(*args)

    with patch.object(_kernels, "native", kernel), patch.object(kernel, "gather_scatter", counting):
        kv_postprocess_blksize_and_layout_on_receive(cache, [5, 1, 2], 2)
    assert len(calls) == 1


def test_native_kernel_checks_its_arguments() -> None:
    kernel = _kernels.load_native("1")
    ids = torch.zeros(2, dtype=torch.long)
    buf = torch.arange(16, dtype=torch.int32)
    transposed = torch.arange(16, dtype=torch.int32).view(4, 4).T.flatten()
    # one block of [4, 4] int32, rewritten in place transposed; the repeated id moves it once
    good = [buf.data_ptr(), (1, 4, 4), (16, 4, 1), ids.data_ptr(), 1]
    good += [buf.data_ptr(), (1, 4, 4), (16, 1, 4), ids.data_ptr(), 1, 2, 4, 1, True, True]
    kernel.gather_scatter(*good)
    assert torch.equal(buf, transposed)
    other = torch.zeros(2, dtype=torch.long)
    for at, value, error, message in (
        (11, 3, ValueError, "element size must be 1, 2, 4, 8 or 16 bytes, got 3"),
        (12, 0, ValueError, "1 <= threads"),
        (1, (1, 4, 0), ValueError, "src: need blocks plus <= 16 dims of size >= 1"),
        (7, (16, 4, -1), ValueError, "dst: need blocks plus <= 16 dims"),
        (6, (1, 2, 4), ValueError, "a unit is 16 source elements but 8 destination elements"),
        (1, (0, 4, 4), IndexError, "src: block id 0 is out of range for 0 blocks"),
        (8, other.data_ptr(), ValueError, "in place needs the same tensor address, ids"),
    ):
        bad = list(good)
        bad[at] = value
        with pytest.raises(error, match=message):
            kernel.gather_scatter(*bad)
    assert torch.equal(buf, transposed)


def _fork_case() -> torch.Tensor:
    # numpy, not torch.arange: PyTorch's OpenMP pool hangs in a child forked after it ran
    return torch.from_numpy(np.arange(64 * 16 * 8 * 128, dtype=np.int32).reshape(64, 16, 8, 128))


def _native_transform_digest() -> str:
    """sha256 of the case after the native transform, run on the worker pool."""
    cache = _fork_case()
    with (
        patch.object(_kernels, "native", _kernels.load_native("1")),
        patch.object(_kernels, "NATIVE_BYTES_PER_THREAD", 1),
    ):
        kv_postprocess_blksize_and_layout_on_receive(cache, list(range(0, 64, 3)), 4)
    return hashlib.sha256(cache.numpy().tobytes()).hexdigest()


def _check_in_child(expected: str) -> None:
    raise SystemExit(0 if _native_transform_digest() == expected else 1)


@pytest.mark.timeout(60)
def test_worker_pool_survives_fork() -> None:
    # The parent's pool threads do not exist in a forked child; the child builds its own.
    expected = _fork_case()
    with patch.object(_kernels, "native", None):
        kv_postprocess_blksize_and_layout_on_receive(expected, list(range(0, 64, 3)), 4)
    digest = hashlib.sha256(expected.numpy().tobytes()).hexdigest()
    assert _native_transform_digest() == digest
    child = multiprocessing.get_context("fork").Process(target=_check_in_child, args=(digest,))
    child.start()
    try:
        child.join(timeout=45)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join()
