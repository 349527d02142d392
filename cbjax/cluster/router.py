"""Routers: which replica serves an arriving request, from a read-only view of each (no jax).

A router is a small object whose `route` is a pure function of the request (`RouteRequest`,
plain data) and of one `ReplicaState` per replica: queue lengths, free pages and a prefix
index. It returns a replica's position in that sequence. Under prefill/decode disaggregation
`route` picks the prefill replica and `route_decode`, once the prefill is done, the decode
replica. Built-in routers register by name (`cluster.router`); a user's router is
"package.module:ClassName" (a `Router` subclass), built with `cluster.router_args`.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from cbjax.core.plugins import build_plugin, load_class


@dataclass(frozen=True)
class RouteRequest:
    """What a router sees of a request."""

    request_id: str
    prompt_len: int
    # Chained hashes of the prompt's full pages; empty unless the router sets `uses_prefix`.
    page_hashes: tuple[int, ...] = ()
    client_id: str = "default"
    priority: int = 0


class ReplicaState(Protocol):
    """One replica as a router sees it, read-only."""

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a slot, preempted ones and those whose K/V is on its way here included."""

    @property
    def num_running(self) -> int:
        """Requests holding a slot."""

    @property
    def num_free_pages(self) -> int:
        """KV pages that can be handed out (free, or cached and unreferenced), less those held
        for K/V on its way here."""

    @property
    def num_usable_pages(self) -> int:
        """KV pages in the replica's pool (the null page excluded)."""

    @property
    def num_indexed_pages(self) -> int:
        """Pages in the replica's prefix index (what the router believes it caches)."""

    def cached_pages(self, page_hashes: Sequence[int]) -> int:
        """Leading pages of `page_hashes` the replica's prefix index holds."""

    def cached_pages_by_tier(self, page_hashes: Sequence[int]) -> tuple[int, int]:
        """Those leading pages by tier: (on the device, in host memory, `cache.host_pages`)."""


@dataclass(frozen=True)
class ReplicaSnapshot:
    """A `ReplicaState` frozen as plain data (tests, and routers reasoning by hand)."""

    num_waiting: int = 0
    num_running: int = 0
    num_free_pages: int = 0
    num_usable_pages: int = 0
    cached: frozenset[int] = frozenset()  # page hashes in the replica's prefix index
    host_cached: frozenset[int] = frozenset()  # page hashes it holds in its host tier

    @property
    def num_indexed_pages(self) -> int:
        return len(self.cached) + len(self.host_cached)

    def cached_pages(self, page_hashes: Sequence[int]) -> int:
        return sum(self.cached_pages_by_tier(page_hashes))

    def cached_pages_by_tier(self, page_hashes: Sequence[int]) -> tuple[int, int]:
        n = m = 0
        for h in page_hashes:
            if h in self.cached:
                n += 1
            elif h in self.host_cached:
                m += 1
            else:
                break
        return n, m


def outstanding(replica: ReplicaState) -> int:
    """Requests waiting or running on the replica."""
    return replica.num_waiting + replica.num_running


class Router:
    """Base router. Subclasses override `route` (and `route_decode` for P/D)."""

    name = "base"
    # True: the driver computes the request's page hashes (`RouteRequest.page_hashes`).
    uses_prefix = False

    def route(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        raise NotImplementedError

    def route_decode(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        """The decode replica for a prefilled request: the most free pages, then the fewest
        outstanding requests, then the lowest position."""
        return min(range(len(replicas)), key=lambda i: (-replicas[i].num_free_pages, outstanding(replicas[i]), i))


class RoundRobin(Router):
    """Replicas in turn, whatever their load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        i = self._next % len(replicas)
        self._next = i + 1
        return i


class LeastLoaded(Router):
    """The fewest outstanding (waiting + running) requests; ties to the lowest position."""

    name = "least_loaded"

    def route(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        loads = [outstanding(r) for r in replicas]
        return loads.index(min(loads))  # the first of the fewest


class LeastKV(Router):
    """The most free KV pages; ties to the fewest outstanding requests, then the lowest position."""

    name = "least_kv"

    def route(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        return Router.route_decode(self, req, replicas)


class PowerOfTwo(Router):
    """Two replicas drawn at random (seeded), the one with fewer outstanding requests
    (Mitzenmacher's power of two choices); a tie goes to the first drawn."""

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        n = len(replicas)
        if n == 1:
            return 0
        a, b = self._rng.sample(range(n), 2)
        return b if outstanding(replicas[b]) < outstanding(replicas[a]) else a


class PrefixAffinity(Router):
    """The longest cached prefix, bounded by load (SGLang's cache-aware router, Preble).

    Among replicas whose outstanding requests exceed the least loaded one's by at most
    `max_imbalance`, the one whose prefix index holds the most leading pages of the prompt;
    ties (no match anywhere included) go to the least loaded, then to the smallest prefix
    index (the most room for a new prefix, as SGLang's router sends an unmatched prompt to its
    smallest tree), then the lowest position. A hot prefix thus stays on one replica until
    that replica runs `max_imbalance` requests ahead, and new prefixes spread out.

    A page the index holds in a replica's host tier counts `host_weight` of a device page: it
    saves its prefill's compute but costs a copy back over the host link (the default, 1/2,
    values that copy at half the page's recompute; `cluster.router_args.host_weight`).
    """

    name = "prefix_affinity"
    uses_prefix = True

    def __init__(self, max_imbalance: int = 8, host_weight: float = 0.5) -> None:
        if max_imbalance < 0:
            raise ValueError(f"cluster.router_args.max_imbalance must be >= 0, got {max_imbalance}")
        if not 0 <= host_weight <= 1:
            raise ValueError(f"cluster.router_args.host_weight must be in [0, 1], got {host_weight}")
        self.max_imbalance = max_imbalance
        self.host_weight = host_weight

    def route(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        loads = [outstanding(r) for r in replicas]
        bound = min(loads) + self.max_imbalance
        best, best_key = 0, None
        for i, replica in enumerate(replicas):
            if loads[i] > bound:
                continue
            device, host = replica.cached_pages_by_tier(req.page_hashes)
            key = (-(device + self.host_weight * host if host else device), loads[i], replica.num_indexed_pages, i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best


ROUTER_CLASSES: dict[str, type[Router]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, LeastKV, PrefixAffinity, PowerOfTwo)
}


def load_router_class(path: str) -> type[Router]:
    """The Router subclass named by "package.module:ClassName" (`cluster.router`)."""
    return load_class(path, Router, "cluster.router")


def make_router(name: str, args: Optional[dict] = None, seed: Optional[int] = None) -> Router:
    """The router `name` (built-in, or "package.module:ClassName") built with `args`; a router
    whose constructor takes a `seed` that `args` leaves out gets `seed` (the run's), so the
    seeds of a sweep draw differently as the run's other random draws do."""
    if ":" in name:
        cls = load_router_class(name)
    elif name in ROUTER_CLASSES:
        cls = ROUTER_CLASSES[name]
    else:
        raise ValueError(f"cluster.router: unknown value {name!r}; choose one of {', '.join(ROUTER_CLASSES)}")
    if seed is not None and "seed" not in (args or {}) and "seed" in inspect.signature(cls).parameters:
        args = {**(args or {}), "seed": seed}
    return build_plugin(cls, args, "cluster.router_args")
