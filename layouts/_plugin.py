"""kvx's built-in layouts and transforms, registered through the `kvx` entry-point group."""

from __future__ import annotations

import kvx
from kvx.layouts.builtin import BUILTIN_LAYOUTS

_TRANSFORMS = {
    "kv_postprocess_layout_on_receive": (
        "postprocess",
        "vLLM: reorder received HND blocks into an NHD cache, in place",
    ),
    "kv_postprocess_blksize_on_receive": (
        "postprocess",
        "vLLM: merge smaller received blocks into each HND block, in place",
    ),
    "kv_postprocess_blksize_and_layout_on_receive": (
        "postprocess",
        "vLLM: merge smaller received HND blocks into each NHD block, in place",
    ),
    "convert_blocks": (
        "convert",
        "any layout and block size to any other, both block-size directions, head slicing",
    ),
    "copy_kv_blocks": ("copy_blocks", "whole blocks between per-layer caches (h2d / d2h)"),
}


@kvx.hookimpl
def kvx_layouts() -> list[kvx.LayoutSpec]:
    return [
        kvx.LayoutSpec(name, f"kvx.layouts.builtin:{name}", summary=layout.summary)
        for name, layout in BUILTIN_LAYOUTS.items()
    ]


@kvx.hookimpl
def kvx_transforms() -> list[kvx.TransformSpec]:
    return [
        kvx.TransformSpec(name, f"kvx.layouts.{module}:{name}", summary=summary)
        for name, (module, summary) in _TRANSFORMS.items()
    ]
