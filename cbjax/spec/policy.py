"""Speculation-length policies: how many drafts each decode verifies in a step (no jax).

The scheduler asks its policy once per plan that holds decodes (`SpecPolicy.num_drafts`), with a
read-only `SpecView` of that step, then caps each decode's drafts by the token budget, its free
pages, its remaining length and, for n-gram drafts, what the lookup found. After each step it
reports every verification (`on_verified`). A plug-in subclasses `SpecPolicy` and is named
`spec.policy=package.module:Class`, built with `spec.policy_args` as keyword arguments after the
spec config, as `scheduler.policy_class` is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

from cbjax.config.spec import batch_table, default_batch_table
from cbjax.core.plugins import build_plugin, load_class
from cbjax.core.request import Request

if TYPE_CHECKING:
    from cbjax.config.spec import SpecConfig


class SpecView:
    """What a speculation policy may read of one step being planned: never the scheduler.

    `decodes`: the requests decoding in this plan, in plan order (read their `spec_proposed` and
    `spec_accepted`, never change them). `acceptance_rate`: drafts accepted over drafts tried so
    far in the run, a draft counting as tried when it was accepted or was the first rejected one
    of its verification (the estimate of an independent per-draft acceptance); None before any.
    `step_s(k)`: the cost model's seconds for a step of these decodes verifying k drafts each (as
    far as each one's length allows), or None when the run has no cost model."""

    __slots__ = ("decodes", "num_running", "num_waiting", "max_drafts", "acceptance_rate", "_step_s")

    def __init__(
        self,
        decodes: Sequence[Request],
        num_running: int,
        num_waiting: int,
        max_drafts: int,
        acceptance_rate: Optional[float],
        step_s: Optional[Callable[[int], float]],
    ):
        self.decodes, self.num_running, self.num_waiting = decodes, num_running, num_waiting
        self.max_drafts, self.acceptance_rate, self._step_s = max_drafts, acceptance_rate, step_s

    @property
    def num_decodes(self) -> int:
        return len(self.decodes)

    def step_s(self, k: int) -> Optional[float]:
        return self._step_s(k) if self._step_s is not None else None


class SpecPolicy:
    """Base speculation policy: `num_drafts` per step; `on_verified` after each verification."""

    name = "base"

    def __init__(self, spec: "SpecConfig"):
        self.spec = spec

    def num_drafts(self, view: SpecView) -> int:
        """Drafts per decode this step, 0 .. view.max_drafts (the scheduler caps it per request)."""
        raise NotImplementedError

    def on_verified(self, req: Request, proposed: int, accepted: int) -> None:
        """Request `req` verified `proposed` drafts and `accepted` of them (in order) in a step."""


class FixedPolicy(SpecPolicy):
    """Always `spec.num_tokens` drafts."""

    name = "fixed"

    def num_drafts(self, view: SpecView) -> int:
        return view.max_drafts


class BatchSizePolicy(SpecPolicy):
    """Drafts by the step's number of decodes, from a table such as {"1-16": 3, "17-64": 1,
    "65-4096": 0} (vLLM's dynamic speculation); a size no range covers gets none."""

    name = "batch_size"

    def __init__(self, spec: "SpecConfig", table: Optional[dict] = None):
        super().__init__(spec)
        table = default_batch_table(spec.num_tokens) if table is None else table
        self.table = batch_table(table, spec.num_tokens, "spec.policy_args.table")

    def num_drafts(self, view: SpecView) -> int:
        n = view.num_decodes
        for lo, hi, k in self.table:
            if lo <= n <= hi:
                return k
        return 0


def draft_room(req: Request) -> int:
    """The most drafts `req` may verify in its next decode: its remaining length less its own
    token (the scheduler's length cap, and the one `SpecView.step_s` prices)."""
    return max(0, req.max_output_len - req.num_generated - 1)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verification of k drafts yields on average when each is accepted independently
    with probability `rate`: the accepted drafts plus the target's own token, (1 - r^(k+1)) / (1 - r)."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


class GoodputPolicy(SpecPolicy):
    """SmartSpec's choice: each step, the k (0 .. spec.num_tokens) that maximises the expected
    tokens per second, sum over decodes of `expected_tokens(rate, min(k, draft_room(decode)))`
    over `view.step_s(k)` (both count the drafts each decode's length lets it verify); the
    smallest such k on a tie. The acceptance rate is estimated from what was seen so far (see
    `SpecView.acceptance_rate`), starting from `prior` as `prior_weight` tries would; with
    `per_request`, each request's own verifications weigh in its estimate, the run's rate as
    its prior."""

    name = "goodput"

    def __init__(self, spec: "SpecConfig", prior: float = 0.7, prior_weight: float = 10.0, per_request: bool = False):
        super().__init__(spec)
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"spec.policy_args.prior must be in [0, 1], got {prior!r}")
        if not prior_weight >= 0:
            raise ValueError(f"spec.policy_args.prior_weight must be >= 0, got {prior_weight!r}")
        self.prior, self.prior_weight, self.per_request = prior, prior_weight, per_request
        self._accepted = 0
        self._tried = 0
        self._own: dict[str, tuple[int, int]] = {}  # per_request: request id -> (accepted, tried)

    def rate(self) -> float:
        """The run's acceptance-rate estimate."""
        w = self.prior_weight
        return (self._accepted + w * self.prior) / (self._tried + w) if self._tried + w else self.prior

    def on_verified(self, req: Request, proposed: int, accepted: int) -> None:
        tried = accepted + (accepted < proposed)
        self._accepted += accepted
        self._tried += tried
        if self.per_request:
            a, t = self._own.get(req.request_id, (0, 0))
            self._own[req.request_id] = (a + accepted, t + tried)

    def num_drafts(self, view: SpecView) -> int:
        if not view.decodes:
            return 0
        rate = self.rate()
        if self.per_request:
            w = self.prior_weight
            own = self._own
            rates = []
            for req in view.decodes:
                a, t = own.get(req.request_id, (0, 0))
                rates.append((a + w * rate) / (t + w) if t + w else rate)
        else:
            rates = [rate] * len(view.decodes)
        rooms = [draft_room(req) for req in view.decodes]
        best_k, best = 0, -1.0
        for k in range(view.max_drafts + 1):
            seconds = view.step_s(k)
            if seconds is None:
                raise ValueError("spec.policy=goodput needs a cost model to price each k (executor.cost_model)")
            tokens = sum(expected_tokens(r, min(k, room)) for r, room in zip(rates, rooms))
            goodput = tokens / seconds if seconds > 0 else float("inf")
            if goodput > best:
                best_k, best = k, goodput
        return best_k


# spec.policy names -> built-in policies
SPEC_POLICY_CLASSES: dict[str, type[SpecPolicy]] = {
    cls.name: cls for cls in (FixedPolicy, BatchSizePolicy, GoodputPolicy)
}


def make_spec_policy(spec: "SpecConfig") -> SpecPolicy:
    """The configured policy, built with the spec config and `spec.policy_args`."""
    if ":" in spec.policy:
        cls = load_class(spec.policy, SpecPolicy, "spec.policy")
    elif spec.policy in SPEC_POLICY_CLASSES:
        cls = SPEC_POLICY_CLASSES[spec.policy]
    else:
        raise ValueError(f"spec.policy: unknown policy {spec.policy!r}; choose one of {', '.join(SPEC_POLICY_CLASSES)}")
    return build_plugin(cls, spec.policy_args, "spec.policy_args", spec)
