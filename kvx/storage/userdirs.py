"""Where kvx keeps a user's files by default, and making directories only their owner can use.

Stored KV is private by default: the default store is under the user's cache directory
(`$XDG_CACHE_HOME/kvx`, else `~/.cache/kvx`; when there is no usable home, a `kvx-<uid>`
directory in the temporary directory that must be owned by the user and closed to others),
never a shared, predictable `/tmp/kvx-kv` that anyone could fill with values.
"""

from __future__ import annotations

import os
import stat
import tempfile

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def user_cache_dir(*parts: str) -> str:
    """`<the user's kvx cache directory>/<parts...>` (not created)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not base:
        home = os.path.expanduser("~")
        if home != "~" and os.path.isdir(home) and os.access(home, os.W_OK):
            base = os.path.join(home, ".cache")
    if not base:
        return os.path.join(tempfile.gettempdir(), f"kvx-{os.getuid()}", *parts)
    return os.path.join(base, "kvx", *parts)


def make_private_dirs(path: str, mode: int = PRIVATE_DIR_MODE) -> None:
    """Create `path` and each missing parent with `mode` (0700 by default; directories that
    exist are left as they are). A `kvx-<uid>` fallback in the temporary directory must be
    ours and closed to others, else `PermissionError` (someone may have planted it)."""
    missing = []
    head = os.path.abspath(path)
    while not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
    fallback = os.path.join(tempfile.gettempdir(), f"kvx-{os.getuid()}")
    if path == fallback or path.startswith(fallback + os.sep):
        info = os.stat(fallback, follow_symlinks=False)
        if (
            not stat.S_ISDIR(info.st_mode)
            or info.st_uid != os.getuid()
            or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
        ):
            raise PermissionError(
                f"{fallback} is not a directory of this user closed to others; remove it or "
                "set XDG_CACHE_HOME"
            )
