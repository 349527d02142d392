"""Host-side scheduling: policies behind one interface, and the iteration-level scheduler."""

from cbjax.scheduler.core import Schedule, Scheduler
from cbjax.scheduler.policy import POLICIES, Policy, make_policy
from cbjax.scheduler import policies  # noqa: F401  registers priority, sjf, mlfq, vtc

__all__ = ["POLICIES", "Policy", "Schedule", "Scheduler", "make_policy"]
