"""What `kvx store info` prints about one stored value: its block-format header, read as
untrusted bytes (every field bounded before use), and whether its checksum holds."""

from __future__ import annotations

from kvx.plugins.storage.blockformat import (
    CHECKSUM_SPAN,
    DTYPE_CODES,
    FLAG_MLA,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    MAX_VALUE_BYTES,
    checksum_ok,
    stored_checksum,
)

__all__ = ["MAX_VALUE_BYTES", "describe_value"]

_DTYPES = {code: name for name, code in DTYPE_CODES.items()}


def describe_value(key: str, data: bytes) -> list[tuple[str, str]]:
    """(field, text) pairs describing the value `data` stored under `key`."""
    view = memoryview(data)
    out = [("key", key), ("size", f"{len(view)} bytes")]
    if len(view) < HEADER.size or bytes(view[:4]) != MAGIC:
        out.append(("format", "not a kvx block value (no KVXB header)"))
        return out
    (magic, version, header_len, dtype, kv_parts, flags, order, k_order, block_size, head_size,
     total_heads, head_start, head_end, layer_start, layer_end, total_layers, layer_set,
     payload_len, _) = HEADER.unpack_from(view)  # fmt: skip
    del magic
    out.append(("format", f"KVXB version {version}"))
    if version != FORMAT_VERSION:
        out.append(("note", f"this kvx reads version {FORMAT_VERSION} only"))
        return out
    orders = [o.rstrip(b"\0").decode("ascii", "replace") for o in (order, k_order)]
    out += [
        ("dtype", _DTYPES.get(dtype, f"unknown code {dtype}")),
        ("kind", "MLA latent" if flags & FLAG_MLA else f"{kv_parts} parts (K, V)"),
        ("order", orders[0] if orders[0] == orders[1] else f"{orders[0]} (K: {orders[1]})"),
        ("block_size", f"{block_size} tokens"),
        ("head_size", str(head_size)),
        ("heads", f"{head_start}-{head_end} of {total_heads}"),
        ("layers", f"{layer_start}-{layer_end} of {total_layers}"),
        ("layer_set", layer_set.hex()),
        ("payload", f"{payload_len} bytes"),
    ]
    whole = header_len == HEADER.size and len(view) == HEADER.size + payload_len
    if not whole:
        out.append(("checksum", f"not checked: torn or padded (header says {payload_len} bytes)"))
        return out
    ok = checksum_ok(key, view, [view[HEADER.size :]])
    stored = f"{stored_checksum(view[: CHECKSUM_SPAN[1]]):016x}"
    out.append(
        (
            "checksum",
            f"ok ({stored})"
            if ok
            else f"MISMATCH ({stored}): corrupt, stored under another key, or written with "
            "integrity: mac",
        )
    )
    return out
