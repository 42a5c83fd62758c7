"""Secrets from the JSON, an environment variable or a file (`kvx.resolve_secret`), redacted in
`kvx validate`'s output and never echoed in an error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import kvx
from kvx.cli.commands import main

SECRET = "s3cr3t-value-never-shown"
KEY = "kv_connector_extra_config.shared_secret"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def nixl(secret: object) -> str:
    return json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_secret": secret},
        }
    )


def secret_file(tmp_path: Path, mode: int, text: str = SECRET + "\n") -> Path:
    path = tmp_path / "secret"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_inline_env_and_file_give_the_same_secret(tmp_path: Path) -> None:
    path = secret_file(tmp_path, 0o600)
    assert kvx.resolve_secret(SECRET, KEY) == SECRET
    assert kvx.resolve_secret({"env": "KVX_T_SECRET"}, KEY, environ={"KVX_T_SECRET": SECRET}) == (
        SECRET
    )
    assert kvx.resolve_secret(kvx.SecretSource(file=str(path)), KEY) == SECRET  # newline dropped
    assert kvx.resolve_secret(None, KEY) is None


@pytest.mark.parametrize(
    ("source", "environ", "message"),
    [
        ({"env": "KVX_T_UNSET"}, {}, "environment variable KVX_T_UNSET is not set; export it"),
        ({"env": "KVX_T_SHORT"}, {"KVX_T_SHORT": "abc"}, "is 3 characters; use at least 8"),
        ({"env": "A", "file": "/x"}, {}, 'give exactly one of "env"'),
        ({}, {}, 'give exactly one of "env"'),
        ({"env": "1BAD"}, {}, "is not an environment variable name"),
        ({"file": "/nonexistent/kvx-secret"}, {}, "cannot read file '/nonexistent/kvx-secret'"),
    ],
)
def test_bad_sources_name_the_key_and_the_fix(
    source: dict[str, str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(kvx.ConfigError, match=message) as info:
        kvx.resolve_secret(source, KEY, min_length=8, environ=environ)
    assert str(info.value).startswith(f"invalid KV transfer config: {KEY}: ")


def test_a_file_others_can_read_is_refused_with_the_chmod(tmp_path: Path) -> None:
    path = secret_file(tmp_path, 0o644)
    with pytest.raises(kvx.ConfigError, match=f"mode 0644.*chmod 600 {path}") as info:
        kvx.resolve_secret({"file": str(path)}, KEY)
    assert SECRET not in str(info.value)


def test_validate_redacts_inline_secrets_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "validate", "--kv-transfer-config", nixl(SECRET))
    assert code == 0, err
    assert json.loads(out)["kv_connector_extra_config"]["shared_secret"] == "***"
    assert SECRET not in out + err
    assert f"note: {KEY} is given inline: anyone who can list" in err
    assert '{"env": "NAME"}' in err


def test_validate_keeps_a_source_and_checks_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    source = {"env": "KVX_T_NIXL_SECRET"}
    monkeypatch.delenv("KVX_T_NIXL_SECRET", raising=False)
    code, out, err = run(capsys, "validate", "--kv-transfer-config", nixl(source))
    assert code == 0, err  # the text is valid: the variable may be set where it runs
    assert json.loads(out)["kv_connector_extra_config"]["shared_secret"] == source
    assert "inline" not in err
    code, out, err = run(capsys, "validate", "--check", "--kv-transfer-config", nixl(source))
    assert code == 2 and out == ""
    assert f"{KEY}: environment variable KVX_T_NIXL_SECRET is not set" in err
    monkeypatch.setenv("KVX_T_NIXL_SECRET", SECRET)
    code, out, err = run(capsys, "validate", "--check", "--kv-transfer-config", nixl(source))
    assert code == 0, err
    assert SECRET not in out + err
    loose = secret_file(tmp_path, 0o640)
    code, _, err = run(
        capsys, "validate", "--check", "--kv-transfer-config", nixl({"file": str(loose)})
    )
    assert code == 2 and f"{KEY}: file {str(loose)!r} is open to its group" in err
    assert SECRET not in err


def test_the_same_secret_field_type_serves_redis_passwords(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "storage_url": "file:///tmp/kvx-never-used",
            "redis_password": {"env": "X"},
        },
    }
    code, _, err = run(capsys, "validate", "--kv-transfer-config", json.dumps(config))
    assert code == 2
    assert "kv_connector_extra_config.redis_password: only redis:// storage has a password" in err
    config["kv_connector_extra_config"] = {
        "storage_url": f"redis://:{SECRET}@127.0.0.1:6379/0",
        "redis_password": {"env": "X"},
    }
    code, _, err = run(capsys, "validate", "--kv-transfer-config", json.dumps(config))
    assert code == 2 and "storage_url has a password too; give it in one place" in err
    assert SECRET not in err


def test_secret_fields_are_found_by_type() -> None:
    from kvx.config.secrets import secret_fields
    from kvx.plugins.nixl.config import NixlConfig
    from kvx.plugins.p2p.config import P2pConfig
    from kvx.plugins.storage.config import SharedStorageConfig

    assert secret_fields(NixlConfig) == ("shared_secret",)
    assert secret_fields(SharedStorageConfig) == ("redis_password",)
    assert secret_fields(P2pConfig) == ("shared_secret",)
    assert os.environ.get("KVX_T_UNSET") is None


def test_nixl_reads_its_secret_from_the_environment_when_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvx.plugins.nixl.scheduler import NixlScheduler
    from kvx.plugins.nixl.worker import NixlWorker

    ctx = kvx.EngineContext(
        engine_id="e",
        model_name="m",
        cache=kvx.KVCacheSpec(("l0",), num_kv_heads=2, head_size=8, block_size=16),
    )
    config = kvx.KVTransferConfig.from_json(nixl({"env": "KVX_T_BUILD_SECRET"}))
    monkeypatch.delenv("KVX_T_BUILD_SECRET", raising=False)
    with pytest.raises(kvx.ConfigError, match=f"{KEY}: environment variable KVX_T_BUILD_SECRET"):
        kvx.create_connector(config, kvx.KVConnectorRole.SCHEDULER, ctx)
    monkeypatch.setenv("KVX_T_BUILD_SECRET", SECRET)
    for role, half in (
        (kvx.KVConnectorRole.SCHEDULER, NixlScheduler),
        (kvx.KVConnectorRole.WORKER, NixlWorker),
    ):
        connector = kvx.create_connector(config, role, ctx)
        try:
            assert isinstance(connector, kvx.RoleSplitConnector)
            built = (
                connector.scheduler if role is kvx.KVConnectorRole.SCHEDULER else connector.worker
            )
            assert isinstance(built, half) and built.secret == SECRET
        finally:
            connector.shutdown()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        # a password that is also the port's text: only the password goes (str.replace would
        # have hidden the port too)
        ("redis://u:6379@h:6379/0", "redis://u:***@h:6379/0"),
        ("rediss://a:b@[::1]:5/0", "rediss://a:***@[::1]:5/0"),
        ("redis://a:b@[::1/0", "redis://***@[::1/0"),  # does not parse: whole userinfo hidden
        ("redis://user@h/0", "redis://user@h/0"),
        ("s3://bucket/kv", "s3://bucket/kv"),
    ],
)
def test_redact_url_hides_only_the_password(url: str, shown: str) -> None:
    assert kvx.redact_url(url) == shown


def test_storage_open_error_hides_the_password() -> None:
    """`open_storage_backend`'s message names the URL through the one redaction helper (a
    password of "1" must not turn the host into `***27.0.0.***`)."""
    with pytest.raises(kvx.ConfigError) as info:
        kvx.open_storage_backend("redis://u:1@127.0.0.1:1/0", kvx.StorageBackendOptions())
    assert "cannot open 'redis://u:***@127.0.0.1:1/0'" in str(info.value)
