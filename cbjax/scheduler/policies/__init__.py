"""Scheduling policies beyond fcfs and static, one module each, registered as `scheduler=NAME`."""

from cbjax.scheduler.policies.mlfq import MLFQPolicy
from cbjax.scheduler.policies.priority import PriorityPolicy
from cbjax.scheduler.policies.ranked import RankedPolicy, RankedQueue
from cbjax.scheduler.policies.sjf import SJFPolicy
from cbjax.scheduler.policies.vtc import VTCPolicy

__all__ = ["MLFQPolicy", "PriorityPolicy", "RankedPolicy", "RankedQueue", "SJFPolicy", "VTCPolicy"]
