"""Shortest job first: shortest predicted output first (oracle, running mean or learned predictor)."""

from __future__ import annotations

from cbjax.predictor import make_predictor
from cbjax.core.request import Request, Status
from cbjax.scheduler.policies.ranked import RankedPolicy
from cbjax.scheduler.policy import register


@register
class SJFPolicy(RankedPolicy):
    """Admits the waiting request with the shortest predicted remaining output; non-preemptive.

    `scheduler.predictor`: oracle (the true length of a length-only request, else max_tokens),
    mean (running mean of finished outputs: the same for every request, so the queue is fcfs)
    or learned (`scheduler.predictor_path`, numpy inference). A request's prediction is made
    once, when it first arrives. Victim when pages run out: the longest predicted remaining.
    """

    name = "sjf"

    def __init__(self, cfg, predictor=None):
        super().__init__(cfg)
        self.predictor = predictor or make_predictor(cfg)
        self._predicted: dict[Request, float] = {}

    def predicted_remaining(self, request: Request) -> float:
        if not self.predictor.per_request:
            total = self.predictor.predict(request)
        else:
            total = self._predicted.get(request)
            if total is None:
                total = self._predicted[request] = self.predictor.predict(request)
        return max(total - request.num_generated, 0.0)

    def rank(self, request: Request) -> float:
        # A prediction shared by all requests (the running mean) would go stale in the heap.
        return self.predicted_remaining(request) if self.predictor.per_request else 0.0

    def victim_key(self, request: Request) -> tuple:
        return (self.predicted_remaining(request), request.admit_seq)

    def forget(self, request: Request) -> None:
        self._predicted.pop(request, None)

    def on_step(self, scheduled: list[Request], now: float) -> None:
        super().on_step(scheduled, now)
        for req in scheduled:
            if req.status is Status.FINISHED:
                self.predictor.observe(req)
                self._predicted.pop(req, None)
