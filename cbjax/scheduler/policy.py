"""The one policy interface: a policy owns the waiting queue, admission gating and victim choice."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Protocol, Sequence

from cbjax.core.plugins import build_plugin, load_class
from cbjax.core.request import Request

if TYPE_CHECKING:
    from cbjax.config import SchedulerConfig


class SchedulerView(Protocol):
    """What a policy may read of the scheduler: never the scheduler itself, so a plug-in policy
    cannot reach into its state and policies do not import it."""

    @property
    def running(self) -> Sequence[Request]:
        """The running requests, in admission order."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_free_slots(self) -> int: ...

    @property
    def num_free_pages(self) -> int: ...

    def pages_held(self, request_id: str) -> int:
        """Pages the running request holds."""

    def pages_freed_by(self, request_ids: Iterable[str]) -> int:
        """Pages that preempting these running requests would free: those no other running
        request shares (prefix caching)."""

    def admission_pages(self, req: Request) -> int:
        """Pages `req` needs to be admitted with its current tokens."""

    def cached_pages(self, req: Request) -> tuple[int, int]:
        """Leading pages of `req` cached (on the device, in the host tier, `cache.host_pages`)."""

    @property
    def num_host_pages_free(self) -> int:
        """Free pages of the host tier's pool (0 without one)."""


class PolicyContract(Protocol):
    """Every call the scheduler makes on a policy. `Policy` implements it; a plug-in may
    subclass `Policy` or implement this protocol directly."""

    name: str

    def push(self, request: Request) -> None: ...

    def requeue(self, request: Request) -> None: ...

    def peek(self) -> Optional[Request]: ...

    def pop(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...

    def admission_open(self, scheduler: SchedulerView) -> bool: ...

    def choose_victim(self, running: list[Request]) -> Request: ...

    @property
    def may_preempt_for(self) -> bool: ...

    def preempt_for(self, waiting: Request, scheduler: SchedulerView) -> Optional[Request]: ...

    def on_step(self, scheduled: list[Request], now: float) -> None: ...

    def forget(self, request: Request) -> None: ...


class Policy:
    """Base policy. Subclasses override the queue order, gating, victim choice or hooks.

    The scheduler calls, per iteration: `admission_open`, then `peek`/`pop` while slots, the
    token budget and pages allow; `choose_victim` when a running request cannot grow;
    `preempt_for` when the head lacks a slot or pages; and `on_step` after tokens are
    produced. Preempted requests come back through `requeue`; a request that ends outside a
    step (aborted, or cut at a stop string) is passed to `forget`.
    """

    name = "base"

    def __init__(self, cfg: "SchedulerConfig"):
        self.cfg = cfg

    # ---- waiting queue ----
    def push(self, request: Request) -> None:
        raise NotImplementedError

    def requeue(self, request: Request) -> None:
        """A preempted request returns to the waiting queue."""
        self.push(request)

    def peek(self) -> Optional[Request]:
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        """Take a waiting request out of the queue (its client left)."""
        raise NotImplementedError(f"{type(self).__name__} cannot remove a waiting request")

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError

    # ---- decisions ----
    def admission_open(self, scheduler: SchedulerView) -> bool:
        """Whether new requests may join the running batch this iteration."""
        return True

    def choose_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when pages run out: the latest admitted, as in vLLM."""
        return max(running, key=lambda r: r.admit_seq)

    @property
    def may_preempt_for(self) -> bool:
        """Whether `preempt_for` may return a victim (pipelined serving then waits for the step
        in flight before it schedules)."""
        return type(self).preempt_for is not Policy.preempt_for

    def preempt_for(self, waiting: Request, scheduler: SchedulerView) -> Optional[Request]:
        """A running request to preempt so that `waiting`, the queue's head, can be admitted.

        Called when the head lacks a free slot or pages; None (the default) leaves it waiting.
        """
        return None

    def on_step(self, scheduled: list[Request], now: float) -> None:
        """Called after each iteration with the requests that ran in it."""

    def forget(self, request: Request) -> None:
        """The request ended outside a step (aborted, or cut at a stop string), running or
        waiting (then after `remove`): drop what the policy keeps about it. A request ending in
        a step is seen FINISHED by `on_step` instead."""


class QueuedPolicy(Policy):
    """A policy whose waiting queue is one object, `queue`, with `peek`, `pop` (the head),
    `remove`, `len` and iteration in queue order; how requests enter it is the subclass's."""

    def __init__(self, cfg: "SchedulerConfig", queue):
        super().__init__(cfg)
        self._queue = queue

    def peek(self) -> Optional[Request]:
        return self._queue.peek()

    def pop(self) -> Request:
        return self._queue.pop()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class FifoQueue(deque):
    """Requests in the order they were queued. `pop` takes the head (a deque's `popleft`);
    length, iteration and `remove` are the deque's own, so they run in C on the hot path."""

    __slots__ = ()
    pop = deque.popleft

    def peek(self) -> Optional[Request]:
        return self[0] if self else None


class FCFSPolicy(QueuedPolicy):
    """First come, first served: continuous batching at iteration level (Orca, vLLM)."""

    name = "fcfs"

    def __init__(self, cfg: "SchedulerConfig"):
        super().__init__(cfg, FifoQueue())

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        # A preempted request was admitted before everything still waiting: it goes first.
        self._queue.appendleft(request)


class StaticPolicy(FCFSPolicy):
    """Static batching: a new batch forms only once every request of the previous one finished.

    Finished requests leave their slots idle until the whole batch is done: the bubble.
    """

    name = "static"

    def admission_open(self, scheduler: SchedulerView) -> bool:
        return not scheduler.running


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy selectable as `scheduler=NAME` (see scheduler/policies/).

    The built-in policies register this way; a plug-in may too, and is then selectable by name
    once its module is imported (`scheduler.policy_class` imports it)."""
    POLICIES[cls.name] = cls
    return cls


register(FCFSPolicy)
register(StaticPolicy)


def load_policy_class(path: str) -> type[Policy]:
    """The Policy subclass named by "package.module:ClassName" (`scheduler.policy_class`)."""
    return load_class(path, Policy, "scheduler.policy_class")


def make_policy(cfg: "SchedulerConfig") -> Policy:
    """The configured policy: `policy_class` if set, else the registered `name`, built with
    the config and `policy_args` as keyword arguments."""
    if cfg.policy_class:
        cls = load_policy_class(cfg.policy_class)
    elif cfg.name in POLICIES:
        cls = POLICIES[cfg.name]
    else:
        raise ValueError(f"scheduler.name: unknown policy {cfg.name!r}; choose one of {', '.join(POLICIES)}")
    return build_plugin(cls, cfg.policy_args, "scheduler.policy_args", cfg)
