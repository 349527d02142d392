"""Typed merges into a RunConfig: unknown keys and wrong types fail naming the key (OmegaConf, no Hydra)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from typing import Any, Optional, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cbjax.app.choices import check_choices
from cbjax.config import ExperimentConfig, RunConfig
from cbjax.config.overhead import expand_presets

T = TypeVar("T")


def check_known_keys(node: Any, cls: type, where: str = "config", prefix: str = "") -> None:
    """Raise ValueError naming the first key of `node` (a mapping) that `cls` does not declare,
    or the first group of settings (a dataclass-typed key) given a single value.

    Hydra lets `+group.key=value` add a key to a typed config; this catches it."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in node.keys():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; keys are {', '.join(names)}"
            raise ValueError(f"{where}: unknown key {prefix}{key}{hint}")
        ftype = _unwrap_optional(hints[key])
        if dataclasses.is_dataclass(ftype) and node[key] is not None:
            if not isinstance(node[key], Mapping):
                raise ValueError(f"{where}: {scalar_for_group(f'{prefix}{key}', ftype, node[key])}")
            check_known_keys(node[key], ftype, where, f"{prefix}{key}.")


def group_type(key: str, cls: type = RunConfig) -> Optional[type]:
    """The dataclass that the dotted `key` of `cls` holds (e.g. LengthConfig for
    workload.prompt_len), or None when `key` is a single value or not in the schema."""
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        cls = _unwrap_optional(hints[part])
    return cls if dataclasses.is_dataclass(cls) else None


def scalar_for_group(key: str, group: type, value: Any) -> str:
    """Why `key=value` cannot set a group of settings, and how to write it: the group's own
    `scalar_override(key, value)` where it has one, else its fields."""
    form = getattr(group, "scalar_override", None)
    if form is not None:
        how = form(key, value)
    else:
        fields = ", ".join(f.name for f in dataclasses.fields(group))
        how = f"{key}.FIELD=VALUE for each field to change ({fields})"
    return f"{key} is a group of settings ({group.__name__}), not one value (got {value!r}); write {how}"


def _unwrap_optional(ftype: Any) -> Any:
    """X for Optional[X]; other types as they are."""
    args = [a for a in typing.get_args(ftype) if a is not type(None)]
    return args[0] if typing.get_origin(ftype) is typing.Union and len(args) == 1 else ftype


def typed_config(cfg: DictConfig, schema: type[T]) -> T:
    """The checked dataclasses of a composed config of `schema`, refusing keys it lacks; a run
    config's values chosen from a registry are checked against it (`check_choices`)."""
    check_known_keys(cfg, schema)
    out = OmegaConf.to_object(cfg)
    return check_choices(out) if isinstance(out, RunConfig) else out


def to_run_config(cfg: DictConfig) -> RunConfig:
    """The checked RunConfig of a composed `cbjax` config (`typed_config`)."""
    return typed_config(cfg, RunConfig)


def merge_overrides(cfg: RunConfig, overrides: dict[str, Any], where: str = "overrides") -> RunConfig:
    """A copy of `cfg` with a nested partial config merged in through OmegaConf's typed merge,
    so a wrong type fails as it does on the command line; `experiment` is reset to its default.

    Keys may be nested dicts (`{scheduler: {name: static}}`) or dotted (`scheduler.name`);
    `overhead: NAME` selects a whole stack from configs/overhead/ (`expand_presets`).
    """
    patch = expand_presets(_nest(overrides), where)
    check_known_keys(patch, RunConfig, where)
    base = OmegaConf.structured(dataclasses.replace(cfg, experiment=ExperimentConfig()))
    try:
        merged = OmegaConf.merge(base, patch)
        out = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        msg = (getattr(err, "msg", None) or str(err)).splitlines()[0]
        raise ValueError(f"{where}: {key + ': ' if key else ''}{msg}") from None
    try:
        return check_choices(out)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _nest(patch: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in patch.items():
        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value)
        if isinstance(value, dict):
            value = _nest(value)
        head, _, rest = str(key).partition(".")
        if rest:
            value = _nest({rest: value})
        if isinstance(value, dict) and isinstance(out.get(head), dict):
            out[head] = {**out[head], **value}
        else:
            out[head] = value
    return out


def from_dict(cls, data: dict[str, Any]):
    """Build a (nested) config dataclass from plain dicts."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        ftype = hints[f.name]
        if dataclasses.is_dataclass(ftype) and isinstance(value, dict):
            value = from_dict(ftype, value)
        kwargs[f.name] = value
    return cls(**kwargs)
