"""Typed merges into a RunConfig: unknown keys and wrong types fail naming the key (OmegaConf, no Hydra)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cbjax.app.choices import check_choices
from cbjax.config import ExperimentConfig, RunConfig
from cbjax.config.overhead import expand_presets


def check_known_keys(node: Any, cls: type, where: str = "config", prefix: str = "") -> None:
    """Raise ValueError naming the first key of `node` (a mapping) that `cls` does not declare.

    Hydra lets `+group.key=value` add a key to a typed config; this catches it."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in node.keys():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; keys are {', '.join(names)}"
            raise ValueError(f"{where}: unknown key {prefix}{key}{hint}")
        ftype = hints[key]
        if dataclasses.is_dataclass(ftype) and node[key] is not None:
            check_known_keys(node[key], ftype, where, f"{prefix}{key}.")


def to_run_config(cfg: DictConfig) -> RunConfig:
    """The checked dataclasses of a composed config, refusing keys the schema lacks."""
    check_known_keys(cfg, RunConfig)
    return check_choices(OmegaConf.to_object(cfg))


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
