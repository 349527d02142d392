"""The host-side iteration-level scheduler: waiting queue, running set, fixed slot array (no jax)."""

from __future__ import annotations

import operator
from typing import Callable, Optional, Sequence

from cbjax.cache import make_allocator
from cbjax.cache.host_tier import HostTier
from cbjax.cache.prefix import PrefixCache
from cbjax.config import CacheConfig, SchedulerConfig, SpecConfig
from cbjax.core.plan import Schedule
from cbjax.core.request import FinishReason, Request, Status, eos_token_ids
from cbjax.core.results import LoadCounts
from cbjax.scheduler.drafts import Drafts
from cbjax.scheduler.intake import output_bound, rejection_reason
from cbjax.scheduler.output import PlanWriter
from cbjax.scheduler.planning import Planner
from cbjax.scheduler.policy import PolicyContract, make_policy
from cbjax.scheduler.results import StepResults
from cbjax.scheduler.running import RunningSet
from cbjax.scheduler.stretch import DecodeStretch
from cbjax.scheduler.view import PolicyView
from cbjax.scheduler.waiting import WaitingQueue
from cbjax.spec.policy import make_spec_policy


def _delegate(path: str, doc: str, settable: bool = False) -> property:
    """A property that reads (and if `settable`, writes) `self.<part>.<attr>` for `path`
    "part.attr"; an attrgetter reads it without a Python call."""
    part, _, attr = path.partition(".")
    fset = (lambda self, value: setattr(getattr(self, part), attr, value)) if settable else None
    return property(operator.attrgetter(path), fset, doc=doc)


class Scheduler:
    """Admits, preempts and retires requests; one `schedule` + `postprocess` pair per iteration.

    Iteration semantics: finished requests have freed their slots before `schedule` runs; free
    slots are filled from the waiting queue by the policy; a newly admitted request prefills in
    that iteration and its prefill yields its first token; every running request yields one
    token per iteration, so a request of output length L finishes at the end of its L-th.

    Prefix caching (`cache.prefix_caching`, see `cbjax.cache.prefix`): a request's full pages
    are registered once computed; at admission its cached leading pages are shared and
    `num_computed` starts after them.

    Swap preemption (`scheduler.preemption=swap`): the victim's computed pages go to host
    memory (`Schedule.swap_out`) and it keeps `num_computed`; on readmission new pages are
    allocated and the host copy comes back (`Schedule.swap_in`), bypassing the prefix cache.
    A victim with nothing computed, or whose pages exceed the free host pages
    (`cache.num_swap_pages`), is recomputed instead.

    Host tier (`cache.host_pages`, `cbjax.cache.host_tier`): full pages the device pool evicts
    go to host memory, and an admission whose cached prefix continues there loads those pages
    back (`Schedule.host_copies`) and computes only the rest. Swap-outs share its host pool.

    Its parts, each given what it reads: `RunningSet` (the slots and running requests), `WaitingQueue`
    (the policy's queue and the host pages beside it), `Planner` (one iteration's plan),
    `PlanWriter` (plans as data) and `StepResults` (a step's tokens).

    Speculative decoding (`spec`, `cbjax.scheduler.drafts`): a decode may verify drafts in its
    step and yield several tokens; `step_cost(plan)`, a step's seconds, prices the `goodput`
    policy's choices. Every step then runs to completion (no pipelining, no decode stretches).
    """

    def __init__(
        self,
        cfg: SchedulerConfig,
        cache: CacheConfig,
        max_model_len: int,
        policy: Optional[PolicyContract] = None,
        validate: Optional[Callable[[Request], Optional[str]]] = None,
        eos_token_id: Optional[int] = None,
        vocab_size: Optional[int] = None,
        spec: Optional[SpecConfig] = None,
        step_cost: Optional[Callable[[Schedule], float]] = None,
        extra_eos_token_ids: Sequence[int] = (),
    ):
        self.cfg = cfg
        self.max_num_seqs = cfg.max_num_seqs
        self.token_budget = cfg.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy if policy is not None else make_policy(cfg)  # an empty queue is falsy
        self.allocation = cache.allocation
        self.allocator = make_allocator(
            cache.num_pages, cache.page_size, cache.allocation, cache.prefix_caching, cache.reservation_fit
        )
        self.prefix = PrefixCache(self.allocator) if cache.prefix_caching else None
        self.validate = validate
        eos_ids = frozenset(eos_token_ids(eos_token_id, extra_eos_token_ids))
        self.vocab_size = vocab_size  # model.vocab_size: prompt ids must be below it
        self.finished: list[Request] = []  # every request that ended, in the order they did
        self.writer = PlanWriter(cfg.max_num_seqs, self.allocator)
        self.running_set = RunningSet(cfg.max_num_seqs, self.allocator, self.writer, self.prefix)
        self.results = StepResults(
            self.running_set, self.writer, self.policy, self.allocator, self.prefix,
            token_budget=self.token_budget, max_model_len=max_model_len, eos_token_ids=eos_ids,
        )  # fmt: skip
        self.waiting = WaitingQueue(self.policy, self.allocator, self.reserve_tokens, cache.swap_capacity)
        self.tier = None
        if cache.host_pages:
            waiting = self.waiting
            self.tier = HostTier(
                cache.host_pages, cache.page_size, cache.host_eviction, cache.host_prefetch,
                swap_used=lambda: waiting.swap_used,
            )  # fmt: skip
            self.prefix.tier = self.tier
            self.allocator.on_evict = self.tier.stored
        self.view = PolicyView(self.running_set, self.policy, self.allocator, self.reserve_tokens, self.prefix)
        self.drafts: Optional[Drafts] = None
        if spec is not None and spec.enabled:
            self.drafts = Drafts(spec, make_spec_policy(spec), self.allocator, self.writer, self.running_set,
                                 self.policy, step_cost, eos_ids)  # fmt: skip
        self.planner = Planner(
            cfg, self.running_set, self.waiting, self.policy, self.view, self.allocator, self.prefix, self.writer,
            self.reserve_tokens, self.results, self.drafts,
        )  # fmt: skip
        # static padding charges every plan its batch's padded rows, and drafts make each step's
        # tokens unknown until it ran: no stretch writes those
        self.stretch = None if cfg.static_padding or self.drafts is not None else DecodeStretch(
            self.running_set, self.writer, self.policy, self.allocator, self.token_budget,
            grows=self.tier is None and not self.allocator.reserve, prefix=self.prefix)  # fmt: skip

    # what the parts hold, read (and where settable, written) as the scheduler's own
    running = _delegate("running_set.running", "The running requests, in admission order.")
    slots = _delegate("running_set.slots", "The request in each slot, or None.")
    num_preemptions = _delegate("planner.num_preemptions", "Preemptions so far, by swap or by recompute.")
    swap_used = _delegate("waiting.swap_used", "Host pages that waiting requests' K/V occupies.")
    tbt_s = _delegate("results.tbt_s", "Every gap between a request's consecutive tokens.")
    hold_finished_pages = _delegate("running_set.hold_finished_pages", "Whether a finished request keeps its pages "
                                    "(see `RunningSet`).", settable=True)  # fmt: skip

    @property
    def speculating(self) -> bool:
        """Whether decodes may verify drafts (`spec.method` is not none): steps run to completion."""
        return self.drafts is not None

    @property
    def plan_token_ids(self) -> bool:
        """Whether plans carry token ids (`PlanWriter.token_ids`; EngineLoop sets it). An executor
        that reads ids names every cached page by its ids (`PrefixCache.synthetic_keys`)."""
        return self.writer.token_ids

    @plan_token_ids.setter
    def plan_token_ids(self, value: bool) -> None:
        self.writer.token_ids = value
        if self.prefix is not None:
            self.prefix.synthetic_keys = not value

    # ---- intake ----
    def rejection_reason(self, req: Request) -> Optional[str]:
        """Why the request can never run here, or None (`cbjax.scheduler.intake`)."""
        return rejection_reason(self, req)

    def reserve_tokens(self, req: Request) -> int:
        """Tokens a reservation covers (the last token's K/V is never stored, hence the -1):
        the maximum length (`reserve_max`), the prompt plus the next power of two of the output
        length (`reserve_pow2`), or the prompt plus the output length (`reserve_oracle`; a
        request stopping at EOS has only its stopping bound known), capped by max_model_len.
        Under `paged`, the maximum length (unused: pages come on demand)."""
        out = req.max_output_len
        if self.allocation == "reserve_oracle":
            return req.prompt_len + out - 1
        if self.allocation == "reserve_pow2":
            return min(req.prompt_len + (1 << max(0, out - 1).bit_length()), self.max_model_len) - 1
        return min(req.prompt_len + req.sampling.max_tokens, self.max_model_len) - 1

    def load(self) -> LoadCounts:
        """The load now (from another thread: a racy read of list lengths and counters, which
        may see an iteration half done but never a torn number)."""
        alloc, tier = self.allocator, self.tier
        counts = LoadCounts(len(self.running_set.running), len(self.policy), alloc.num_used_pages,
                            alloc.num_usable_pages, self.planner.num_preemptions)  # fmt: skip
        if tier is None:
            return counts
        return counts._replace(
            host_pages_used=tier.num_used, host_pages_total=tier.num_pages, host_hit_tokens=tier.tokens_hit_host,
            host_pages_stored=tier.num_stored, host_pages_loaded=tier.num_loaded + tier.num_prefetched,
        )  # fmt: skip

    def kv_breakdown(self) -> tuple[int, int, int, int, int]:
        """The pool's slots split five ways (see `PageAllocator.slot_breakdown`); external
        fragmentation is judged against the smallest reservation among waiting requests."""
        return self.allocator.slot_breakdown(self.running_set.final_tokens.items(), self.waiting.smallest_reservation())

    def add(self, req: Request, now: float) -> None:
        """Accept a newly arrived request, or reject it with a reason."""
        self._enqueue(req, now, 0)

    def _enqueue(self, req: Request, now: float, host_pages: int) -> None:
        """Queue an arrived request, holding `host_pages` pages of K/V in host memory (a
        transferred request), or reject it with a reason."""
        req.max_output_len = output_bound(req, self.max_model_len)
        self._mark(req)
        reason = self.rejection_reason(req)
        if reason is not None:
            self.reject(req, reason, now)
            return
        req.status = Status.WAITING
        self.waiting.push(req, host_pages)

    def add_transferred(self, req: Request, now: float, num_pages: int) -> None:
        """Accept a request prefilled on another replica (prefill/decode disaggregation, see
        `cbjax.cluster`) whose K/V for its `num_computed` tokens, `num_pages` pages, arrived in
        host memory. It waits as a swapped-out request does: its admission allocates pages,
        copies the host pages in (`Schedule.swap_in`) and continues from `num_computed`."""
        need = self.allocator.pages_for(req.num_computed)
        if req.num_computed < 1 or num_pages != need:
            raise ValueError(
                f"add_transferred: request {req.request_id} has {req.num_computed} computed tokens "
                f"({need} pages), got {num_pages} pages"
            )
        self._enqueue(req, now, num_pages)

    def reject(self, req: Request, reason: str, now: float) -> None:
        """End a request that never entered the queue, with reason `rejected`."""
        self._mark(req)
        req.status = Status.FINISHED
        req.finish_reason = FinishReason.REJECTED
        req.reject_reason = reason
        req.finish_s = now
        if self.tier is not None:
            self.tier.turn_not_admitted(req)
        self.finished.append(req)

    def not_arrived(self, req: Request) -> None:
        """End a request whose arrival time the run never reached (it was stopped first):
        fate `not_arrived`, no finish time."""
        self._mark(req)
        req.status = Status.FINISHED
        req.finish_reason = FinishReason.NOT_ARRIVED
        req.finish_s = None
        self.finished.append(req)

    def _mark(self, req: Request) -> None:
        """A request this scheduler saw while speculating has a (maybe empty) list of decode steps,
        so its row carries the speculation fields."""
        if self.drafts is not None and req.spec_steps is None:
            req.spec_steps = []

    def abort(
        self, request_id: str, now: float, reason: str = "aborted", finish_reason: FinishReason = FinishReason.ABORTED
    ) -> bool:
        """End one waiting or running request (e.g. its client left: `aborted`, with `reason` as
        its error; or a stop string the server found in its text: `stop`): its slot, pages and
        host copy are free for the next plan. False if no such request is unfinished here. Not
        while a step's tokens are uncommitted."""
        if self.results.uncommitted is not None:
            raise RuntimeError("abort with a step's tokens uncommitted; commit first (this is a bug)")
        req = next((r for r in self.running_set.running if r.request_id == request_id), None)
        if req is not None:
            self.running_set.evict(req)
        else:
            req = next((r for r in self.policy if r.request_id == request_id), None)
            if req is None:
                return False
            self.waiting.remove(req)
        if self.prefix is not None:
            self.prefix.forget(req)
        self.policy.forget(req)
        req.num_new_tokens = 0
        req.status = Status.FINISHED
        req.finish_reason = finish_reason
        if finish_reason is FinishReason.ABORTED:
            req.error = reason
        req.finish_s = now
        self.finished.append(req)
        return True

    def requests_of(self, plan: Schedule) -> list[Request]:
        """The plan's scheduled requests, in plan order (until its results are recorded)."""
        return self.writer.requests(plan)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.policy) > 0

    # ---- one iteration ----
    def schedule(self, now: float) -> Schedule:
        """The next iteration's plan: a decode stretch's next (`DecodeStretch`), or planned
        (`Planner.plan`); either way the same plan."""
        if self.stretch is not None:
            plan = self.stretch.next_plan(now)
            if plan is not None:
                self.planner.continued()
                return plan
        return self.planner.plan(now)

    def stretch_steps(self, now: float) -> tuple[Optional[Schedule], int]:
        """The next decode stretch: (a one-step plan of its first step, not written, and how many
        steps it holds), or (None, 0) (`DecodeStretch.steps`)."""
        if self.stretch is None:
            return None, 0
        return self.stretch.steps(now)

    def schedule_stretch(self, now: float, num_steps: int) -> Schedule:
        """The next `num_steps` steps of the decode stretch as one plan (`Schedule.num_steps`)."""
        plan = self.stretch.write(now, num_steps)
        self.planner.continued()
        return plan

    def cache_stats(self) -> dict:
        """Prefix-cache and swap counters for summary.json (hit rate: `PrefixCache.hit_rate`),
        and with a host tier its own (`HostTier.stats`)."""
        prefix = self.prefix
        stats = {
            "prefix_cache_hit_rate": prefix.hit_rate if prefix else 0.0,
            "prefix_cache_hit_tokens": prefix.tokens_hit if prefix else 0,
            "prefix_cache_evictions": self.allocator.num_evictions,
            "swap_preemptions": self.planner.num_swap_preemptions,
            "swapped_out_pages": self.planner.num_swapped_out_pages,
        }
        if self.tier is not None:
            stats.update(self.tier.stats(prefix.prompt_tokens_admitted))
        return stats

    def loaded(self, plan: Schedule, load_s: float, prefetch_s: float) -> None:
        """The seconds `plan`'s host-tier loads and prefetches took: each request's share goes
        to its `kv_load_s` (`HostTier.charge`)."""
        if self.tier is not None:
            self.tier.charge(plan.step_id, load_s, prefetch_s)

    def held_pages(self, request_id: str) -> list[int]:
        """The pages a finished request holds (`hold_finished_pages`), in token order."""
        return self.running_set.held_pages(request_id)

    def release_held(self, request_id: str) -> None:
        """Free a finished request's held pages (no-op if it holds none)."""
        self.running_set.release_held(request_id)

    def abort_all(
        self, now: float, finish_reason: FinishReason = FinishReason.ABORTED, error: Optional[str] = None
    ) -> None:
        """End every unfinished request with reason `aborted` (e.g. a run cut short), or
        `finish_reason` with `error` as each one's error (its executor was lost)."""
        leftovers = self.running_set.evict_all() + self.waiting.clear()
        if self.prefix is not None:
            self.prefix.clear()
        for req in leftovers:
            req.status = Status.FINISHED
            req.finish_reason = finish_reason
            req.finish_s = now
            if error is not None:
                req.error = error
            self.finished.append(req)

    # ---- a step's results (`StepResults`) ----
    def postprocess(
        self, plan: Schedule, token_ids: Optional[Sequence[int]], now: float, errors: Optional[dict[int, str]] = None,
        ends: Optional[Sequence[float]] = None, num_accepted: Optional[Sequence[int]] = None,
        accepted_ids: Optional[Sequence[Sequence[int]]] = None,
    ) -> list[Request]:
        """Record one new token per scheduled request; retire the finished. Returns them.

        `token_ids` follows `plan.scheduled` order; None means simulated tokens. `errors` maps
        an index into `plan.scheduled` to why its step failed: that request ends with reason
        `error` (its token and this step's K/V are dropped) and the others go on. A decode
        stretch (`plan.num_steps` > 1) gives each request a token per step, at `ends`. A row
        that verified drafts yields its `num_accepted` ones (`accepted_ids`, where the executor
        reads ids) before its token (`Drafts.settle`)."""
        results = self.results
        if self.drafts is not None:
            token_ids = self.drafts.settle(
                plan, self.writer.requests(plan), token_ids, num_accepted, accepted_ids, errors
            )
        if plan.num_steps > 1:
            done = results.simulated_stretch(plan, ends)
        elif errors or token_ids is not None:  # the two halves of `StepResults`, back to back
            results.advance(plan, now, errors, notify=False)
            requests = self.writer.requests(plan)
            done = results.commit(plan, token_ids, now, errors)
            self.policy.on_step(requests, now)
        else:
            done = results.simulated_step(plan, now)
        if done:
            self.finished.extend(done)
        return done

    def needs_sync(self) -> bool:
        """Whether the next `schedule` may preempt (`StepResults.needs_sync`)."""
        return self.results.needs_sync()

    def advance(
        self, plan: Schedule, now: float, errors: Optional[dict[int, str]] = None, *, notify: bool = True
    ) -> None:
        """The token-free half of `postprocess` at a step's launch (`StepResults.advance`)."""
        if self.drafts is not None:
            raise RuntimeError("advance: a speculating scheduler runs each step to completion (postprocess)")
        self.results.advance(plan, now, errors, notify=notify)

    def commit(
        self, plan: Schedule, token_ids: Optional[Sequence[int]], now: float, errors: Optional[dict[int, str]] = None
    ) -> list[Request]:
        """The token half of `postprocess` once the tokens arrive (`StepResults.commit`)."""
        done = self.results.commit(plan, token_ids, now, errors)
        if done:
            self.finished.extend(done)
        return done

