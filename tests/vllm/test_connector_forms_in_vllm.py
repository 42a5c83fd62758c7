"""Every documented way of naming a kvx connector in vLLM's `--kv-transfer-config` runs it, and
every way of getting it wrong ends in kvx's message (docs/writing-a-connector.md, section 7).

The author's connector is the example connector's code copied into a temporary source
directory as the package `my_pd_connector` with the class `MyPDConnector`: no distribution
provides it and no `kvx` entry point names it (the example itself is installed in .venv-vllm,
so an unrenamed copy would still be registered). A child process with that directory on
PYTHONPATH runs P by module path in a multiprocess vLLM engine (the engine core is a spawned
process that finds the module only through PYTHONPATH and kvx's vLLM plugin), stores its
hand-off and exits. Then a D engine per documented form, in this process, loads a copy of it:
the unpackaged forms name the copy, the registered forms the installed example connector.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import kvx

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
EXAMPLE_PACKAGE = HERE.parents[1] / "examples" / "kvx-example-connector" / "kvx_example_connector"
MODULE = "my_pd_connector.connector"
CLASS = "MyPDConnector"
ADAPTER = "kvx.adapters.vllm"
GENERIC = "KvxConnector"
CHILD_TIMEOUT_S = 240


def copy_as_unpackaged(src: Path) -> Path:
    """The example connector's source as `my_pd_connector` in `src` (returned): renamed package
    and class, its `kvx` plugin module left out."""
    package = src / "my_pd_connector"
    shutil.copytree(EXAMPLE_PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "_plugin.py").unlink()
    for path in package.glob("*.py"):
        text = path.read_text().replace("kvx_example_connector", "my_pd_connector")
        path.write_text(text.replace("ExamplePDConnector", CLASS))
    return src


def kv(connector: str, role: str, module: str | None = ADAPTER, **extra: Any) -> dict[str, Any]:
    config = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
    if module is not None:
        config["kv_connector_module_path"] = module
    return config


@dataclass
class Handoff:
    """What P, run from the unpackaged source in a child process, left for D."""

    root: Path
    result: dict[str, Any]  # module_file, tokens (P's first), params (for D)


def run_child(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """(exit code, stderr) of `command`; on a timeout its whole process group (vLLM's engine
    core included) is killed and the test fails with the end of its stderr."""
    child = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        _, err = child.communicate()
        raise AssertionError(
            f"{command[1]} did not finish in {CHILD_TIMEOUT_S}s; stderr ends:\n{err[-3000:]}"
        ) from None
    return child.returncode, err


@pytest.fixture(scope="module")
def author_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_as_unpackaged(tmp_path_factory.mktemp("author") / "src")


@pytest.fixture(scope="module")
def author_importable(author_src: Path) -> Iterator[Path]:
    """The unpackaged connector importable in this process too (its in-process engines)."""
    sys.path.insert(0, str(author_src))
    yield author_src
    sys.path.remove(str(author_src))


@pytest.fixture(scope="module")
def handoff(harness: Any, author_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Handoff:
    work = tmp_path_factory.mktemp("producer")
    job = {
        "model": str(harness.model),
        "options": harness.engine_options,
        "prompts": harness.prompts,
        "module": MODULE,
        "p_dir": str(work / "handoff"),
        "p_kv": kv(CLASS, "kv_producer", MODULE, directory=str(work / "handoff")),
    }
    (work / "job.json").write_text(json.dumps(job))
    env = {
        **os.environ,
        "PYTHONPATH": str(author_src),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }
    code, err = run_child([sys.executable, str(HERE / "unpackaged_producer.py"), str(work)], env)
    assert code == 0, f"P (unpackaged_producer.py) failed ({code}); stderr ends:\n{err[-4000:]}"
    return Handoff(work / "handoff", json.loads((work / "result.json").read_text()))


def test_unpackaged_producer_ran_from_the_source_directory(
    baseline: list[list[int]], author_src: Path, handoff: Handoff
) -> None:
    assert handoff.result["module_file"] == str(author_src / "my_pd_connector" / "connector.py")
    assert CLASS not in kvx.get_registry().connectors()  # nothing registers it
    assert handoff.result["tokens"] == [t[:1] for t in baseline]
    assert all(p["do_remote_prefill"] for p in handoff.result["params"])


FORMS = {
    "module-path": kv(CLASS, "kv_consumer", MODULE),
    "module-class": kv(GENERIC, "kv_consumer", kvx_connector=f"{MODULE}:{CLASS}"),
    "registered-name": kv("ExamplePDConnector", "kv_consumer"),
    "plugin-name": kv("kvx.ExamplePDConnector", "kv_consumer", module=None),
    "generic": kv(GENERIC, "kv_consumer", kvx_connector="ExamplePDConnector"),
    "alias": kv("ExamplePDConnectorV1", "kv_consumer"),
}
HOSTED = {
    "module-path": ("my_pd_connector.connector", CLASS),
    "module-class": ("my_pd_connector.connector", CLASS),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_decodes_the_handoff_like_one_engine(
    harness: Any,
    baseline: list[list[int]],
    handoff: Handoff,
    author_importable: Path,
    tmp_path: Path,
    form: str,
) -> None:
    directory = tmp_path / "handoff"
    shutil.copytree(handoff.root, directory)
    config = json.loads(json.dumps(FORMS[form]))
    config["kv_connector_extra_config"]["directory"] = str(directory)
    with harness.engine(config) as llm:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        hosted = type(get_kv_transfer_group().kvx_connector)
        rec = harness.record(llm)
        outputs = harness.generate(llm, params=[dict(p) for p in handoff.result["params"]])
    expected = HOSTED.get(form, ("kvx_example_connector.connector", "ExamplePDConnector"))
    assert (hosted.__module__, hosted.__name__) == expected
    assert harness.tokens(outputs) == baseline
    assert len([spec for meta in rec.metadata for spec in meta.loads]) == len(outputs)
    assert not list(directory.rglob("*.kv")), "D left hand-off files unread"  # D consumes them


# Each documented form with each of three mistakes: the package is missing, a name is
# misspelt, the module path is wrong (for the plugin name: the `kvx.` prefix forgotten, so no
# module path at all). The fragments must all be on the last line of the traceback.
MISSING_PKG = "my_connector.connector"  # the docs' example package: installed nowhere
HINT_INSTALL = "installed into the Python vLLM runs"
HINT_PATH = "on PYTHONPATH where vLLM starts"
ERROR = "kvx.adapters.vllm_plugin.KvxConnectorError: "
MISTAKES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "registered-name/missing-package": (
        kv("MyConnector", "kv_both"),
        [
            ERROR + 'kv_connector "MyConnector" is not a registered kvx connector',
            '; known: "ExampleConnector", "ExamplePDConnector", ',
            HINT_INSTALL,
            '"kv_connector_module_path": "<module>"',
        ],
    ),
    "registered-name/misspelt": (
        kv("ExamplePDConector", "kv_both"),
        [ERROR + 'kv_connector "ExamplePDConector"', '(did you mean "ExamplePDConnector"?)'],
    ),
    "registered-name/bad-module-path": (
        kv("ExamplePDConnector", "kv_both", module="kvx.adapters.vlm"),
        [
            'ModuleNotFoundError: kv_connector_module_path "kvx.adapters.vlm" cannot be imported',
            'package "kvx.adapters"',
            'has no module "vlm" (did you mean "kvx.adapters.vllm"?)',
        ],
    ),
    "plugin-name/missing-package": (
        kv("kvx.MyConnector", "kv_both", module=None),
        [
            ERROR + 'kv_connector "kvx.MyConnector" is not a registered kvx connector',
            '; known: "kvx.ExampleConnector", "kvx.ExamplePDConnector", ',
            HINT_INSTALL,
        ],
    ),
    "plugin-name/misspelt": (
        kv("kvx.ExamplePDConector", "kv_both", module=None),
        [ERROR, '(did you mean "kvx.ExamplePDConnector"?)'],
    ),
    "plugin-name/no-prefix-no-module-path": (
        kv("ExamplePDConnector", "kv_both", module=None),
        [
            ERROR + 'kv_connector "ExamplePDConnector" is a kvx connector, not one of vLLM\'s',
            'name it "kvx.ExamplePDConnector", or add "kv_connector_module_path": '
            '"kvx.adapters.vllm"',
        ],
    ),
    "generic/missing-package": (
        kv(GENERIC, "kv_both", kvx_connector="MyConnector"),
        [
            ERROR + "invalid KV transfer config: kv_connector_extra_config.kvx_connector: "
            '"MyConnector" is not a registered kvx connector',
            '; known: "ExampleConnector", ',
            HINT_INSTALL,
        ],
    ),
    "generic/misspelt": (
        kv(GENERIC, "kv_both", kvx_connector="ExamplePDConector"),
        [ERROR, '(did you mean "ExamplePDConnector"?)'],
    ),
    "generic/bad-module-path": (
        kv(GENERIC, "kv_both", module="kvx.adapter.vllm", kvx_connector="ExamplePDConnector"),
        [
            'ModuleNotFoundError: kv_connector_module_path "kvx.adapter.vllm" cannot be imported',
            '(did you mean "kvx.adapters"?)',
        ],
    ),
    "alias/misspelt": (
        kv("ExamplePDConnectorV2", "kv_both"),
        [ERROR, '(did you mean "ExamplePDConnectorV1"?)'],
    ),
    "alias/bad-module-path": (
        kv("ExamplePDConnectorV1", "kv_both", module="kvx.vllm"),
        [
            'ModuleNotFoundError: kv_connector_module_path "kvx.vllm" cannot be imported',
            'package "kvx"',
            '"ExamplePDConnectorV1" is a registered kvx connector: its module path is '
            '"kvx.adapters.vllm", or name it "kvx.ExamplePDConnectorV1"',
        ],
    ),
    "module-path/missing-package": (
        kv("MyConnector", "kv_both", module=MISSING_PKG),
        [
            f'ModuleNotFoundError: kv_connector_module_path "{MISSING_PKG}" cannot be imported: '
            'no module named "my_connector"',
            "pip install -e <its source directory>",
            HINT_PATH,
        ],
    ),
    "module-path/misspelt": (
        kv("MyPDConector", "kv_both", module=MODULE),
        [
            f'AttributeError: kv_connector "MyPDConector": module "{MODULE}" has no attribute',
            f'(did you mean "{CLASS}"?); KV connector classes in it: "{CLASS}"',
        ],
    ),
    "module-path/bad-module-path": (
        kv(CLASS, "kv_both", module="my_pd_connector.conector"),
        [
            "ModuleNotFoundError: ",
            'package "my_pd_connector"',
            f'has no module "conector" (did you mean "{MODULE}"?)',
        ],
    ),
    # An unpackaged class's extra config is checked like a registered one's (its
    # `extra_config_schema`).
    "module-path/bad-extra-key": (
        kv(CLASS, "kv_both", module=MODULE, directry="/tmp/x"),
        [
            ERROR + "invalid KV transfer config: kv_connector_extra_config.directry: unknown key "
            '(did you mean "directory"?); allowed keys: "directory", "load_timeout_s"'
        ],
    ),
    "module-class/bad-extra-key": (
        kv(GENERIC, "kv_both", kvx_connector=f"{MODULE}:{CLASS}", load_timeout_s=0),
        [ERROR, "kv_connector_extra_config.load_timeout_s", "0"],
    ),
    "module-class/missing-package": (
        kv(GENERIC, "kv_both", kvx_connector=f"{MISSING_PKG}:MyConnector"),
        [
            ERROR + "invalid KV transfer config: kv_connector_extra_config.kvx_connector: "
            f'"{MISSING_PKG}:MyConnector": module "{MISSING_PKG}" cannot be imported: '
            'no module named "my_connector"',
            HINT_PATH,
        ],
    ),
    "module-class/misspelt": (
        kv(GENERIC, "kv_both", kvx_connector=f"{MODULE}:MyPDConector"),
        [ERROR, f'has no attribute "MyPDConector" (did you mean "{CLASS}"?)'],
    ),
    "module-class/bad-module-path": (
        kv(GENERIC, "kv_both", kvx_connector=f"my_pd_connector.conector:{CLASS}"),
        [ERROR, f'has no module "conector" (did you mean "{MODULE}"?)'],
    ),
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_mistake_ends_in_kvxs_message(harness: Any, author_importable: Path, case: str) -> None:
    """What `LLM(...)` (and `vllm serve`) raise while vLLM builds its config, before any
    engine starts: the last line of the traceback is kvx's, on one line."""
    config, fragments = MISTAKES[case]
    with pytest.raises(BaseException) as info, harness.engine(config):
        pass
    last = traceback.format_exception(info.value)[-1].rstrip("\n")
    assert "\n" not in last, last
    for fragment in fragments:
        assert fragment in last, f"{fragment!r} not on the last line:\n{last}"


# A fake, because the fault cannot be produced for real here: .venv-vllm has every package a
# built-in connector needs, LMCache included. A child process hides lmcache from imports (in
# this process, hiding and restoring a loaded lmcache breaks the engines of later tests).
_WITHOUT_LMCACHE = """
import json, sys, traceback
sys.modules["lmcache"] = None  # `import lmcache` fails as if it were not installed
import vllm
from vllm.config import KVTransferConfig
try:
    vllm.LLM(model=sys.argv[1], kv_transfer_config=KVTransferConfig(**json.loads(sys.argv[2])))
except BaseException as exc:
    print(traceback.format_exception(exc)[-1].rstrip(), file=sys.stderr)
    sys.exit(3)
"""


def test_an_alias_whose_package_is_missing_ends_in_kvxs_message(harness: Any) -> None:
    config = kv("LMCacheConnector", "kv_both")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    code, err = run_child(
        [sys.executable, "-c", _WITHOUT_LMCACHE, str(harness.model), json.dumps(config)], env
    )
    assert code == 3, err[-3000:]
    last = err.rstrip("\n").rsplit("\n", 1)[-1]
    for fragment in [
        ERROR + 'kv_connector "LMCacheConnector" needs "lmcache", which is not installed',
        "[lmcache]'",  # the install command for the way kvx was installed
    ]:
        assert fragment in last, f"{fragment!r} not on the last line:\n{last}"


def test_vllm_serve_prints_kvxs_message_last(harness: Any, author_src: Path) -> None:
    """The operator's view of one mistake: `vllm serve` itself stops before any engine starts,
    and the last line it prints is kvx's."""
    with socket.socket() as probe:  # a free port, in case vLLM binds before it builds config
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = kv(CLASS, "kv_both", module="my_pd_connector.conector")
    code, err = run_child(
        [
            str(Path(sys.executable).parent / "vllm"),
            "serve",
            str(harness.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--kv-transfer-config",
            json.dumps(config),
        ],
        {**os.environ, "PYTHONPATH": str(author_src)},
    )
    assert code != 0
    last = err.rstrip("\n").rsplit("\n", 1)[-1]
    assert last.startswith(
        'ModuleNotFoundError: kv_connector_module_path "my_pd_connector.conector" cannot be '
        'imported: package "my_pd_connector"'
    ), err[-3000:]
    assert f'(did you mean "{MODULE}"?)' in last
