"""The checks every config dataclass runs: an error names the key, the rule and the value."""

from __future__ import annotations

from typing import Any, Iterable


def _require(cond: bool, key: str, msg: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"{key} {msg}, got {value!r}")


def _one_of(key: str, value: Any, allowed: Iterable[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}: unknown value {value!r}; choose one of {', '.join(allowed)}")


def _class_path(key: str, value: str, msg: str = 'must look like "package.module:ClassName"') -> None:
    """`value` names a class as "package.module:ClassName" (a user's plug-in), or `key` fails."""
    module, _, cls = value.partition(":")
    _require(bool(module and cls and all(p.isidentifier() for p in module.split(".") + cls.split("."))), key, msg, value)
