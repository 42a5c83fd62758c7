"""The connector's typed `kv_connector_extra_config`."""

import tempfile
from pathlib import Path
from typing import Annotated

import msgspec


class ExamplePDConfig(msgspec.Struct, forbid_unknown_fields=True):
    """`directory`: shared by P and D. `load_timeout_s`: how long D waits for P's file."""

    directory: str = str(Path(tempfile.gettempdir()) / "kvx-example-handoff")
    load_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
