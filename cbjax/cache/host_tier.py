"""The host-memory tier of the prefix cache (`cache.host_pages`; no jax): full pages the device
pool evicts are kept in host memory, and a later request whose cached prefix continues there
loads them back before its prefill instead of recomputing them."""

from __future__ import annotations

import heapq
from operator import attrgetter
from typing import Callable, Optional, Sequence

from cbjax.cache.eviction import make_host_eviction
from cbjax.core.plan import HostCopies, Schedule
from cbjax.core.request import Request

# A load's attribution (`HostTier.charge`) waits this many plans for its step's seconds at most.
_OWNER_PLANS = 8


class HostTierView:
    """What a host eviction policy reads of the tier (`cbjax.cache.eviction`), read-only."""

    __slots__ = ("_tier",)

    num_pages = property(attrgetter("_tier.num_pages"), doc="The tier's host pages.")
    num_used = property(attrgetter("_tier.num_used"), doc="Host pages the tier holds now.")

    def __init__(self, tier: "HostTier"):
        self._tier = tier

    def session_of(self, page: int) -> Optional[str]:
        """The session of the request that last registered, shared or loaded the page's contents
        before it entered the tier; fixed until the page leaves."""
        return self._tier._session_of.get(page)

    def expected(self, session_id: str) -> bool:
        """Whether the session's next turn is expected: its latest turn ended with
        `more_turns` and no later turn has been admitted or rejected since."""
        return session_id in self._tier._expected

    def droppable(self, page: int) -> bool:
        """Whether the page may be dropped now: not while a load of the plan being made reads it."""
        return page not in self._tier._pinned


class HostTier:
    """Host copies of full, hashed pages evicted from the device pool, in `num_pages` host pages.

    - A page the device pool evicts (`stored`, the allocator's `on_evict`) whose hash is not in
      the tier is copied to a free host page, the eviction policy dropping one when none is
      free; one whose hash is there costs nothing. The tier is inclusive: a page loaded back
      keeps its host copy, so the device may evict it again for free.
    - `match` finds the host pages that continue a request's device prefix; `load` copies them
      into the request's new device pages before its prefill (or, `prefetch`, while it waits).
    - One pool with swap preemption: the tier's pages and `swap_used()` (the host pages
      swapped-out requests hold) never exceed `num_pages` after a plan, and swap takes
      precedence: `fit` drops tier pages to make room for swap-outs.
    - Within one plan: a host page a load reads is pinned (never dropped); a device page loaded
      in the plan and evicted in the same plan loses its load (its contents never arrived) and
      is not stored.

    Each plan's copies go into it with `flush` (`Schedule.host_copies`). Counters: pages
    stored, loaded and prefetched, pages dropped, the peak in use, and the prompt tokens first
    admissions found on the device and in the tier.
    """

    def __init__(
        self, num_pages: int, page_size: int, eviction: str = "lru", prefetch: bool = False,
        swap_used: Callable[[], int] = lambda: 0,
    ):  # fmt: skip
        if num_pages < 1:
            raise ValueError(f"cache.host_pages must be >= 1 for a host tier, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefetch = prefetch
        self.swap_used = swap_used
        self._page_of: dict[int, int] = {}  # hash -> host page
        self._hash_of: dict[int, int] = {}  # host page -> hash
        self._free = list(range(num_pages))  # a min-heap: the lowest free host page first
        self._session_of: dict[int, str] = {}  # host page -> session
        self._device_session: dict[int, str] = {}  # device page -> session, carried to the host on a store
        self._expected: set[str] = set()  # sessions whose next turn is expected
        self.eviction = make_host_eviction(eviction, HostTierView(self))
        # the plan being made
        self._stores: list[tuple[int, int]] = []
        self._loads: list[list] = []  # [request, host pages, device pages, prefetch]
        self._loading: dict[int, list] = {}  # device page -> its load's entry
        self._pinned: set[int] = set()
        self._prefetched: dict[str, set[int]] = {}  # waiting request -> device pages prefetched for it
        self._owners: dict[int, list[tuple[Request, int, bool]]] = {}  # step_id -> loads to charge
        self.num_stored = 0
        self.num_loaded = 0
        self.num_prefetched = 0
        self.num_dropped = 0
        self.peak_used = 0
        self.prompt_tokens_hit_device = 0  # over first admissions
        self.prompt_tokens_hit_host = 0
        self.tokens_hit_host = 0  # at every admission

    @property
    def num_used(self) -> int:
        """Host pages the tier holds."""
        return len(self._hash_of)

    def match(self, hashes: Sequence[int], start: int) -> list[int]:
        """The host pages holding `hashes[start:]`, as far as the chain continues in the tier."""
        page_of, out = self._page_of, []
        for i in range(start, len(hashes)):
            page = page_of.get(hashes[i])
            if page is None:
                break
            out.append(page)
        return out

    # ---- the allocator's side ----
    def stored(self, page: int, h: int) -> None:
        """The device pool evicts `page`, holding the page of hash `h` (`PageAllocator.on_evict`)."""
        session = self._device_session.pop(page, None)
        entry = self._loading.pop(page, None)
        if entry is not None:  # loaded in this plan: the load is moot, and there is nothing to keep
            i = entry[2].index(page)
            del entry[1][i], entry[2][i]
            if entry[3]:
                self._prefetched[entry[0].request_id].discard(page)
                self.num_prefetched -= 1
            else:
                self.num_loaded -= 1
            return
        host = self._page_of.get(h)
        if host is not None:
            self.eviction.touched(host)
            return
        if not self._make_room():
            return  # every host page is pinned: the page is dropped
        host = heapq.heappop(self._free)
        self._page_of[h] = host
        self._hash_of[host] = h
        if session is not None:
            self._session_of[host] = session
        self.eviction.inserted(host)
        self._stores.append((page, host))
        self.num_stored += 1
        if len(self._hash_of) > self.peak_used:
            self.peak_used = len(self._hash_of)

    def tag(self, pages: Sequence[int], session_id: Optional[str]) -> None:
        """The device pages now hold contents of `session_id`'s (registered, shared or loaded)."""
        if session_id is not None:
            self._device_session.update(dict.fromkeys(pages, session_id))
        else:
            for page in pages:
                self._device_session.pop(page, None)

    # ---- admissions ----
    def pin(self, hosts: Sequence[int]) -> None:
        """A load of the plan being made will read these host pages: keep them until it is written."""
        for host in hosts:
            self.eviction.touched(host)
        self._pinned.update(hosts)

    def load(self, req: Request, hosts: Sequence[int], pages: Sequence[int], prefetch: bool = False) -> None:
        """Copy `hosts` into `req`'s device `pages` before the plan's step (pinned already)."""
        entry = [req, list(hosts), list(pages), prefetch]
        self._loads.append(entry)
        self._loading.update(dict.fromkeys(pages, entry))
        if prefetch:
            self._prefetched.setdefault(req.request_id, set()).update(pages)
            self.num_prefetched += len(pages)
        else:
            self.num_loaded += len(pages)
        self.tag(pages, req.session_id)

    def loading(self, request_id: str) -> bool:
        """Whether a load of the plan being made writes the request's pages."""
        return any(entry[0].request_id == request_id and entry[2] for entry in self._loads)

    def admitted(self, req: Request, device: Sequence[int], num_loaded: int) -> None:
        """`req` is admitted on `device`, its cached device pages, and `num_loaded` pages loaded
        now: its hits (a page prefetched for it counts as a host hit) and its session's turn."""
        prefetched = self._prefetched.pop(req.request_id, None)
        from_host = num_loaded + (sum(1 for p in device if p in prefetched) if prefetched else 0)
        ps = self.page_size
        if req.scheduled_s is None:  # first admission
            req.prefix_hit_tokens_device = (len(device) + num_loaded - from_host) * ps
            req.prefix_hit_tokens_host = from_host * ps
            self.prompt_tokens_hit_device += req.prefix_hit_tokens_device
            self.prompt_tokens_hit_host += req.prefix_hit_tokens_host
            if req.kv_load_s is None:
                req.kv_load_s = 0.0
        self.tokens_hit_host += from_host * ps
        if req.session_id is not None:
            if req.session_id in self._expected:
                self._expected.discard(req.session_id)
                self.eviction.expected_changed(req.session_id)
            self.tag(device, req.session_id)

    def turn_ended(self, req: Request) -> None:
        """`req` ended (or left its slot for good): expect its session's next turn if it has one."""
        self._prefetched.pop(req.request_id, None)
        if req.session_id is not None and req.more_turns and req.session_id not in self._expected:
            self._expected.add(req.session_id)
            self.eviction.expected_changed(req.session_id)

    def turn_not_admitted(self, req: Request) -> None:
        """`req`, its session's expected turn, came and will not be admitted here (it was
        rejected, and a later turn follows a rejected one and is rejected too; or a cluster
        sent it to another replica): the session is expected no more."""
        if req.session_id is not None and req.session_id in self._expected:
            self._expected.discard(req.session_id)
            self.eviction.expected_changed(req.session_id)

    # ---- the pool ----
    def _make_room(self) -> bool:
        """A free host page, dropping one if needed; False if none can be dropped."""
        while not self._free or len(self._hash_of) + self.swap_used() >= self.num_pages:
            victim = self.eviction.victim()
            if victim is None:
                return False
            self._drop(victim)
        return True

    def fit(self) -> None:
        """Drop tier pages until the tier and the swapped-out requests fit the pool."""
        while self._hash_of and len(self._hash_of) + self.swap_used() > self.num_pages:
            victim = self.eviction.victim()
            if victim is None:
                return
            self._drop(victim)

    def _drop(self, host: int) -> None:
        del self._page_of[self._hash_of.pop(host)]
        self._session_of.pop(host, None)
        self.eviction.removed(host)
        heapq.heappush(self._free, host)
        self.num_dropped += 1

    # ---- plans ----
    def flush(self, plan: Schedule) -> None:
        """Write the plan's copies into it (`Schedule.host_copies`) and start the next plan's."""
        loads = [e for e in self._loads if e[2]]
        if self._stores or loads:
            plan.host_copies = HostCopies(
                tuple(self._stores),
                tuple((e[0].request_id, tuple(e[1]), tuple(e[2])) for e in loads if not e[3]),
                tuple((e[0].request_id, tuple(e[1]), tuple(e[2])) for e in loads if e[3]),
            )
            if loads:
                self._owners[plan.step_id] = [(e[0], len(e[2]), e[3]) for e in loads]
                for step_id in [s for s in self._owners if s <= plan.step_id - _OWNER_PLANS]:
                    del self._owners[step_id]
        self._stores, self._loads = [], []
        self._loading.clear()
        self._pinned.clear()
        self.fit()

    def charge(self, step_id: int, load_s: float, prefetch_s: float) -> None:
        """Add each request's share, by pages, of its plan's load (or prefetch) seconds to its
        `kv_load_s`."""
        owners = self._owners.pop(step_id, None)
        if not owners:
            return
        pages = [sum(n for _, n, pf in owners if not pf), sum(n for _, n, pf in owners if pf)]
        seconds = (load_s, prefetch_s)
        for req, n, pf in owners:
            req.kv_load_s = (req.kv_load_s or 0.0) + seconds[pf] * n / pages[pf]

    def stats(self, prompt_tokens_admitted: int) -> dict:
        """summary.json's host-tier fields: the prompt tokens of first admissions found on the
        device and in the tier (as tokens and as shares of the prompt tokens admitted), pages
        copied each way (prefetches among the loaded), pages the tier dropped, and its peak."""
        admitted = prompt_tokens_admitted
        return {
            "prefix_hit_rate_device": self.prompt_tokens_hit_device / admitted if admitted else 0.0,
            "prefix_hit_rate_host": self.prompt_tokens_hit_host / admitted if admitted else 0.0,
            "prefix_hit_tokens_device": self.prompt_tokens_hit_device,
            "prefix_hit_tokens_host": self.prompt_tokens_hit_host,
            "kv_host_pages_stored": self.num_stored,
            "kv_host_pages_loaded": self.num_loaded + self.num_prefetched,
            "kv_host_pages_prefetched": self.num_prefetched,
            "kv_host_evictions": self.num_dropped,
            "kv_host_pages_peak": self.peak_used,
        }

    def clear_requests(self) -> None:
        """Forget every request's prefetches (a run cut short); the cached pages stay."""
        self._prefetched.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError unless every host page is free or holds one hash, the eviction
        policy knows exactly the pages in use, the pool is not overcommitted, and no plan is
        half made."""
        used = set(self._hash_of)
        assert len(self._free) == len(set(self._free)), "a host page is free twice"
        assert not used & set(self._free), "a host page is both free and in use"
        assert used | set(self._free) == set(range(self.num_pages)), "a host page was lost"
        assert {h: p for p, h in self._hash_of.items()} == self._page_of, "the host index is inconsistent"
        assert set(self.eviction.pages) == used, "the eviction policy's pages differ from those in use"
        assert set(self._session_of) <= used, "a free host page keeps a session"
        assert not used or len(used) + self.swap_used() <= self.num_pages, "the host pool is overcommitted"
        assert not (self._stores or self._loads or self._loading or self._pinned), "a plan's copies are pending"
