"""The example store connector (examples/kvx-example-store) through its own three-line kit test
file, from plain pytest: a lean subset of what it claims (its full run passes every one of its
25 claimed scenarios, but takes minutes), and what it must not claim."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvx_package_tests import run_package_tests

from kvx import Capability
from kvx_example_store.connector import ExampleStoreConnector

PACKAGE = Path(__file__).resolve().parents[2] / "examples" / "kvx-example-store"


def test_it_claims_store_reuse_and_store_pd_only() -> None:
    assert ExampleStoreConnector.capabilities == {Capability.STORE_REUSE, Capability.STORE_PD}


@pytest.mark.timeout(600)
def test_the_packages_own_kit_passes_store_reuse_store_pd_and_a_bfloat16_cell(
    tmp_path: Path,
) -> None:
    """P/D through the store on fragmented free lists (a 300-token prompt D must load), a local
    prefix hit mixed with a stored one, the leak check at shutdown, and the matrix's bfloat16
    cell with its 70-block prompt; P/D-only scenarios are reported as not claimed."""
    chosen = (
        "pd_long_prompts or store_and_reuse or clean_shutdown or matrix or claims_cover "
        "or window_pd"
    )
    result = run_package_tests(
        PACKAGE,
        "-k",
        chosen,
        "--kvx-dtype",
        "bfloat16",
        "--kvx-block-size",
        "16",
        "-rs",
        "--basetemp",
        str(tmp_path / "base"),
        timeout=580,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "5 passed, 3 skipped" in out, out
    assert "not claimed: needs remote_prefill" in out, out
    assert (
        "ExampleStoreConnector: 4 passed, 3 not claimed; KV transfers tested by matrix, "
        "pd_long_prompts, store_and_reuse" in out
    ), out
