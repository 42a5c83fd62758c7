"""The connector's typed `kv_connector_extra_config`."""

from typing import Annotated

import msgspec

from kvx import path_problem, user_cache_dir


class ExamplePDConfig(msgspec.Struct, forbid_unknown_fields=True):
    """`directory`: shared by P and D (default: the user's own cache directory; its files are
    readable by their owner only). `load_timeout_s`: how long D waits for P's file."""

    directory: str = user_cache_dir("example-handoff")
    load_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0

    def __post_init__(self) -> None:
        problem = path_problem(self.directory)
        if problem is not None:
            raise ValueError(f"directory: {self.directory[:200]!r} {problem}")
