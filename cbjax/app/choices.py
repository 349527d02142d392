"""Config values chosen from a registry, checked at startup against the registry itself.

The config layer imports no registry (the registries' packages import the config), so these
checks run where a config enters a run: `cbjax.app.config_merge.to_run_config`,
`merge_overrides` and the other commands' `cbjax.app.config_merge.typed_config`. A registered
addition (a plug-in policy, a new cost model) is selectable. No registry here imports jax.
"""

from __future__ import annotations

from typing import Callable

from cbjax.config import RunConfig
from cbjax.config.checks import _one_of


def policy_names() -> list[str]:
    from cbjax.scheduler import POLICIES  # the package registers the built-in policies

    return list(POLICIES)


def cost_model_names() -> list[str]:
    from cbjax.sim.cost import COST_MODELS

    return list(COST_MODELS)


def allocation_names() -> list[str]:
    from cbjax.cache.allocator import ALLOCATIONS

    return list(ALLOCATIONS)


def host_eviction_names() -> list[str]:
    from cbjax.cache.eviction import HOST_EVICTIONS

    return list(HOST_EVICTIONS)


def pace_names() -> list[str]:
    from cbjax.engine.clock import PACES

    return list(PACES)


def attention_names() -> list[str]:
    from cbjax.kernels.registry import attention_names

    return list(attention_names())


def matmul_names() -> list[str]:
    from cbjax.kernels.registry import matmul_names

    return list(matmul_names())


def router_names() -> list[str]:
    from cbjax.cluster.router import ROUTER_CLASSES

    return list(ROUTER_CLASSES)


# config key -> the names its registry holds
NAMES: dict[str, Callable[[], list[str]]] = {
    "scheduler.name": policy_names,
    "cache.allocation": allocation_names,
    "cache.host_eviction": host_eviction_names,
    "executor.cost_model": cost_model_names,
    "executor.pace": pace_names,
    "executor.attention": attention_names,
    "executor.matmul": matmul_names,
    "cluster.router": router_names,
}


def check_choices(cfg: RunConfig) -> RunConfig:
    """`cfg`, or a ValueError naming the key whose value its registry lacks."""
    for key, names in NAMES.items():
        group, field = key.split(".")
        value = getattr(getattr(cfg, group), field)
        if key == "scheduler.name" and cfg.scheduler.policy_class or key in ("cluster.router", "cache.host_eviction") and ":" in value:
            continue  # a user's class replaces the name; it is checked where it is loaded
        _one_of(key, value, names())
    return cfg
