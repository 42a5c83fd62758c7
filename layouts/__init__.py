"""KV cache layout descriptors and block transforms (registered as kvx plugins).

The layout model and the built-in layouts import without torch; the transforms (which need it)
are imported on first access, so listing plugins stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvx.layouts.builtin import (
    BUILTIN_LAYOUTS,
    CPU_PACKED,
    CROSS_FLASHINFER_HND,
    CROSS_FLASHINFER_NHD,
    CROSS_HND,
    CROSS_MLA,
    CROSS_NHD,
    FLASHINFER_HND,
    FLASHINFER_NHD,
    HND,
    MLA,
    NHD,
    get_layout,
)
from kvx.layouts.descriptor import (
    BLOCKS,
    DIMS,
    HEAD_SIZE,
    HEADS,
    KV,
    LAYERS,
    TOKENS,
    Layout,
)

if TYPE_CHECKING:
    from kvx.layouts.convert import convert_blocks
    from kvx.layouts.copy_blocks import KVBlockCopier, copy_kv_blocks
    from kvx.layouts.postprocess import (
        kv_postprocess_blksize_and_layout_on_receive,
        kv_postprocess_blksize_on_receive,
        kv_postprocess_layout_on_receive,
    )

_LAZY = {
    "convert_blocks": "kvx.layouts.convert",
    "KVBlockCopier": "kvx.layouts.copy_blocks",
    "copy_kv_blocks": "kvx.layouts.copy_blocks",
    "kv_postprocess_blksize_and_layout_on_receive": "kvx.layouts.postprocess",
    "kv_postprocess_blksize_on_receive": "kvx.layouts.postprocess",
    "kv_postprocess_layout_on_receive": "kvx.layouts.postprocess",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BLOCKS",
    "BUILTIN_LAYOUTS",
    "CPU_PACKED",
    "CROSS_FLASHINFER_HND",
    "CROSS_FLASHINFER_NHD",
    "CROSS_HND",
    "CROSS_MLA",
    "CROSS_NHD",
    "DIMS",
    "FLASHINFER_HND",
    "FLASHINFER_NHD",
    "HEADS",
    "HEAD_SIZE",
    "HND",
    "KV",
    "LAYERS",
    "MLA",
    "NHD",
    "TOKENS",
    "KVBlockCopier",
    "Layout",
    "convert_blocks",
    "copy_kv_blocks",
    "get_layout",
    "kv_postprocess_blksize_and_layout_on_receive",
    "kv_postprocess_blksize_on_receive",
    "kv_postprocess_layout_on_receive",
]
