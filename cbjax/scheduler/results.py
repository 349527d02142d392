"""What a step's results do to the scheduler's requests (no jax): `advance` at the step's
launch and `commit` when its tokens arrive, or both fused into `simulated_step` for a step
with simulated tokens and no errors. `Scheduler` (`cbjax.scheduler.core`) holds one `StepResults` and
hands it each step's plan; what it reads and updates is given to its constructor."""

from __future__ import annotations

from typing import Optional, Sequence

from cbjax.core.plan import Schedule
from cbjax.core.request import FinishReason, Request, Status
from cbjax.scheduler.output import PlanWriter
from cbjax.scheduler.policy import Policy, PolicyContract
from cbjax.scheduler.running import RunningSet


# Marks a request whose step failed, in `advance`'s list for `commit`.
_FAILED = object()


class StepResults:
    """Postprocessing of a step's results: tokens to requests, retiring the finished.

    It advances the requests of `running_set` (finishing them there), reads the plan's requests
    from `writer`, registers computed pages in `prefix`, tells `policy` of each step, and ends a
    request at its length (`max_model_len` included) or on `eos_token_id`. `needs_sync` reads
    the pages a next plan may take from `allocator` under `token_budget`. Every gap between a
    request's consecutive tokens is kept in `tbt_s`. The methods that end requests return
    them; the caller keeps the record of finished requests.
    """

    def __init__(
        self,
        running_set: RunningSet,
        writer: PlanWriter,
        policy: PolicyContract,
        allocator,
        prefix,
        *,
        token_budget: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
    ):
        self.running_set = running_set
        self.writer = writer
        self.policy = policy
        self.allocator = allocator
        self.prefix = prefix  # a PrefixCache, or None
        self.token_budget = token_budget
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids  # the model's stop tokens (`Scheduler`)
        self.tbt_s: list[float] = []  # every gap between a request's consecutive tokens
        # the policy has an `on_step` of its own (the base one does nothing)
        self._step_hook = not (isinstance(policy, Policy) and type(policy).on_step is Policy.on_step)
        # pipelined serving: (plan, its requests that yield a token) between advance and commit
        self.uncommitted: Optional[tuple[Schedule, list]] = None

    def simulated_step(self, plan: Schedule, now: float) -> list[Request]:
        """`advance` then `commit` of a step with simulated tokens and no errors, fused into
        one pass over its requests: retires the finished and returns them. Only lengths end
        requests then, all in `advance`, so the frees and slot returns happen in the same
        order, and each request's commit touches only itself."""
        if self.uncommitted is not None:
            raise RuntimeError("advance: the previous step is not committed yet; this is a bug")
        writer = self.writer
        requests = writer.requests(plan)
        writer.done(plan)
        return self._simulated_tokens(requests, now)

    def simulated_stretch(self, plan: Schedule, ends: Sequence[float]) -> list[Request]:
        """A decode stretch's steps (`plan.num_steps`, ending at `ends`), as `simulated_step`
        would have recorded them one by one: each request yields a token per step. Before the
        last step no request reaches its length, and a page that fills registers nowhere (no
        request of a stretch learns a filled page's token ids: `cbjax.scheduler.stretch`), so
        those steps only count tokens and gaps; the last is an ordinary step."""
        if self.uncommitted is not None:
            raise RuntimeError("advance: the previous step is not committed yet; this is a bug")
        writer = self.writer
        requests = writer.requests(plan)
        writer.done(plan)
        tbt = self.tbt_s
        if self._step_hook:  # the policy reads each step's requests: step by step
            on_step = self.policy.on_step
            for end in ends[:-1]:
                for req in requests:
                    req.num_computed += 1
                    req.num_generated += 1
                    tbt.append(end - req.last_token_s)
                    req.last_token_s = end
                on_step(requests, end)
            return self._simulated_tokens(requests, ends[-1])
        # the same gaps in the same order: after the first step's, every request's gap in a
        # step is that step's length
        inner = len(ends) - 1
        if inner:
            prev = ends[0]
            tbt.extend([prev - req.last_token_s for req in requests])
            rows = len(requests)
            if rows == 1:  # one gap a step: the steps' lengths
                tbt.extend([end - start for start, end in zip(ends, ends[1:-1])])
                prev = ends[-2]
            else:
                for end in ends[1:-1]:
                    tbt.extend([end - prev] * rows)
                    prev = end
            for req in requests:
                req.num_computed += inner
                req.num_generated += inner
                req.last_token_s = prev
        return self._simulated_tokens(requests, ends[-1])

    def _simulated_tokens(self, requests: list[Request], now: float) -> list[Request]:
        """One step's simulated tokens for `requests` (`simulated_step`'s pass). Every request
        of a fused step runs: nothing ends one between its plan and its results."""
        done: list[Request] = []
        gap = self.tbt_s.append
        register = self.prefix.register if self.prefix is not None else None
        for req in requests:
            # self._computed(req), inlined
            computed = req.num_computed = req.num_computed + req.num_new_tokens
            req.num_new_tokens = 0
            if register is not None:
                register(req)
            generated = req.num_generated
            if computed < req.prompt_len + generated:  # req.num_tokens
                continue
            generated = req.num_generated = generated + 1
            if req.first_token_s is None:
                req.first_token_s = now
            else:
                gap(now - req.last_token_s)
            req.last_token_s = now
            if generated < req.max_output_len:  # _length_reason's first test, inlined
                continue
            reason = self._length_reason(req)
            if reason is None:
                continue
            self.running_set.finish(req, reason, now)
            done.append(req)
        if done:
            self.running_set.prune()
        self.policy.on_step(requests, now)
        return done

    # ---- a step's results in two halves ----
    # The engine launches step t+1 before it reads step t's tokens (executor.async_scheduling).
    # `advance(plan)` runs when the step is launched and does what needs no token: counts, the
    # prefix index, and retiring requests that reach their length (their slots and pages free
    # for the next plan). `commit(plan, token_ids)` runs when the tokens arrive: it appends
    # them, stamps the times and ends requests that stopped on a token. Such a request is in
    # the step launched meanwhile: its row there is wasted and `advance` skips it. A plan that
    # may preempt waits for the commit first (`needs_sync`), so every preempted or swapped
    # request has all its tokens on the host.

    def needs_sync(self) -> bool:
        """Whether the next `schedule` may preempt, so the step in flight must be committed
        before it: the running requests' next tokens could need more pages than are free, or
        the policy may evict a running request for a waiting one."""
        if self.policy.may_preempt_for and len(self.policy):
            return True
        alloc = self.allocator
        need = 0
        for req in self.running_set.running:
            n = min(req.num_tokens - req.num_computed, self.token_budget)
            need += alloc.pages_to_append(req.request_id, req.num_computed + n)
        return need > alloc.num_free_pages

    def advance(
        self, plan: Schedule, now: float, errors: Optional[dict[int, str]] = None, *, notify: bool = True
    ) -> None:
        """The token-free half of a step's results, at its launch (see above). `errors` known
        already (a step run to completion) end those requests at commit with this step's work
        dropped. `notify`: tell the policy now (`Scheduler.postprocess` tells it after the commit)."""
        if self.uncommitted is not None:
            raise RuntimeError("advance: the previous step is not committed yet; this is a bug")
        yielded = []
        requests = self.writer.requests(plan)
        running = Status.RUNNING
        retired = False
        for i, req in enumerate(requests):
            if req.status is not running:  # stopped on a token since this plan was made
                req.num_new_tokens = 0
                continue
            if errors and i in errors:  # nothing of its step counts
                req.num_new_tokens = 0
                yielded.append((i, req, _FAILED))
                continue
            if not self._computed(req):
                continue
            # _length_reason's first test inlined: most steps end no request
            reason = self._length_reason(req) if req.num_generated >= req.max_output_len else None
            if reason is not None:  # ends here; its reason and time are recorded at commit
                self.running_set.finish(req, None, None)
                retired = True
            yielded.append((i, req, reason))
        if retired:
            self.running_set.prune()
        self.uncommitted = (plan, yielded)
        if notify:
            self.policy.on_step(requests, now)

    def commit(
        self,
        plan: Schedule,
        token_ids: Optional[Sequence[int]],
        now: float,
        errors: Optional[dict[int, str]] = None,
    ) -> list[Request]:
        """The token half of a step's results, for the step `advance` saw last: record each token
        (an errored row's is dropped), retire the finished. Returns them."""
        if self.uncommitted is None or self.uncommitted[0] is not plan:
            raise RuntimeError("commit: the plan is not the one advanced last; this is a bug")
        _, yielded = self.uncommitted
        self.uncommitted = None
        self.writer.done(plan)
        done: list[Request] = []
        tbt_s = self.tbt_s
        for i, req, reason in yielded:
            if reason is _FAILED:  # known at advance: its step was not counted
                req.error = errors[i]
                reason = FinishReason.ERROR
            elif errors and i in errors:  # found at commit: take back the token advance counted
                req.num_generated -= 1
                req.error = errors[i]
                reason = FinishReason.ERROR
            else:  # a token of `req` came at `now`
                if req.first_token_s is None:
                    req.first_token_s = now
                else:
                    tbt_s.append(now - req.last_token_s)
                req.last_token_s = now
                if token_ids is not None:
                    reason = self._take_token(req, int(token_ids[i])) or reason
            if reason is None:
                continue
            if req.status is Status.RUNNING:
                self.running_set.finish(req, reason, now)
            else:  # retired at advance
                req.finish_reason = reason
                req.finish_s = now
            done.append(req)
        if done:
            self.running_set.prune()
        return done

    def _computed(self, req: Request) -> bool:
        """Count the request's step as computed (and its full pages in the prefix index);
        whether it yields a token, which it then counts: a partial prefill yields none."""
        req.num_computed += req.num_new_tokens
        req.num_new_tokens = 0
        if self.prefix is not None:
            self.prefix.register(req)
        if req.num_computed < req.num_tokens:
            return False
        req.num_generated += 1
        return True

    def _take_token(self, req: Request, tok: int) -> Optional[FinishReason]:
        """Append a generated token; the reason it ends the request, if it does."""
        req.output_token_ids.append(tok)
        if tok in req.sampling.stop_token_ids:
            return FinishReason.STOP
        if tok in self.eos_token_ids and not req.sampling.ignore_eos:
            return FinishReason.EOS
        return None

    def _length_reason(self, req: Request) -> Optional[FinishReason]:
        """Why the request ends at its current length, if it does (no token needed)."""
        if req.num_generated < req.max_output_len:
            return None
        hit_target = req.target_output_len is not None and req.num_generated >= req.target_output_len
        if hit_target and req.num_generated < req.sampling.max_tokens and req.num_tokens < self.max_model_len:
            return FinishReason.EOS
        if req.num_generated < req.stop_length():
            return FinishReason.MAX_MODEL_LEN  # the context is full before its own limit
        return FinishReason.LENGTH
