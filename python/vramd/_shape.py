"""Checks that an answer has the fields docs/api.md promises, so that a server of another
version is an error that says so rather than a KeyError deep inside the client."""
from __future__ import annotations

from ._errors import ProtocolError

_KIND_NAMES = {str: "a string", int: "an integer", bool: "a boolean", dict: "an object", list: "a list"}


class NotAsDocumented(ProtocolError):
    """What is off in an answer: the field and what it should have been."""


def field(obj, key: str, kind: type, where: str = ""):
    """obj[key], which must be of `kind` (an int is never a bool); `where` prefixes the message."""
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise NotAsDocumented(f"{where}{key!r} is missing or not {_KIND_NAMES[kind]}")
    return value


def natural(obj, key: str, where: str = "") -> int:
    """obj[key], which must be a non-negative integer."""
    value = field(obj, key, int, where)
    if value < 0:
        raise NotAsDocumented(f"{where}{key!r} is negative")
    return value


def naturals(obj, key: str, where: str = "") -> list[int]:
    """obj[key], which must be a list of non-negative integers."""
    values = field(obj, key, list, where)
    if not all(type(v) is int and v >= 0 for v in values):
        raise NotAsDocumented(f"{where}{key!r} is not a list of non-negative integers")
    return values


def objects(obj, key: str, where: str = "") -> list[dict]:
    """obj[key], which must be a list of objects."""
    values = field(obj, key, list, where)
    if not all(isinstance(v, dict) for v in values):
        raise NotAsDocumented(f"{where}{key!r} is not a list of objects")
    return values
