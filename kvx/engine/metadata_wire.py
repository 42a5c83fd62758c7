"""Give every worker its own copy of the step's connector metadata, made from msgpack bytes.

In a real engine the metadata crosses a process boundary to each worker, so a worker that
mutates it cannot affect its siblings, and metadata that cannot be serialised fails. The
reference engine runs workers in one process; it encodes the metadata once per step with
msgspec (`kvx.wire`, never pickle) and rebuilds one independent copy per worker from the bytes.

Decoding needs the concrete classes, which the bytes do not carry (a field may be typed with
the `KVConnectorMetadata` marker base, as MultiConnector's children are). The copy is therefore
rebuilt along the shape of the original object: dataclasses and msgspec Structs keep their class,
every value comes from the decoded bytes. A field-less plain subclass of the marker (or the
marker itself, as a connector skeleton returns) carries nothing and is sent as an empty map.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any

import msgspec

from kvx.contract.auxiliary import KVConnectorMetadata


def _encode_marker(obj: Any) -> Any:
    if _is_plain_marker(obj) and not vars(obj):
        return {}
    raise TypeError(f"Encoding objects of type {type(obj).__name__} is unsupported")


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_marker)


def _is_plain_marker(obj: Any) -> bool:
    """A `KVConnectorMetadata` that is neither a dataclass nor a msgspec Struct."""
    return (
        isinstance(obj, KVConnectorMetadata)
        and not dataclasses.is_dataclass(obj)
        and not isinstance(obj, msgspec.Struct)
    )


class MetadataWireError(TypeError):
    """The connector's metadata cannot cross a process boundary."""


def encode_metadata(metadata: Any) -> bytes:
    """msgpack bytes of `metadata`; `MetadataWireError` naming the type if it cannot be."""
    try:
        return _encoder.encode(metadata)
    except (TypeError, msgspec.EncodeError) as exc:
        raise MetadataWireError(
            f"connector metadata of type {type(metadata).__name__} cannot be sent to a worker "
            f"process: {exc}. KVConnectorMetadata subclasses must be dataclasses or msgspec "
            "Structs of plain fields (docs/contract.md)"
        ) from None


def decode_metadata(data: bytes, template: Any) -> Any:
    """A fresh copy of `template` whose every value was decoded from `data`."""
    return _rebuild(template, msgspec.msgpack.decode(data))


def _rebuild(template: Any, raw: Any) -> Any:
    if _is_plain_marker(template):
        return type(template)()
    if isinstance(template, msgspec.Struct):
        names = template.__struct_fields__
        values = raw if isinstance(raw, list) else [raw[n] for n in names]
        fields = {n: _rebuild(getattr(template, n), v) for n, v in zip(names, values, strict=True)}
        return msgspec.structs.replace(template, **fields)
    if dataclasses.is_dataclass(template) and not isinstance(template, type):
        out = copy.copy(template)
        for f in dataclasses.fields(template):
            object.__setattr__(out, f.name, _rebuild(getattr(template, f.name), raw[f.name]))
        return out
    if isinstance(template, enum.Enum):
        return type(template)(raw)
    if isinstance(template, (list, tuple)):
        items = [_rebuild(t, r) for t, r in zip(template, raw, strict=True)]
        return items if isinstance(template, list) else type(template)(items)
    if isinstance(template, (set, frozenset)):
        return type(template)(raw)
    if isinstance(template, dict):
        return {k: _rebuild(template[k], raw[k]) for k in template}
    if type(template) is not type(raw) and isinstance(template, (int, float, str, bytes)):
        return type(template)(raw)
    return raw
