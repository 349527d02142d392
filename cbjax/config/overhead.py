"""The overhead group: a serving stack's host and per-call costs, which no datasheet gives.

A roofline step costs what the hardware's datasheet figures allow (`HardwareConfig`); a real
stack adds its own time around it (Python scheduling, per-sequence sampling, block tables, a
paged kernel's fixed cost per page, one copy call per page when swapping). Those constants
describe a stack, not a chip, so they live here, one YAML file per stack under
configs/overhead/, each saying what its values were fitted on and where they come from.
`overhead=none` (the default) charges nothing.

An experiment arm may select a stack by name (`{overhead: vllm_0_1}`); `expand_presets` reads
the group's YAML for it, so the values live in one file.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from cbjax.config.checks import _require


@dataclass
class OverheadConfig:
    """Host-side costs a serving stack adds to the roofline's step time (all 0: `none`)."""

    name: str = "none"
    step_s: float = 0.0  # fixed host time per iteration: launch, scheduling, sampling
    seq_s: float = 0.0  # host time per scheduled sequence per iteration (sampling, bookkeeping)
    # paged attention's fixed cost per KV page a sequence reads in an iteration, all layers
    # together (a page's loop step, table lookup and partial-result merge)
    page_s: float = 0.0
    # fixed cost of one host<->device copy call; swapping, and the host KV tier's stores and
    # loads, copy each page's K and V per layer separately (vLLM's per-block cudaMemcpyAsync),
    # so small pages pay it often
    copy_latency_s: float = 0.0
    # provenance, shown beside the figures it produced
    fitted_on: str = ""  # the rows or runs the values were chosen or fitted on ("" for none)
    source: str = ""  # where the values come from

    def __post_init__(self) -> None:
        for key in ("step_s", "seq_s", "page_s", "copy_latency_s"):
            value = getattr(self, key)
            _require(value >= 0, f"overhead.{key}", "must be >= 0", value)

    @property
    def is_none(self) -> bool:
        return not (self.step_s or self.seq_s or self.page_s or self.copy_latency_s)


def config_dir() -> Path:
    """The configs/ directory: $CBJAX_CONFIG_DIR, a source checkout's, or the installed package's."""
    if "CBJAX_CONFIG_DIR" in os.environ:
        return Path(os.environ["CBJAX_CONFIG_DIR"])
    source = Path(__file__).resolve().parents[2] / "configs"
    if (source / "config.yaml").is_file():
        return source
    import cbjax.configs

    return Path(cbjax.configs.__file__).parent


def overhead_names() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "overhead").glob("*.yaml"))


def load_overhead(name: str, where: str = "overhead") -> dict[str, Any]:
    """Every field of configs/overhead/NAME.yaml's stack, unset ones at their defaults, so a merge
    selects the whole stack rather than patching the one before it."""
    import yaml

    path = config_dir() / "overhead" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"{where}: unknown overhead {name!r}; choose one of {', '.join(overhead_names())}")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(data) - {f.name for f in fields(OverheadConfig)})
    if unknown:
        raise ValueError(f"{path}: unknown key overhead.{unknown[0]}")
    return asdict(OverheadConfig(**{"name": name, **data}))


def expand_presets(patch: dict[str, Any], where: str = "overrides") -> dict[str, Any]:
    """`patch` with `overhead: NAME` (a group's file by name) replaced by that file's fields."""
    value = patch.get("overhead")
    if isinstance(value, str):
        return {**patch, "overhead": load_overhead(value, f"{where}: overhead")}
    return patch
