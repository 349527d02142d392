"""Virtual Token Counter (Sheng et al., OSDI'24): fair sharing of token service across clients."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterator, Optional

from cbjax.core.request import Request, Status
from cbjax.scheduler.policy import Policy, register


@register
class VTCPolicy(Policy):
    """Admits the earliest waiting request of the backlogged client with the smallest counter.

    Each client's counter sums the service it received: `vtc_input_weight` per prompt token,
    charged when the request is first admitted (so one fill of the batch spreads over
    clients), and `vtc_output_weight` per generated token, charged in `on_step` as tokens are
    produced. A client is backlogged while it has a waiting request. Counter lift (the
    paper's Algorithm 2): a client that becomes backlogged by a new arrival has its counter
    raised to the smallest backlogged counter, or, with nobody backlogged, to the counter of
    the client that left the queue last (admitted or withdrawn), so idle time banks no credit.
    Preempted requests return to the front of their client's queue without a lift, and their
    recompute is not charged again. Victim when pages run out: a request of the client with the largest
    counter, latest admitted first. Ties between clients go to the earliest queued head.
    """

    name = "vtc"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.input_weight = cfg.vtc_input_weight
        self.output_weight = cfg.vtc_output_weight
        self.counters: dict[str, float] = {}
        self._waiting: dict[str, deque[tuple[int, Request]]] = {}  # backlogged clients only
        # Heap of (counter, head seq, version, client), one live entry per backlogged client: an
        # entry is dropped once its version is not the client's (head changed, client left) and
        # re-keyed when it reaches the top with an old counter. Counters only grow, so a stored
        # key never exceeds the true one and the top, once current, is the true minimum.
        self._heap: list[tuple[float, int, int, str]] = []
        self._version: dict[str, int] = {}
        self._seq = itertools.count()
        self._arrival_seq: dict[Request, int] = {}
        self._charged: dict[Request, int] = {}  # generated tokens already charged
        self._last_left: Optional[str] = None
        self._len = 0

    # ---- bookkeeping ----
    def _refresh(self, client: str) -> None:
        """Invalidate the client's heap entry and, if it is backlogged, push a current one."""
        version = self._version[client] = self._version.get(client, 0) + 1
        queue = self._waiting.get(client)
        if queue:
            heapq.heappush(self._heap, (self.counters[client], queue[0][0], version, client))

    def _top(self) -> Optional[str]:
        heap, counters, versions = self._heap, self.counters, self._version
        while heap:
            counter, seq, version, client = heap[0]
            if version != versions[client]:
                heapq.heappop(heap)
            elif counter != counters[client]:
                heapq.heapreplace(heap, (counters[client], seq, version, client))
            else:
                return client
        return None

    # ---- waiting queue ----
    def push(self, request: Request) -> None:
        client = request.client_id
        counter = self.counters.setdefault(client, 0.0)
        seq = self._arrival_seq[request] = next(self._seq)
        if client not in self._waiting:
            top = self._top()
            if top is not None:
                floor = self.counters[top]
            elif self._last_left is not None:
                floor = self.counters[self._last_left]
            else:
                floor = 0.0
            self.counters[client] = max(counter, floor)
            self._waiting[client] = deque([(seq, request)])
            self._refresh(client)
        else:
            self._waiting[client].append((seq, request))
        self._len += 1

    def requeue(self, request: Request) -> None:
        client = request.client_id
        seq = self._arrival_seq.get(request)
        if seq is None:  # not queued through push (a policy swapped in mid-run)
            seq = self._arrival_seq[request] = next(self._seq)
        self._waiting.setdefault(client, deque()).appendleft((seq, request))
        self._refresh(client)
        self._len += 1

    def peek(self) -> Optional[Request]:
        client = self._top()
        return None if client is None else self._waiting[client][0][1]

    def pop(self) -> Request:
        client = self._top()
        if client is None:
            raise IndexError("pop from an empty vtc queue")
        queue = self._waiting[client]
        _, request = queue.popleft()
        if request.scheduled_s is None:
            self.counters[client] += self.input_weight * request.prompt_len
        if not queue:
            del self._waiting[client]
            self._last_left = client
        self._refresh(client)
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        client = request.client_id
        queue = self._waiting[client]
        entry = next(e for e in queue if e[1] is request)
        queue.remove(entry)
        self._arrival_seq.pop(request, None)
        if not queue:  # withdrawn (aborted) last: the client leaves the queue
            del self._waiting[client]
            self._last_left = client
        self._refresh(client)
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return (request for queue in self._waiting.values() for _, request in queue)

    # ---- decisions ----
    def choose_victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: (self.counters[r.client_id], r.admit_seq))

    def forget(self, request: Request) -> None:
        self._charged.pop(request, None)
        self._arrival_seq.pop(request, None)

    def on_step(self, scheduled: list[Request], now: float) -> None:
        counters, charged, weight = self.counters, self._charged, self.output_weight
        for req in scheduled:
            generated = req.num_generated
            new = generated - charged.get(req, 0)
            if new:
                counters[req.client_id] += weight * new
            if req.status is Status.FINISHED:
                charged.pop(req, None)
                self._arrival_seq.pop(req, None)
            else:
                charged[req] = generated
