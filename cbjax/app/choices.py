"""Config values chosen from a registry (policies, cost models), checked at startup.

The config layer imports no registry (the registries' modules import the config), so these
checks run where a config enters the run: `cbjax.app.config_merge.to_run_config` and
`merge_overrides`. A registered addition (a plug-in policy, a new cost model) is selectable.
"""

from __future__ import annotations

from cbjax.config import RunConfig
from cbjax.config.checks import _one_of


def policy_names() -> list[str]:
    from cbjax.scheduler import POLICIES  # the package registers the built-in policies

    return list(POLICIES)


def cost_model_names() -> list[str]:
    from cbjax.sim.cost import COST_MODELS

    return list(COST_MODELS)


def check_choices(cfg: RunConfig) -> RunConfig:
    """`cfg`, or a ValueError naming the key whose value no registry knows."""
    if not cfg.scheduler.policy_class:  # a policy class replaces the name's policy
        _one_of("scheduler.name", cfg.scheduler.name, policy_names())
    _one_of("executor.cost_model", cfg.executor.cost_model, cost_model_names())
    return cfg
