"""Validation of plain JSON-like data against a typed schema (msgspec Struct or dataclass).

Connectors declare their `kv_connector_extra_config` as a typed schema; this module checks a dict
against it and reports *every* problem with its path, the bad value and what is allowed, with a
did-you-mean for misspelled keys and literal values. Unknown keys are errors.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from kvx.errors import ConfigError, ConfigProblem, did_you_mean, quoted_list

T = TypeVar("T")

_OBJECT_TYPES = (mi.StructType, mi.DataclassType, mi.TypedDictType)
_SEQUENCE_TYPES = (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)


_JSON_KINDS = {
    str: "string",
    bool: "boolean",
    int: "integer",
    float: "number",
    type(None): "null",
    list: "array",
    dict: "object",
}


def show(value: Any) -> str:
    """A short JSON rendering of a bad value and its JSON kind, e.g. `"8" (string)`."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    except RecursionError:  # repr would recurse as deep
        text = "[...]" if isinstance(value, list) else "{...}"
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({_JSON_KINDS.get(type(value), type(value).__name__)})"


def join_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def describe(t: mi.Type) -> str:
    """Human words for a type: 'an integer >= 0', "one of 'a', 'b'", ..."""
    if isinstance(t, mi.UnionType):
        return " or ".join(describe(s) for s in t.types)
    if isinstance(t, mi.LiteralType):
        return f"one of {quoted_list(t.values)}"
    if isinstance(t, mi.EnumType):
        return f"one of {quoted_list(m.value for m in t.cls)}"
    if isinstance(t, (mi.IntType, mi.FloatType)):
        base = "an integer" if isinstance(t, mi.IntType) else "a number"
        bounds = [
            f"{op} {v}"
            for op, v in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le))
            if v is not None
        ]
        return f"{base} {' and '.join(bounds)}".strip()
    if isinstance(t, mi.StrType):
        return "a string" + (f" matching {t.pattern!r}" if t.pattern else "")
    if isinstance(t, _SEQUENCE_TYPES):
        return f"a list of {describe(t.item_type)}"
    if isinstance(t, mi.DictType):
        return f"an object of {describe(t.value_type)}"
    if isinstance(t, _OBJECT_TYPES):
        return "an object"
    simple = {mi.BoolType: "true or false", mi.NoneType: "null", mi.AnyType: "any value"}
    return simple.get(type(t), type(t).__name__)


def check(value: Any, schema: Any, path: str = "") -> list[ConfigProblem]:
    """Every problem of `value` against `schema` (a type msgspec understands)."""
    problems: list[ConfigProblem] = []
    _check(value, type_info(schema), path, problems)
    return problems


@functools.lru_cache(maxsize=256)
def _cached_type_info(schema: Any) -> mi.Type:
    return mi.type_info(schema)


def type_info(schema: Any) -> mi.Type:
    """msgspec's description of `schema`, remembered for hashable schemas (computing it
    costs more than checking a config against it)."""
    try:
        return _cached_type_info(schema)
    except TypeError:  # unhashable
        return mi.type_info(schema)


def convert(value: Any, schema: type[T], path: str = "") -> T:
    """Validate `value` against `schema` and build the typed object (defaults filled in)."""
    problems = check(value, schema, path)
    if not problems:
        try:
            return msgspec.convert(value, schema, strict=True)
        except msgspec.ValidationError as exc:  # a constraint the walker does not model
            problems = [_from_msgspec_error(str(exc), path)]
    raise ConfigError(problems)


def _from_msgspec_error(text: str, path: str) -> ConfigProblem:
    match = re.search(r" - at `\$(.*)`$", text)
    if not match:
        key = re.match(r"([a-z_][a-z0-9_]*): ", text)  # a __post_init__'s "key: why"
        if key:
            return ConfigProblem(join_path(path, key.group(1)), text[key.end() :])
        return ConfigProblem(path, text)
    where = match.group(1)
    full = (path + where) if path else where.lstrip(".")
    return ConfigProblem(full, text[: match.start()])


def _check(value: Any, t: mi.Type, path: str, out: list[ConfigProblem]) -> None:
    if isinstance(t, mi.AnyType):
        return
    if isinstance(t, mi.UnionType):
        _check_union(value, t, path, out)
    elif isinstance(t, mi.LiteralType):
        if not any(type(value) is type(v) and value == v for v in t.values):
            hint = did_you_mean(value, [str(v) for v in t.values]) if isinstance(value, str) else ""
            out.append(
                ConfigProblem(
                    path, f"{show(value)} is not allowed; allowed: {quoted_list(t.values)}{hint}"
                )
            )
    elif isinstance(t, mi.EnumType):
        allowed = [m.value for m in t.cls]
        if value not in allowed:
            out.append(
                ConfigProblem(
                    path, f"{show(value)} is not allowed; allowed: {quoted_list(allowed)}"
                )
            )
    elif isinstance(t, (mi.IntType, mi.FloatType)):
        _check_number(value, t, path, out)
    elif isinstance(t, mi.StrType):
        _check_str(value, t, path, out)
    elif isinstance(t, mi.BoolType):
        if not isinstance(value, bool):
            out.append(ConfigProblem(path, f"expected true or false, got {show(value)}"))
    elif isinstance(t, mi.NoneType):
        if value is not None:
            out.append(ConfigProblem(path, f"expected null, got {show(value)}"))
    elif isinstance(t, _SEQUENCE_TYPES):
        if not isinstance(value, list):
            out.append(ConfigProblem(path, f"expected {describe(t)}, got {show(value)}"))
            return
        for i, item in enumerate(value):
            _check(item, t.item_type, join_path(path, i), out)
    elif isinstance(t, mi.DictType):
        if not isinstance(value, dict):
            out.append(ConfigProblem(path, f"expected {describe(t)}, got {show(value)}"))
            return
        for key, item in value.items():
            _check(item, t.value_type, join_path(path, str(key)), out)
    elif isinstance(t, _OBJECT_TYPES):
        _check_object(value, t, path, out)
    # Other types (tuples of fixed shape, datetimes, ...) are left to msgspec.convert.


def _check_union(value: Any, t: mi.UnionType, path: str, out: list[ConfigProblem]) -> None:
    attempts = []
    for member in t.types:
        found: list[ConfigProblem] = []
        _check(value, member, path, found)
        if not found:
            return
        attempts.append((member, found))
    # A value that is not null checked against `X | None`: report X's own problems.
    not_null = [(m, f) for m, f in attempts if not isinstance(m, mi.NoneType)]
    if value is not None and len(not_null) == 1:
        out.extend(not_null[0][1])
        return
    # A dict given where exactly one member is an object: report inside that object.
    objects = [(m, f) for m, f in attempts if isinstance(m, _OBJECT_TYPES)]
    if isinstance(value, dict) and len(objects) == 1:
        out.extend(objects[0][1])
        return
    out.append(ConfigProblem(path, f"expected {describe(t)}, got {show(value)}"))


def _check_number(
    value: Any, t: mi.IntType | mi.FloatType, path: str, out: list[ConfigProblem]
) -> None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = is_int if isinstance(t, mi.IntType) else (is_int or isinstance(value, float))
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        out.append(ConfigProblem(path, f"expected {describe(t)}, got {show(value)}"))
        return
    violated = (
        (t.gt is not None and not value > t.gt)
        or (t.ge is not None and not value >= t.ge)
        or (t.lt is not None and not value < t.lt)
        or (t.le is not None and not value <= t.le)
    )
    if violated:
        out.append(ConfigProblem(path, f"{show(value)} is out of range; allowed: {describe(t)}"))


def _check_str(value: Any, t: mi.StrType, path: str, out: list[ConfigProblem]) -> None:
    if not isinstance(value, str):
        out.append(ConfigProblem(path, f"expected {describe(t)}, got {show(value)}"))
    elif t.min_length is not None and len(value) < t.min_length:
        out.append(
            ConfigProblem(path, f"{show(value)} is too short; at least {t.min_length} characters")
        )
    elif t.max_length is not None and len(value) > t.max_length:
        out.append(
            ConfigProblem(path, f"{show(value)} is too long; at most {t.max_length} characters")
        )
    elif t.pattern is not None and re.search(t.pattern, value) is None:
        out.append(ConfigProblem(path, f"{show(value)} does not match {t.pattern!r}"))


def _check_object(value: Any, t: Any, path: str, out: list[ConfigProblem]) -> None:
    if not isinstance(value, dict):
        out.append(ConfigProblem(path, f"expected an object, got {show(value)}"))
        return
    fields = {f.encode_name: f for f in t.fields}
    for key in value:
        if key not in fields:
            hint = did_you_mean(str(key), fields)
            allowed = quoted_list(sorted(fields)) if fields else "none"
            out.append(
                ConfigProblem(
                    join_path(path, str(key)), f"unknown key{hint}; allowed keys: {allowed}"
                )
            )
    for name, f in fields.items():
        if name in value:
            _check(value[name], f.type, join_path(path, name), out)
        elif f.required:
            out.append(
                ConfigProblem(
                    join_path(path, name), f"required key is missing; expected {describe(f.type)}"
                )
            )


MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255


def _encoding_problem(text: str) -> str | None:
    """Why `text` cannot be a path or URL as bytes: a lone surrogate, or over 4096 bytes."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    if size > MAX_PATH_BYTES:
        return f"is {size} bytes long; at most {MAX_PATH_BYTES} allowed"
    return None


def path_problem(path: str) -> str | None:
    """Why `path` cannot name a local file or directory (None if it can): empty, a NUL byte,
    a lone surrogate, a component over 255 bytes or the whole over 4096 bytes (Linux limits)."""
    if not path:
        return "is empty"
    if "\x00" in path:
        return "contains a NUL byte"
    problem = _encoding_problem(path)
    if problem is not None:
        return problem
    longest = max(path.encode("utf-8").split(b"/"), key=len)
    if len(longest) > MAX_NAME_BYTES:
        return (
            f"has a {len(longest)}-byte name {longest[:20].decode(errors='replace')!r}...; "
            f"at most {MAX_NAME_BYTES} bytes per name"
        )
    return None


LOCAL_SCHEMES = ("file", "local")


def url_problem(url: str) -> str | None:
    """Why a storage URL cannot work (None if it may): its text (NUL, lone surrogate, length),
    and for a local URL (`file://`, `local://`) its path, which must not be the root."""
    if "\x00" in url:
        return "contains a NUL byte"
    scheme, sep, rest = url.partition("://")
    if scheme in LOCAL_SCHEMES and sep:
        problem = path_problem(rest)
        if problem is None and rest.strip("/") == "":
            problem = "is the root directory; give a directory of its own, e.g. file:///var/kv"
        return None if problem is None else f"its path {problem}"
    return _encoding_problem(url)
