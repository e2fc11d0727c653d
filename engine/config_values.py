"""A configuration value from text (a command-line flag, an environment variable) to the
type its dataclass field is annotated with. Shared by the gateway's settings and the
benches' `--config FIELD=VALUE`, so both read a value the same way; it lives in the engine,
which the benches need anyway, so that they need none of the gateway's web stack."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any


def convert_value(value: Any, t: Any, name: str) -> Any:
    """`value` (text, or already typed) as type `t` (bool, int, float, str, Path, an optional
    or a tuple of those); ValueError naming `name` when it does not parse."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        return convert_value(value, args[0], name)
    if t is bool:
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    if value is None:  # a YAML key with nothing after it: only an optional takes that
        raise ValueError(f"{name}: a value is needed here (got none)")
    if origin is tuple:
        if isinstance(value, str):
            items = [x.strip() for x in value.split(",") if x.strip()]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:  # one YAML scalar: a list of one
            items = [value]
        args = typing.get_args(t)
        inner = args[0] if args else str
        if inner is Ellipsis:
            inner = str
        return tuple(convert_value(x, inner, name) for x in items)
    if t is Path:
        if not isinstance(value, (str, Path)):
            raise ValueError(f"{name}: expected a path, got {value!r}")
        return Path(value)
    if t is int and isinstance(value, float):
        if not value.is_integer():  # int(8080.9) would quietly be 8080
            raise ValueError(f"{name}: expected int, got {value!r}")
        return int(value)
    if t in (int, float, str):
        if t is not str and isinstance(value, bool):
            raise ValueError(f"{name}: expected {t.__name__}, got {value!r}")
        if t is str and not isinstance(value, (str, int, float)):
            raise ValueError(f"{name}: expected a string, got {value!r}")
        try:
            return t(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: expected {t.__name__}, got {value!r}") from None
    return value
