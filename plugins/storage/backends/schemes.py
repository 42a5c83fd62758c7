"""Which URL schemes the fsspec backend serves beyond the ones it lists: every protocol in
fsspec's own registry (s3, gs, az, hdfs, sftp... each needs its fsspec package, s3fs, gcsfs,
adlfs..., which fsspec names when it is missing)."""

from __future__ import annotations

import fsspec


def fsspec_knows(scheme: str) -> bool:
    """Whether fsspec has an implementation registered for `scheme`."""
    return scheme in fsspec.available_protocols()
