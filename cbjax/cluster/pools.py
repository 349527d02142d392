"""Each replica's configuration: the run's, with its pool's hardware and tensor-parallel size
under prefill/decode disaggregation, and its KV pool sized for that hardware (no jax)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cbjax.config import HardwareConfig, RunConfig


def hardware_dir() -> Path:
    """configs/hardware of a source checkout, else the installed package's copy."""
    source = Path(__file__).resolve().parents[2] / "configs" / "hardware"
    if source.is_dir():
        return source
    import importlib.resources

    return Path(str(importlib.resources.files("cbjax.configs") / "hardware"))


def load_hardware(name: str, key: str) -> HardwareConfig:
    """The hardware named `name` (a configs/hardware file's stem, or a path to a YAML file of
    HardwareConfig keys); errors name `key`, the config key that gave it."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else hardware_dir() / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in hardware_dir().glob("*.yaml")))
        raise ValueError(f"{key}: unknown hardware {name!r} ({path} does not exist); choose one of {known}")
    data = OmegaConf.load(path)
    data.pop("defaults", None)
    fields = {f.name for f in dataclasses.fields(HardwareConfig)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{key}: {path} has unknown keys {unknown}")
    try:  # typed as the command line types it (YAML reads 1.5e12 as a string)
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), data))
    except (ValueError, OmegaConfBaseException) as err:
        raise ValueError(f"{key}: {path}: {str(err).splitlines()[0]}") from None


def pool_config(cfg: RunConfig, hardware: Optional[str], tensor: Optional[int], pool: str) -> RunConfig:
    """`cfg` with a pool's hardware (`cluster.{pool}_hardware`) and tensor-parallel size
    (`cluster.{pool}_tensor`: the roofline's hardware.num_devices and the engine's mesh). A
    pool that names its hardware but not its size keeps the run's hardware.num_devices, as a
    pool that names neither does: naming a device does not change how many of them it runs on."""
    hw = cfg.hardware
    if hardware is not None:
        hw = dataclasses.replace(load_hardware(hardware, f"cluster.{pool}_hardware"), num_devices=hw.num_devices)
    executor = cfg.executor
    if tensor is not None:
        hw = dataclasses.replace(hw, num_devices=tensor)
        executor = dataclasses.replace(executor, mesh=dataclasses.replace(executor.mesh, tensor=tensor))
    return dataclasses.replace(cfg, hardware=hw, executor=executor)


def sized(cfg: RunConfig) -> RunConfig:
    """`cfg` with `cache.num_pages=auto` resolved for its own hardware (as `cbjax.app.run.resolve`)."""
    if cfg.cache.num_pages != "auto":
        return cfg
    from cbjax.cache.sizing import auto_num_pages

    from cbjax.config.spec import separate_draft_model

    c = cfg.cache
    num_pages = auto_num_pages(cfg.model, cfg.hardware, c.page_size, c.memory_utilization, separate_draft_model(cfg.spec))
    return dataclasses.replace(cfg, cache=dataclasses.replace(c, num_pages=num_pages))


def replica_configs(cfg: RunConfig) -> list[tuple[str, RunConfig]]:
    """(role, config) per replica: `cluster.replicas` colocated ones, or the prefill pool's
    then the decode pool's."""
    c = cfg.cluster
    if not c.disaggregated:
        return [("colocated", sized(cfg))] * c.replicas
    prefill = sized(pool_config(cfg, c.prefill_hardware, c.prefill_tensor, "prefill"))
    decode = sized(pool_config(cfg, c.decode_hardware, c.decode_tensor, "decode"))
    return [("prefill", prefill)] * c.prefill_replicas + [("decode", decode)] * c.decode_replicas
