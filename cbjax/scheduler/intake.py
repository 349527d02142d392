"""Request intake: why a submitted request can never run on a scheduler (no jax)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from cbjax.core.request import Request


class Limits(Protocol):
    """What intake reads of a scheduler (`cbjax.scheduler.core.Scheduler` provides it)."""

    cfg: Any  # SchedulerConfig: chunked_prefill
    allocator: Any  # admission_pages, num_usable_pages
    max_model_len: int
    token_budget: int
    vocab_size: Optional[int]
    validate: Optional[Callable[[Request], Optional[str]]]

    def reserve_tokens(self, req: Request) -> int: ...


def rejection_reason(sched: Limits, req: Request) -> Optional[str]:
    """Why the request can never run on `sched`, or None: input errors, sampling parameters,
    lengths against the model, the step budget and the page pool, prompt ids against the
    vocabulary, then the executor's own check (`sched.validate`). A reason found here for a
    request read from a file starts with its `source`, as the reader's own errors do."""
    reason = _reason(sched, req)
    if reason is not None and req.source is not None and not req.input_error:
        return f"{req.source}: {reason}"
    return reason


def output_bound(req: Request, max_model_len: int) -> int:
    """The tokens `req` may generate under `max_model_len`: its stopping length, capped."""
    return max(0, min(req.stop_length(), max_model_len - req.prompt_len))


def _reason(sched: Limits, req: Request) -> Optional[str]:
    if req.input_error:
        return req.input_error
    if req.prompt_len < 1:
        return "empty prompt"
    problem = req.sampling.problem()
    if problem:
        return problem
    if req.target_output_len is not None and req.target_output_len < 1:
        return f"output_len must be >= 1, got {req.target_output_len}"
    if req.prompt_len >= sched.max_model_len:
        return (
            f"prompt has {req.prompt_len} tokens, model max_model_len is {sched.max_model_len} "
            "(no room to generate)"
        )
    if req.prompt_len > sched.token_budget and not sched.cfg.chunked_prefill:
        return (
            f"prompt has {req.prompt_len} tokens, more than "
            f"scheduler.max_num_batched_tokens={sched.token_budget}"
        )
    peak = req.prompt_len + req.max_output_len - 1
    need = sched.allocator.admission_pages(peak, sched.reserve_tokens(req))
    if need > sched.allocator.num_usable_pages:
        return (
            f"needs {need} KV pages at its maximum length ({req.prompt_len} prompt + "
            f"{req.max_output_len} output tokens), the cache has {sched.allocator.num_usable_pages} "
            "(cache.num_pages - 1)"
        )
    bad_id = token_outside_vocab(req, sched.vocab_size)
    if bad_id is not None:
        return (
            f"request {req.request_id}: prompt token id {bad_id} is outside the vocabulary "
            f"(model.vocab_size={sched.vocab_size})"
        )
    if sched.validate is not None:
        return sched.validate(req)
    return None


def token_outside_vocab(req: Request, vocab: Optional[int]) -> Optional[int]:
    """The first prompt id outside [0, vocab_size), or None. Seeded synthetic ids drawn
    below the vocabulary are not materialized: a simulated trace never reads them."""
    if vocab is None:
        return None
    if req.prompt_token_ids is None and req.synthetic_prompt is not None and req.synthetic_prompt[1] <= vocab:
        return None
    return next((t for t in req.prompt_ids() if not 0 <= t < vocab), None)
