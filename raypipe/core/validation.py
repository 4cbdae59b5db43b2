"""Shared argument checks: each failure is a :class:`~raypipe.errors.ConfigError`
(a ``ValueError``) naming the field, its value and what is allowed."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from raypipe.errors import ConfigError

T = TypeVar("T")


def is_number(value: object) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int = 1, maximum: int | None = None,
              allowed: str | None = None) -> None:
    """``value`` is an int in ``minimum..maximum`` (no upper bound when ``maximum`` is None)."""
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ConfigError(name, value, allowed or f"must be an int {bounds}")


def check_positive_int(name: str, value: object) -> None:
    """``value`` is an int >= 1."""
    check_int(name, value, 1)


def check_number(name: str, value: object, ok: Callable[[float], bool], allowed: str) -> None:
    """``value`` is a number (not a bool) for which ``ok(value)`` holds; ``allowed`` says which."""
    if not (is_number(value) and ok(value)):
        raise ConfigError(name, value, allowed)


def check_positive_number(name: str, value: object, allowed: str = "must be a number > 0") -> None:
    """``value`` is a number > 0."""
    check_number(name, value, lambda number: number > 0, allowed)


def check_bool(name: str, value: object) -> None:
    """``value`` is True or False."""
    if not isinstance(value, bool):
        raise ConfigError(name, value, "must be True or False")


def check_choice(name: str, value: object, allowed: Collection[object]) -> None:
    """``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(name, value, f"must be one of {list(allowed)}")


def check_renamed(values: Mapping[str, object], renamed: Mapping[str, str]) -> None:
    """Reject the first key of ``values`` that ``renamed`` maps to its new name (and why)."""
    for old, value in values.items():
        if old in renamed:
            raise ConfigError(old, value, f"renamed to {renamed[old]}")


def from_mapping(cls: type[T], values: Mapping[str, Any], what: str,
                 renamed: Mapping[str, str] | None = None) -> T:
    """The dataclass ``cls`` built from ``values``; a renamed or unknown key raises ConfigError naming it.

    ``what`` names the mapping in the error (e.g. "pipeline", "run config").
    """
    check_renamed(values, renamed or {})
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(what, unknown, f"unknown keys; known: {sorted(known)}")
    return cls(**values)
