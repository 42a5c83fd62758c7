"""Secrets in configs: inline, from an environment variable, or from a file.

A secret field of a connector's extra config is typed `Secret | None`: the JSON gives either the
secret itself (`"shared_secret": "..."`, visible to `ps` when passed on a command line) or where
to read it, `{"env": "NAME"}` or `{"file": "/path"}`. `resolve_secret` turns any of these into
the secret's text when the connector starts; `kvx validate` shows inline secrets as `"***"`
(`redact_secrets`). No message here ever contains a secret's text.
"""

from __future__ import annotations

import functools
import os
import re
import stat
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
import msgspec.inspect as mi

from kvx.config.schema import path_problem, type_info
from kvx.errors import ConfigError, ConfigProblem

MAX_SECRET_BYTES = 64 << 10
REDACTED = "***"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,254}$")


class SecretSource(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Where a secret is read from instead of the JSON: exactly one of `env` (the name of an
    environment variable) or `file` (a path, readable by its owner only)."""

    env: str | None = None
    file: str | None = None

    def __post_init__(self) -> None:
        if (self.env is None) == (self.file is None):
            raise ValueError(
                'give exactly one of "env" (an environment variable\'s name) or "file" (a '
                'path), e.g. {"env": "KVX_SECRET"} or {"file": "/etc/kvx/secret"}'
            )
        if self.env is not None and not _ENV_NAME.match(self.env):
            raise ValueError(
                f"env: {self.env[:60]!r} is not an environment variable name; use letters, "
                "digits and '_', not starting with a digit"
            )
        if self.file is not None:
            problem = path_problem(self.file)
            if problem is not None:
                raise ValueError(f"file: {self.file[:200]!r} {problem}")


Secret = str | SecretSource
"""The type of a secret field: the secret inline, or a `SecretSource`."""


def resolve_secret(
    value: str | SecretSource | Mapping[str, Any] | None,
    key: str,
    *,
    min_length: int = 1,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The text of the secret at config key `key` (None when none is configured).

    `value` is the field's value: the secret itself, a `SecretSource`, or its JSON object
    (`{"env": "NAME"}` / `{"file": "/path"}`). A file must not be readable or writable by its
    group or others; one trailing newline is dropped. Raises `ConfigError` naming `key` and
    the fix (never the secret) when the source is missing, unreadable, too open, empty or
    shorter than `min_length` characters.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text, where = value, "the inline secret"
    else:
        source = _source(value, key)
        if source.env is not None:
            env = os.environ if environ is None else environ
            if source.env not in env:
                raise _problem(
                    key,
                    f"environment variable {source.env} is not set; export it in the "
                    "environment kvx runs in, or give the secret another way",
                )
            text, where = env[source.env], f"environment variable {source.env}"
        else:
            assert source.file is not None  # SecretSource checked: exactly one is set
            text, where = _read_secret_file(source.file, key), f"file {source.file!r}"
    if len(text) < min_length:
        raise _problem(
            key,
            f"the secret from {where} is {len(text)} characters; use at least {min_length}",
        )
    return text


def _source(value: SecretSource | Mapping[str, Any], key: str) -> SecretSource:
    if isinstance(value, SecretSource):
        return value
    try:
        return msgspec.convert(dict(value), SecretSource)
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        raise _problem(key, str(exc).split(" - at ")[0]) from None


def _read_secret_file(path: str, key: str) -> str:
    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise _problem(key, f"file {path!r} is not a regular file")
            if mode & 0o077:
                raise _problem(
                    key,
                    f"file {path!r} is open to its group or others (mode "
                    f"{stat.S_IMODE(mode):04o}); a secret's file must be its owner's only: "
                    f"chmod 600 {path}",
                )
            data = handle.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise _problem(
            key, f"cannot read file {path!r}: {exc.strerror or exc.__class__.__name__}"
        ) from None
    if len(data) > MAX_SECRET_BYTES:
        raise _problem(key, f"file {path!r} is over {MAX_SECRET_BYTES} bytes; is it a secret?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _problem(key, f"file {path!r} is not UTF-8 text") from None
    return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")


def _problem(key: str, message: str) -> ConfigError:
    return ConfigError([ConfigProblem(key, message)])


@functools.lru_cache(maxsize=256)
def secret_fields(schema_type: Any) -> tuple[str, ...]:
    """The (JSON) names of the fields of a typed extra-config schema that hold a `Secret`."""
    try:
        info = type_info(schema_type)
    except (TypeError, ValueError):
        return ()
    if not isinstance(info, mi.StructType | mi.DataclassType | mi.TypedDictType):
        return ()
    return tuple(f.encode_name for f in info.fields if _holds_secret(f.type))


def _holds_secret(t: mi.Type) -> bool:
    members = t.types if isinstance(t, mi.UnionType) else (t,)
    return any(isinstance(m, mi.StructType) and m.cls is SecretSource for m in members)


def redact_secrets(extra: Mapping[str, Any], schema_type: Any) -> dict[str, Any]:
    """A copy of an extra config with the inline secrets of `schema_type`'s secret fields
    replaced by `"***"` (sources such as `{"env": "NAME"}` are kept: they are not secret)."""
    shown = dict(extra)
    for name in secret_fields(schema_type):
        if isinstance(shown.get(name), str):
            shown[name] = REDACTED
    return shown


def inline_secrets(extra: Mapping[str, Any], schema_type: Any) -> list[str]:
    """The secret fields of an extra config given inline (the secret in the JSON itself)."""
    return [name for name in secret_fields(schema_type) if isinstance(extra.get(name), str)]


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)@")


def redact_url(url: str) -> str:
    """`url` with its password (the userinfo's part after `:`) shown as `"***"`, for messages
    and listings; the user name, host and the rest are kept. A URL that does not parse loses
    its whole userinfo."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. a malformed IPv6 host: hide everything before the host's `@`
        return _USERINFO.sub(rf"\1{REDACTED}@", url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:{REDACTED}@{host}"))
