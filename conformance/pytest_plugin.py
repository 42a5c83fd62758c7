"""pytest plugin of the conformance kit (`kvx.conformance.kit`); pytest loads it through its
`pytest11` entry point, or `-p kvx.conformance`.

It provides the kit's default fixtures (`kvx_config` from `--kvx-config`, `kvx_options` from
the timeout options, `kvx_allow_no_transfer`, `kvx_fail_fast`, `kvx_registry`), and with
`--kvx-config` it also collects `kvx/conformance/cli_suite.py`, a kit subclass, so
`pytest -p kvx.conformance --kvx-config '<json>'` runs the whole suite as ordinary test
items, with ids such as `kvx_conformance.py::TestKvxConformance::test_pd_short_prompt` that
select the item again when passed back as an argument. The terminal summary says per
connector what was tested.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvx.conformance.options import block_size, dtype_name, positive_seconds

CLI_SUITE = Path(__file__).with_name("cli_suite.py")
SUITE_ID = "kvx_conformance.py"  # the node id of CLI_SUITE, re-runnable as an argument
# What the kit's scenario tests report, for the terminal summary: (connector, scenario, outcome).
RESULTS_KEY = pytest.StashKey[list[tuple[str, str, str]]]()
# Per connector config (its JSON), the first scenario that failed (for --kvx-fail-fast).
FIRST_FAILURE_KEY = pytest.StashKey[dict[str, str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvx", "kvx connector conformance")
    group.addoption(
        "--kvx-config",
        metavar="JSON|@FILE",
        default=None,
        help="connector config to run the kvx conformance suite against",
    )
    group.addoption(
        "--kvx-fault-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="how long fault scenarios wait for a connector to give up",
    )
    group.addoption(
        "--kvx-stall-timeout",
        type=positive_seconds,
        default=10.0,
        metavar="SECONDS",
        help="fail a P/D run that makes no progress this long, saying what is stuck",
    )
    group.addoption(
        "--kvx-scenario-timeout",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="overall limit of every scenario (default: each scenario's own)",
    )
    group.addoption(
        "--kvx-dtype",
        action="append",
        type=dtype_name,
        default=None,
        help="narrow the matrix scenario to this KV dtype (repeatable; default: all)",
    )
    group.addoption(
        "--kvx-block-size",
        action="append",
        type=block_size,
        default=None,
        help="narrow the matrix scenario to this block size (repeatable; default: 16 and 32)",
    )
    group.addoption(
        "--kvx-fail-fast",
        action="store_true",
        help="after a config's first failing scenario, skip its other scenarios (the rest of "
        "the session still runs; -x stops everything)",
    )
    group.addoption(
        "--kvx-allow-no-transfer",
        action="store_true",
        help="pass even if the connector's claims leave no scenario that moves KV",
    )


def pytest_configure(config: pytest.Config) -> None:
    raw = config.getoption("kvx_config")
    if raw is None:
        return
    _parse_config(raw)  # a bad --kvx-config is a usage error before anything runs
    args = [_resolve_suite_id(str(arg)) for arg in config.args]
    if not any(arg.partition("::")[0] == str(CLI_SUITE) for arg in args):
        args.append(str(CLI_SUITE))
    config.args[:] = args


def _resolve_suite_id(arg: str) -> str:
    path, sep, rest = arg.partition("::")
    return f"{CLI_SUITE}{sep}{rest}" if path == SUITE_ID else arg


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    """The suite file lives in kvx's installation, outside the rootdir: give it an id of its
    own instead of an empty one."""
    if module_path == CLI_SUITE:
        return pytest.Module.from_parent(parent, path=module_path, nodeid=SUITE_ID)
    return None


def _parse_config(raw: str) -> dict[str, Any]:
    from kvx import get_registry
    from kvx.config.transfer import load_cli_arg
    from kvx.conformance.runner import connector_claims
    from kvx.errors import ConfigError, RegistryError

    try:
        kv = load_cli_arg(raw)
        if not isinstance(kv, dict):
            raise pytest.UsageError(f"--kvx-config: expected a JSON object, got {kv!r}")
        connector_claims(kv, get_registry())
    except (ConfigError, RegistryError) as exc:
        raise pytest.UsageError(f"--kvx-config: {exc}") from None
    return kv


@pytest.fixture
def kvx_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The connector config under test: `--kvx-config`, unless a conftest.py or the test class
    defines its own `kvx_config` fixture."""
    raw = request.config.getoption("kvx_config")
    if raw is None:
        pytest.fail(
            "no connector config: define a `kvx_config` fixture (in conftest.py or on the test "
            "class) returning the kv_transfer_config dict, or pass --kvx-config",
            pytrace=False,
        )
    return _parse_config(raw)


@pytest.fixture
def kvx_options(request: pytest.FixtureRequest) -> Any:
    """Timeouts of every scenario (`SuiteOptions`), from the `--kvx-*-timeout` options."""
    from kvx.conformance.options import BLOCK_SIZES, DTYPES, SuiteOptions

    get = request.config.getoption
    return SuiteOptions(
        get("kvx_fault_timeout"),
        get("kvx_stall_timeout"),
        get("kvx_scenario_timeout"),
        tuple(get("kvx_dtype") or DTYPES),
        tuple(get("kvx_block_size") or BLOCK_SIZES),
    )


@pytest.fixture
def kvx_allow_no_transfer(request: pytest.FixtureRequest) -> bool:
    """Whether claims that leave no KV transfer scenario are accepted."""
    return bool(request.config.getoption("kvx_allow_no_transfer"))


@pytest.fixture
def kvx_fail_fast(request: pytest.FixtureRequest) -> bool:
    """Whether a config's scenarios after its first failure are skipped (`--kvx-fail-fast`)."""
    return bool(request.config.getoption("kvx_fail_fast"))


@pytest.fixture
def kvx_registry() -> Any:
    """The registry the connector is resolved from (`kvx.get_registry()`)."""
    from kvx import get_registry

    return get_registry()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    results = config.stash.get(RESULTS_KEY, [])
    if not results:
        return
    from kvx.conformance.runner import OUTCOMES, PASSED, load_scenarios

    scenarios = load_scenarios()
    terminalreporter.section("kvx conformance")
    for connector in dict.fromkeys(c for c, _, _ in results):
        mine = [(name, outcome) for c, name, outcome in results if c == connector]
        tested = sorted({n for n, o in mine if o == PASSED and scenarios[n].transfers})
        counts = {o: sum(x == o for _, x in mine) for o in OUTCOMES}
        line = ", ".join(f"{n} {o.lower()}" for o, n in counts.items() if n)
        what = f"KV transfers tested by {', '.join(tested)}" if tested else "NO KV transfer tested"
        terminalreporter.write_line(f"{connector}: {line}; {what}")
