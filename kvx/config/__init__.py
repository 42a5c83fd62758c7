"""The operator's wing: `--kv-transfer-config` and the checks every config goes through.

Modules:

- `transfer`: `KVTransferConfig`, parsing, validation against a `ConfigResolver`
- `yaml_files`: `@kv.yaml` files held to JSON's data model
- `dotted`: vLLM's `--kv-transfer-config.key=value` notation
- `schema`: a JSON-like value checked against a msgspec Struct or dataclass
- `secrets`: secrets inline, from the environment or a file; URL redaction

Re-exports the public names (`kvx.__all__`) that live here.
"""

from __future__ import annotations

from kvx.config.schema import (
    path_problem,
    url_problem,
)
from kvx.config.secrets import (
    Secret,
    SecretSource,
    redact_url,
    resolve_secret,
)
from kvx.config.transfer import (
    ConfigResolver,
    KVTransferConfig,
    load_cli_arg,
)

__all__ = [
    "ConfigResolver",
    "KVTransferConfig",
    "Secret",
    "SecretSource",
    "load_cli_arg",
    "path_problem",
    "redact_url",
    "resolve_secret",
    "url_problem",
]
