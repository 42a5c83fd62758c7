"""The connector's typed `kv_connector_extra_config`."""

from typing import Annotated

import msgspec

from kvx import path_problem, user_cache_dir


class ExampleStoreConfig(msgspec.Struct, forbid_unknown_fields=True):
    """`directory`: holds the SQLite file `kv.sqlite`, shared by every engine that stores or
    loads (default: the user's own cache directory, readable by its owner only).
    `busy_timeout_s`: how long a write waits for another engine's write to the same file."""

    directory: str = user_cache_dir("example-store")
    busy_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 30.0

    def __post_init__(self) -> None:
        problem = path_problem(self.directory)
        if problem is not None:
            raise ValueError(f"directory: {self.directory[:200]!r} {problem}")
