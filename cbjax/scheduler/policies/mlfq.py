"""Skip-join multi-level feedback queue (FastServe, Wu et al. 2023), quanta counted in tokens."""

from __future__ import annotations

from cbjax.core.request import Request, Status
from cbjax.scheduler.policies.ranked import RankedPolicy
from cbjax.scheduler.policy import register


@register
class MLFQPolicy(RankedPolicy):
    """K queues; queue i (0 is the highest priority) has quantum `base * 2**i` tokens.

    Skip-join: FastServe places an arriving job in the highest-priority queue whose quantum is
    at least its first iteration's time, so a long prefill skips the queues it would exhaust
    at once. Time here is counted in tokens: the entry queue is the lowest i with
    `base * 2**i >= prompt_len`, or the last queue. Demotion: a request moves down one queue
    once it has generated that queue's quantum of tokens since it entered it (the prefill's
    first token included); the last queue never demotes. Unlike FastServe's time accounting,
    the prefill's cost only picks the entry queue and is not charged against its quantum.
    Admission takes the head of the highest non-empty queue, FCFS within a queue.

    With `scheduler.mlfq_preempt` (FastServe's iteration-level preemption) a waiting request
    that lacks a slot or pages preempts the running request in the lowest queue below its
    own, latest admitted first. FastServe swaps the evicted KV cache to host memory; here that
    is `scheduler.preemption=swap`, and the default recomputes it. Preempted requests keep their queue and quantum use. FastServe also lifts
    jobs that waited past a limit back to the top queue; that is not implemented here, so
    under sustained load of short requests the lower queues may wait indefinitely.
    """

    name = "mlfq"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.preempts = cfg.mlfq_preempt
        self.quanta = [cfg.mlfq_base_quantum * 2**i for i in range(cfg.mlfq_num_queues)]
        # request -> [queue index, num_generated when it entered that queue]
        self._state: dict[Request, list[int]] = {}

    def entry_queue(self, prompt_len: int) -> int:
        for i, quantum in enumerate(self.quanta):
            if quantum >= prompt_len:
                return i
        return len(self.quanta) - 1

    def level(self, request: Request) -> int:
        """The request's current queue (0 is the highest priority)."""
        return self._state[request][0]

    def rank(self, request: Request) -> float:
        return self._state[request][0]

    def push(self, request: Request) -> None:
        self._state[request] = [self.entry_queue(request.prompt_len), request.num_generated]
        super().push(request)

    def forget(self, request: Request) -> None:
        self._state.pop(request, None)

    def on_step(self, scheduled: list[Request], now: float) -> None:
        super().on_step(scheduled, now)
        states, quanta, last = self._state, self.quanta, len(self.quanta) - 1
        for req in scheduled:
            if req.status is Status.FINISHED:
                del states[req]
                continue
            state = states[req]
            level = state[0]
            if level < last and req.num_generated - state[1] >= quanta[level]:
                state[0] = level + 1
                state[1] = req.num_generated
