"""SharedStorageConnector's typed extra config (no heavy imports: kvx validates configs with it)."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec

import kvx
from kvx import Secret, path_problem, url_problem, user_cache_dir
from kvx.plugins.storage.chains import chain_problem, missing_package, split_chain

DEFAULT_STORAGE_URL = "file://" + user_cache_dir("kv")
"""The user's own store (`~/.cache/kvx/kv`), never a shared directory such as /tmp."""
FILE_MODES = {"owner": 0o600, "group": 0o640}
_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://")
_NAMESPACE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
REDIS_SCHEMES = ("redis", "rediss", "valkey", "valkeys")
REDIS_PASSWORD_KEY = "kv_connector_extra_config.redis_password"
MIN_MAC_SECRET = 16


class SharedStorageConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Where KV blocks are stored and how they are written.

    `storage_url` picks the backend by scheme (`file://`, `memory://`, any fsspec protocol,
    `redis://host:port/db`); vLLM's `shared_storage_path` (a local directory) is accepted
    instead of it. fsspec URLs may be chained (`simplecache::s3://bucket/kv`) and take
    `storage_options`, passed to fsspec as they are (`{"s3": {"endpoint_url": ...}}` for one
    protocol of a chain). A Redis password is given in the URL or, better, as
    `redis_password`: `{"env": "NAME"}` or `{"file": "/path"}` (see `kvx.resolve_secret`).
    `storage_block_size` is the tokens per stored block (the key granularity):
    engines that share a store must use the same value, and it must divide, or be a multiple
    of, each engine's block size (default 16, or the engine's block size when 16 does not fit).
    Local files are readable only by their owner (`permissions: "owner"`, files 0600 and
    directories 0700) unless `permissions` is `"group"` (0640 / 0750). The default store is
    the user's own cache directory. `integrity: "checksum"` (default) detects damaged values
    (XXH3); `"mac"` keys each value's check with `mac_secret` (BLAKE2b), so anyone who can
    write to the store but lacks the secret cannot plant a value the engines will load.
    """

    storage_url: str = DEFAULT_STORAGE_URL
    shared_storage_path: str | None = None
    namespace: str | None = None
    storage_block_size: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None
    redis_ttl_s: Annotated[int, msgspec.Meta(ge=1)] | None = None
    redis_client: Literal["resp", "redis-py"] = "resp"
    verify_checksums: bool = True
    max_inflight_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 256 << 20
    io_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    permissions: Literal["owner", "group"] = "owner"
    storage_options: dict[str, Any] | None = None
    redis_password: Secret | None = None
    integrity: Literal["checksum", "mac"] = "checksum"
    mac_secret: str | None = None

    def __post_init__(self) -> None:
        if self.integrity == "mac":
            if self.mac_secret is None or len(self.mac_secret) < MIN_MAC_SECRET:
                raise ValueError(
                    f'mac_secret: integrity "mac" needs a secret of at least {MIN_MAC_SECRET} '
                    "characters, shared by every engine that reads or writes the store"
                )
            if not self.verify_checksums:
                raise ValueError('verify_checksums: integrity "mac" always verifies; drop false')
        elif self.mac_secret is not None:
            raise ValueError('mac_secret: only used with integrity "mac"')
        if self.shared_storage_path is not None:
            problem = path_problem(self.shared_storage_path)
            if problem is not None:
                raise ValueError(f"shared_storage_path: {self.shared_storage_path!r} {problem}")
            if self.storage_url != DEFAULT_STORAGE_URL:
                raise ValueError(
                    "give either storage_url or shared_storage_path (vLLM's name for a local "
                    f"directory), not both; got {self.storage_url!r} and "
                    f"{self.shared_storage_path!r}"
                )
            if not self.shared_storage_path:
                raise ValueError('shared_storage_path: "" is not a directory')
        url = self.url
        protocols, target = split_chain(url)
        match = _URL.match(target)
        if match is None:
            raise ValueError(
                f"storage_url: {url[:200]!r} is not a URL of the form scheme://...; e.g. "
                "'file:///var/kv', 'memory://kv', 's3://bucket/kv', 'redis://127.0.0.1:6379/0', "
                "'simplecache::s3://bucket/kv'"
            )
        scheme = match.group(1)
        problem = url_problem(target)
        if problem is not None:
            raise ValueError(f"storage_url: {url[:200]!r} {problem}")
        if protocols:
            if scheme in REDIS_SCHEMES:
                raise ValueError(
                    f"storage_url: {url[:200]!r}: only fsspec URLs can be chained with '::'"
                )
            problem = chain_problem([*protocols, scheme])
            if problem is not None:
                raise ValueError(f"storage_url: {url[:200]!r}: {problem}")
        if scheme in REDIS_SCHEMES:
            redis_problem = _redis_url_problem(url)
            if redis_problem is not None:
                raise ValueError(f"storage_url: {kvx.redact_url(url)!r}: {redis_problem}")
        if self.redis_ttl_s is not None and scheme not in REDIS_SCHEMES:
            raise ValueError(
                f"redis_ttl_s: only redis:// storage expires keys; storage_url is {url!r}"
            )
        if self.redis_client != "resp" and scheme not in REDIS_SCHEMES:
            raise ValueError(
                f"redis_client: only redis:// storage has a Redis client; storage_url is {url!r}"
            )
        if self.storage_options is not None and scheme in REDIS_SCHEMES:
            raise ValueError(
                "storage_options: fsspec's options; a redis:// storage_url takes none (its "
                "settings go in the URL, its password in redis_password)"
            )
        if self.storage_options is not None:
            where = _credential_in(self.storage_options, "storage_options")
            if where is not None:
                raise ValueError(
                    f"{where}: credentials are not taken from the config (it is logged, copied "
                    "and shared); give them to the store's client through its environment "
                    "(s3://: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) or its credentials "
                    "file (s3://: AWS_SHARED_CREDENTIALS_FILE, ~/.aws/credentials)"
                )
        if self.redis_password is not None:
            if scheme not in REDIS_SCHEMES:
                raise ValueError(
                    f"redis_password: only redis:// storage has a password; storage_url is "
                    f"{url[:200]!r}"
                )
            if urlsplit(url).password is not None:
                raise ValueError(
                    "redis_password: storage_url has a password too; give it in one place "
                    "(redis_password, so that it stays out of the URL)"
                )
        if self.namespace is not None and not _NAMESPACE.match(self.namespace):
            raise ValueError(
                f"namespace: {self.namespace!r} is not allowed; use 1-128 characters of "
                "letters, digits, '.', '_' and '-'"
            )

    def config_notes(self) -> list[kvx.ConfigProblem]:
        """What `kvx validate` tells the operator: protocols fsspec knows but cannot load here."""
        protocols, target = split_chain(self.url)
        notes = []
        for protocol in [*protocols, target.split("://", 1)[0]]:
            missing = missing_package(protocol) if protocol not in REDIS_SCHEMES else None
            if missing is not None:
                notes.append(kvx.ConfigProblem("storage_url", f"needs a package to run: {missing}"))
        return notes

    def registry_checks(self, registry: kvx.PluginRegistry) -> list[kvx.ConfigProblem]:
        """Config validation against `registry`: the URL's scheme has a backend there."""
        try:
            registry.storage_backend_for_url(self.url)
        except kvx.RegistryError as exc:
            return [kvx.ConfigProblem("storage_url", str(exc))]
        return []

    def config_checks(self) -> list[kvx.ConfigProblem]:
        """`kvx validate --check`: open the store (creating a local directory) and close it."""
        try:
            backend = kvx.open_storage_backend(self.url, self.backend_options())
        except kvx.ConfigError as exc:
            return [kvx.ConfigProblem(p.path.rpartition(".")[2], p.message) for p in exc.problems]
        backend.close()
        return []

    def backend_options(self) -> kvx.StorageBackendOptions:
        """How the connector opens its backend (the Redis password read from its source)."""
        return kvx.StorageBackendOptions(
            ttl_s=self.redis_ttl_s,
            timeout_s=self.timeout_s,
            redis_client=self.redis_client,
            file_mode=FILE_MODES[self.permissions],
            storage_options=self.storage_options,
            password=kvx.resolve_secret(self.redis_password, REDIS_PASSWORD_KEY),
        )

    @property
    def mac_key(self) -> bytes | None:
        """The key of stored values' MACs (None: plain checksums)."""
        if self.integrity != "mac" or self.mac_secret is None:
            return None
        return hashlib.blake2b(self.mac_secret.encode(), digest_size=32).digest()

    @property
    def url(self) -> str:
        """The storage URL in effect (`shared_storage_path` becomes a `file://` URL)."""
        if self.shared_storage_path is not None:
            return "file://" + os.path.abspath(self.shared_storage_path)
        return self.storage_url


CREDENTIAL_OPTIONS = frozenset(
    {
        *("key", "secret", "password", "session_token", "aws_access_key_id"),
        *("aws_secret_access_key", "aws_session_token", "account_key", "sas_token"),
        *("client_secret", "connection_string"),
    }
)
"""fsspec options that carry a credential (s3fs, adlfs, ...), refused in storage_options."""


def _credential_in(options: dict[str, Any], path: str) -> str | None:
    """The path of the first credential option in `options` (nested dicts too), or None."""
    for name, value in options.items():
        if name in CREDENTIAL_OPTIONS:
            return f"{path}.{name}"
        if isinstance(value, dict):
            found = _credential_in(value, f"{path}.{name}")
            if found is not None:
                return found
    return None


def _redis_url_problem(url: str) -> str | None:
    """What is wrong with a `redis://host:port/db` URL (None if nothing)."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError as exc:
        return f"{exc}; use redis://host:port/db with a port of 1-65535"
    if not parts.hostname:
        return "has no host; use redis://host:port/db"
    db = parts.path.strip("/")
    if db and not (db.isdigit() and int(db) < 1 << 16):
        return f"database {db[:20]!r} is not a number 0-65535"
    return None
