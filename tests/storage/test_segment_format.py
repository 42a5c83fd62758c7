"""The segment-file format has one definition: `_fileio.h` / `_segment.c` (the native writer and
reader). `backends/segments.py` (the Python reader) restates its constants; this test reads
them from the C sources and fails when the two drift."""

from __future__ import annotations

import re
from pathlib import Path

from kvx.plugins.storage.backends import segments

SOURCES = Path(segments.__file__).resolve().parents[1]  # plugins/storage
_DEFINE = re.compile(r"^#define\s+(\w+)\s+(\(?[0-9 <x()]+\)?)", re.MULTILINE)


def c_constants() -> dict[str, int]:
    """Every numeric `#define` of `_fileio.h` and `_segment.c`, evaluated (`(2 << 20)`)."""
    found: dict[str, int] = {}
    for name in ("_fileio.h", "_segment.c"):
        for define, value in _DEFINE.findall((SOURCES / name).read_text()):
            if re.fullmatch(r"[0-9 <()]+", value):
                found[define] = eval(value, {"__builtins__": {}})  # digits, <<, parentheses
    return found


def test_python_reader_matches_the_c_definition_of_segment_files() -> None:
    c = c_constants()
    python = {
        "KVX_SEG_VERSION": segments.VERSION,
        "KVX_SEG_ALIGN": segments.ALIGN,
        "KVX_SEG_DATA_ALIGN": segments.DATA_ALIGN,
        "KVX_SEG_MAX_VALUES": segments.MAX_VALUES,
        "KVX_SEG_MAX_HEAD": segments.MAX_HEAD,
        "V1_FIXED": segments.FIXED.size,
        "V1_ENTRY": segments.ENTRY.size,
        "V2_FIXED": segments.V2_FIXED.size,
        "V2_ENTRY": segments.V2_ENTRY.size,
    }
    assert {name: c.get(name) for name in python} == python
    # the magic the C writer puts first and the versions its reader accepts
    segment_c = (SOURCES / "_segment.c").read_text()
    assert f'memcpy(out, "{segments.MAGIC.decode()}", 4);' in segment_c
    assert segments.VERSIONS == (1, segments.VERSION)
    assert "version 1 is still read" in (SOURCES / "_fileio.h").read_text()
