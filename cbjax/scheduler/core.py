"""The host-side iteration-level scheduler: waiting queue, running set, fixed slot array (no jax)."""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Callable, Optional, Sequence

from cbjax.cache import make_allocator
from cbjax.cache.prefix import PrefixCache
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.core.plan import Schedule
from cbjax.core.request import FinishReason, Request, Status
from cbjax.scheduler.intake import rejection_reason
from cbjax.scheduler.policy import PolicyContract, make_policy
from cbjax.scheduler.output import Draft, PlanWriter
from cbjax.scheduler.results import StepResults


class _View:
    """The scheduler as policies see it: `cbjax.scheduler.policy.SchedulerView`. Read-only."""

    __slots__ = ("_s",)

    def __init__(self, scheduler: "Scheduler"):
        self._s = scheduler

    @property
    def running(self) -> Sequence[Request]:
        return tuple(self._s.running)

    @property
    def num_waiting(self) -> int:
        return len(self._s.policy)

    @property
    def num_free_slots(self) -> int:
        return len(self._s._free_slots)

    @property
    def num_free_pages(self) -> int:
        return self._s.allocator.num_free_pages

    def pages_held(self, request_id: str) -> int:
        return len(self._s.allocator.page_tables.get(request_id, ()))

    def admission_pages(self, req: Request) -> int:
        """Pages `req` needs to be admitted with its current tokens."""
        s = self._s
        return s.allocator.admission_pages(req.num_tokens, s.reserve_tokens(req))


class Scheduler(StepResults):
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
        # reservations only: pages each waiting request would reserve -> how many wait, so the
        # smallest (for external fragmentation) costs no scan of the queue
        self._waiting_pages: Counter[int] = Counter()
        self.prefix = PrefixCache(self.allocator) if cache.prefix_caching else None
        self.swap = cfg.preemption == "swap"
        self.swap_capacity = cache.swap_capacity
        self.swap_used = 0
        self._swapped: dict[Request, int] = {}  # waiting request -> its pages held in host memory
        self.validate = validate
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size  # model.vocab_size: prompt ids must be below it
        self.running: list[Request] = []
        # request id -> final_tokens(req), for every request in a slot: what kv_breakdown pairs
        # with the page tables, kept from admission to release (both are fixed while it runs)
        self._final_tokens: dict[str, int] = {}
        self.slots: list[Optional[Request]] = [None] * cfg.max_num_seqs
        self._free_slots = list(range(cfg.max_num_seqs))  # a min-heap
        self.finished: list[Request] = []
        self.tbt_s: list[float] = []  # every gap between a request's consecutive tokens
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_swapped_out_pages = 0
        self._admit_counter = 0
        self._prefilled_last = False  # scheduler.alternate_phases: the last plan had prefill work
        # scheduler.static_padding: the current batch's rows, padded prompt length, decode steps
        self._pad_rows = 0
        self._pad_len = 0
        self._pad_step = 0
        # pipelined serving: (plan, its requests that yield a token) between advance and commit
        self._uncommitted: Optional[tuple[Schedule, list]] = None
        self.view = _View(self)
        self.writer = PlanWriter(cfg.max_num_seqs, self.allocator)
        # A prefill replica of an engine cluster keeps a finished request's pages until its K/V
        # is copied out (`held_pages`, `release_held`): a later plan would overwrite them.
        self.hold_finished_pages = False
        self._held: set[str] = set()

    # ---- intake ----
    def rejection_reason(self, req: Request) -> Optional[str]:
        """Why the request can never run here, or None (`cbjax.scheduler.intake`)."""
        return rejection_reason(self, req)

    def max_len_tokens(self, req: Request) -> int:
        """Tokens stored at the request's maximum length: what `reserve_max` reserves."""
        return min(req.prompt_len + req.sampling.max_tokens, self.max_model_len) - 1

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
        return self.max_len_tokens(req)

    def final_tokens(self, req: Request) -> int:
        """Tokens the request will store at its final length (its stopping length as known)."""
        return req.prompt_len + req.max_output_len - 1

    def kv_breakdown(self) -> tuple[int, int, int, int, int]:
        """The pool's slots split five ways (see `PageAllocator.slot_breakdown`); external
        fragmentation is judged against the smallest reservation among waiting requests."""
        return self.allocator.slot_breakdown(
            self._final_tokens.items(), min(self._waiting_pages) if self._waiting_pages else 0
        )

    def _track_waiting(self, req: Request, delta: int) -> None:
        if self.allocator.reserve:
            pages = self.allocator.pages_for(self.reserve_tokens(req))
            self._waiting_pages[pages] += delta
            if not self._waiting_pages[pages]:
                del self._waiting_pages[pages]

    def add(self, req: Request, now: float) -> None:
        """Accept a newly arrived request, or reject it with a reason."""
        self._enqueue(req, now, 0)

    def _enqueue(self, req: Request, now: float, host_pages: int) -> None:
        """Queue an arrived request, holding `host_pages` pages of K/V in host memory (a
        transferred request), or reject it with a reason."""
        req.max_output_len = max(0, min(req.stop_length(), self.max_model_len - req.prompt_len))
        reason = self.rejection_reason(req)
        if reason is not None:
            self.reject(req, reason, now)
            return
        req.status = Status.WAITING
        if host_pages:
            self._swapped[req] = host_pages
            self.swap_used += host_pages
        self._track_waiting(req, 1)
        self.policy.push(req)

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
        req.status = Status.FINISHED
        req.finish_reason = FinishReason.REJECTED
        req.reject_reason = reason
        req.finish_s = now
        self.finished.append(req)

    def not_arrived(self, req: Request) -> None:
        """End a request whose arrival time the run never reached (it was stopped first):
        fate `not_arrived`, no finish time."""
        req.status = Status.FINISHED
        req.finish_reason = FinishReason.NOT_ARRIVED
        req.finish_s = None
        self.finished.append(req)

    def abort(
        self, request_id: str, now: float, reason: str = "aborted", finish_reason: FinishReason = FinishReason.ABORTED
    ) -> bool:
        """End one waiting or running request (e.g. its client left: `aborted`, with `reason` as
        its error; or a stop string the server found in its text: `stop`): its slot, pages and
        host copy are free for the next plan. False if no such request is unfinished here. Not
        while a step's tokens are uncommitted."""
        if self._uncommitted is not None:
            raise RuntimeError("abort with a step's tokens uncommitted; commit first (this is a bug)")
        req = next((r for r in self.running if r.request_id == request_id), None)
        if req is not None:
            self._release(req)
            if self.prefix is not None:
                self.prefix.forget(req)
            self.running.remove(req)
        else:
            req = next((r for r in self.policy if r.request_id == request_id), None)
            if req is None:
                return False
            self.policy.remove(req)
            self._track_waiting(req, -1)
            swapped = self._swapped.pop(req, 0)
            self.swap_used -= swapped
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

    @property
    def plan_token_ids(self) -> bool:
        """Whether plans carry token ids (`PlanWriter.token_ids`; EngineLoop sets it)."""
        return self.writer.token_ids

    @plan_token_ids.setter
    def plan_token_ids(self, value: bool) -> None:
        self.writer.token_ids = value

    def has_work(self) -> bool:
        return bool(self.running) or len(self.policy) > 0

    # ---- one iteration ----
    def schedule(self, now: float) -> Schedule:
        plan = Draft()
        budget = self.token_budget
        # Running requests first: decodes (one token left to process), then unfinished
        # prefills, then new prefills: Sarathi-Serve's stall-free order. A request processes
        # tokens[num_computed : num_computed + num_new_tokens]. Without hybrid batching an
        # iteration with prefill work runs only that, and decodes wait for one without (or,
        # with alternate_phases, run in every other iteration while prefill work waits).
        hybrid = self.cfg.hybrid_batching
        if hybrid or (self.cfg.alternate_phases and self._prefilled_last):
            budget = self._plan_running(plan, True, budget)
        if hybrid or not plan.decodes:
            if len(plan.decodes) != len(self.running):  # else every running request decodes here
                budget = self._plan_running(plan, False, budget)
            new_batch = not self.running
            budget = self._admit_waiting(plan, budget, now)
        else:
            new_batch = False
        if not hybrid and not plan.prefills and not plan.decodes:
            self._plan_running(plan, True, budget)
        self._prefilled_last = bool(plan.prefills)
        if self.cfg.static_padding:
            self._pad(plan, new_batch)
        return self.writer.write(plan, now)

    def _plan_running(self, plan: Draft, decoding: bool, budget: int) -> int:
        """Plan the running requests' decodes (`decoding`) or unfinished prefills, preempting
        when pages run out. Returns the budget left."""
        if not decoding and len(plan.decodes) == len(self.running):
            return budget  # every running request decodes in this plan: no prefill is left
        alloc = self.allocator
        running = Status.RUNNING
        planned = plan.decodes if decoding else plan.prefills
        for req in list(self.running):
            if req.status is not running or req.num_new_tokens:
                continue  # preempted earlier in this loop, or already planned
            remaining = req.prompt_len + req.num_generated - req.num_computed  # num_tokens - num_computed
            if (remaining == 1) != decoding:
                continue
            n = remaining if remaining < budget else budget
            if n == 0:
                continue
            if not alloc.try_append(req.request_id, req.num_computed + n):
                while not alloc.can_append(req.request_id, req.num_computed + n):
                    victim = self.policy.choose_victim(self.running)
                    budget += self._preempt(victim, plan)
                    if victim is req:
                        break
                if req.status is not running:
                    continue
                alloc.append(req.request_id, req.num_computed + n)
            req.num_new_tokens = n
            budget -= n
            planned.append(req)
        return budget

    def _admit_waiting(self, plan: Draft, budget: int, now: float) -> int:
        """Admit waiting requests as the policy, slots, budget and pages allow; their prefills
        join the plan. Returns the budget left."""
        alloc = self.allocator
        if not self.policy.admission_open(self.view):
            return budget
        # Nothing preempted this iteration is readmitted in it.
        while len(self.policy) and budget > 0:
            req = self.policy.peek()
            if req in plan.preempted:
                break
            swapped = self._swapped.get(req, 0)
            cached = [] if swapped or self.prefix is None else self.prefix.match(req)
            done = req.num_computed if swapped else len(cached) * alloc.page_size
            n = req.num_tokens - done
            if n > budget:
                # Chunked prefill (Sarathi-Serve) fills the budget's remainder with the
                # head's first chunk. Without it, only a recomputed request can outgrow the
                # whole budget (longer prompts are rejected): it is chunked the same way.
                if n <= self.token_budget and not self.cfg.chunked_prefill:
                    break
                n = budget
            if not self._free_slots or not alloc.can_allocate(done + n, self.reserve_tokens(req), cached):
                # The policy may evict a running request the head outranks (priority, mlfq).
                victim = self.policy.preempt_for(req, self.view)
                if victim is None:
                    break
                budget += self._preempt(victim, plan)
                continue
            self.policy.pop()
            self._track_waiting(req, -1)
            table = alloc.allocate(req.request_id, done + n, self.reserve_tokens(req), cached)
            budget -= n
            if swapped:
                del self._swapped[req]
                self.swap_used -= swapped
                plan.swap_in.append((req, table[:swapped]))
            else:
                if self.prefix is not None:
                    self.prefix.admitted(req, done)
                req.num_computed = done
            self._admit(req, now)
            req.num_new_tokens = n
            plan.prefills.append(req)
        return budget

    def _pad(self, plan: Draft, new_batch: bool) -> None:
        """`scheduler.static_padding`: charge the plan as a padded `generate` batch runs. The
        iteration that forms a batch prefills every row padded to the batch's longest prompt;
        each later one decodes every row of the batch, finished rows included, at the padded
        length, until the last row finishes (the next batch then forms)."""
        if new_batch and plan.prefills:
            self._pad_rows = len(plan.prefills)
            self._pad_len = max(r.num_tokens for r in plan.prefills)
            self._pad_step = 0
            plan.padded_rows = [(self._pad_len, 0, False)] * self._pad_rows
            return
        self._pad_step += 1
        plan.padded_rows = [(1, self._pad_len + self._pad_step - 1, True)] * self._pad_rows

    def cache_stats(self) -> dict:
        """Prefix-cache and swap counters for summary.json (hit rate: `PrefixCache.hit_rate`)."""
        prefix = self.prefix
        return {
            "prefix_cache_hit_rate": prefix.hit_rate if prefix else 0.0,
            "prefix_cache_hit_tokens": prefix.tokens_hit if prefix else 0,
            "prefix_cache_evictions": self.allocator.num_evictions,
            "swap_preemptions": self.num_swap_preemptions,
            "swapped_out_pages": self.num_swapped_out_pages,
        }

    def _admit(self, req: Request, now: float) -> None:
        req.status = Status.RUNNING
        req.slot = heapq.heappop(self._free_slots)
        self.slots[req.slot] = req
        self._admit_counter += 1
        req.admit_seq = self._admit_counter
        self.writer.admitted(req.request_id)
        self._final_tokens[req.request_id] = req.prompt_len + req.max_output_len - 1  # final_tokens(req)
        if req.scheduled_s is None:
            req.scheduled_s = now
        self.running.append(req)

    def _release(self, req: Request, keep_pages: bool = False) -> None:
        if not keep_pages:
            self.allocator.free(req.request_id)
        self.writer.released(req.request_id)
        del self._final_tokens[req.request_id]
        self.slots[req.slot] = None
        heapq.heappush(self._free_slots, req.slot)
        req.slot = -1

    def _preempt(self, req: Request, plan: Draft) -> int:
        """Preempt by swap (its computed pages to host memory, `num_computed` kept) or by
        recompute (its K/V dropped), and requeue it with its tokens so far.

        Returns the budget tokens it gives back if it was already planned this iteration.
        """
        if self._uncommitted is not None:
            raise RuntimeError("preemption with a step's tokens uncommitted (see needs_sync); this is a bug")
        planned = req.num_new_tokens
        if planned:
            (plan.decodes if req in plan.decodes else plan.prefills).remove(req)
            req.num_new_tokens = 0
        pages = self.allocator.pages_for(req.num_computed)
        swap_in = next((entry for entry in plan.swap_in if entry[0] is req), None)
        if swap_in is not None:
            plan.swap_in.remove(swap_in)  # swapped in by this plan: its host copy is still there
        elif self.swap and 0 < pages <= self.swap_capacity - self.swap_used:
            plan.swap_out.append((req, self.allocator.page_tables[req.request_id][:pages]))
            self.num_swap_preemptions += 1
            self.num_swapped_out_pages += pages
        else:
            pages = 0
        self._release(req)
        self.running.remove(req)
        req.status = Status.WAITING
        if pages:
            self._swapped[req] = pages
            self.swap_used += pages
        else:
            req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.append(req)
        self._track_waiting(req, 1)
        self.policy.requeue(req)
        return planned

    def _finish(self, req: Request, reason: Optional[FinishReason], now: Optional[float]) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_s = now
        if self.hold_finished_pages:
            self._held.add(req.request_id)
        self._release(req, keep_pages=self.hold_finished_pages)
        if self.prefix is not None:
            self.prefix.forget(req)

    def held_pages(self, request_id: str) -> list[int]:
        """The pages a finished request holds (`hold_finished_pages`), in token order."""
        if request_id not in self._held:
            raise KeyError(f"request {request_id}: holds no pages (finished without hold_finished_pages?)")
        return list(self.allocator.page_tables[request_id])

    def release_held(self, request_id: str) -> None:
        """Free a finished request's held pages (no-op if it holds none)."""
        if request_id in self._held:
            self._held.discard(request_id)
            self.allocator.free(request_id)

    def abort_all(
        self, now: float, finish_reason: FinishReason = FinishReason.ABORTED, error: Optional[str] = None
    ) -> None:
        """End every unfinished request with reason `aborted` (e.g. a run cut short), or
        `finish_reason` with `error` as each one's error (its executor was lost)."""
        for req in list(self.running):
            self._release(req)
        leftovers = self.running + list(self.policy)
        self.running = []
        self._swapped.clear()
        self._waiting_pages.clear()
        self.swap_used = 0
        if self.prefix is not None:
            self.prefix.clear()
        while len(self.policy):
            self.policy.pop()
        for req in leftovers:
            req.status = Status.FINISHED
            req.finish_reason = finish_reason
            req.finish_s = now
            if error is not None:
                req.error = error
            self.finished.append(req)
