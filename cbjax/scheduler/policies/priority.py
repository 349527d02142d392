"""Priority scheduling: lower `Request.priority` first, optionally evicting lower-priority requests."""

from __future__ import annotations

from cbjax.core.request import Request
from cbjax.scheduler.policies.ranked import RankedPolicy
from cbjax.scheduler.policy import register


@register
class PriorityPolicy(RankedPolicy):
    """Lower `priority` value first, FCFS among equals (vLLM's convention).

    With `scheduler.priority_preempt`, a waiting request that lacks a slot or pages preempts
    (by `scheduler.preemption`) the lowest-priority running request it strictly outranks, latest admitted
    among equals. When pages run out the victim is chosen the same way.
    """

    name = "priority"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.preempts = cfg.priority_preempt

    def rank(self, request: Request) -> float:
        return request.priority
