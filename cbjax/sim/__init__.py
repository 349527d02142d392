"""The simulator executor: schedules run on a virtual clock under a pluggable cost model."""

from cbjax.sim.cost import COST_MODELS, RooflineCost, UnitCost, make_cost_model
from cbjax.sim.executor import SimExecutor

__all__ = ["COST_MODELS", "RooflineCost", "SimExecutor", "UnitCost", "make_cost_model"]
