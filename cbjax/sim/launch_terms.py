"""The pipelined loop's launch terms: the host time from collecting a step to launching the next
(`StepTime.launch_s`), and what a prefill plan's launch takes more where host and device share
a CPU core (`StepTime.held_s`), as functions of the launched plan (pure Python: no jax, no numpy).
"""

from __future__ import annotations

from typing import Sequence

# The pipelined loop's host time before it can collect the step in flight, from the plan it
# launches: fixed, per row, once for a plan with any prefill (its packing path: prompt rows,
# their pages and tiles), per prefill row, per token, per row again with the prefix cache on, and
# per request of the step in flight the plan does not carry on (`rows_left`).
LAUNCH_TERMS = (
    "launch_iter_s", "launch_seq_s", "launch_prefill_s", "launch_prefill_seq_s", "launch_token_s", "launch_cached_seq_s",
    "launch_left_s",
)  # fmt: skip
# What a plan with prefill rows adds to its launch where the host and the device share a CPU
# core (`held_cost`, `StepTime.held_s`): fixed and per token, its step's compute, which a call
# that finds the device idle runs in its place (the launches the terms are fitted on).
HELD_TERMS = ("held_prefill_s", "held_prefill_token_s")


def launch_features(
    rows: int, prefill_rows: int, tokens: int, prefix_caching: bool = False, left: int = 0
) -> list[float]:
    """The LAUNCH_TERMS' multipliers for launching a plan of `rows` rows, `prefill_rows` of them
    prefills (not decodes), and `tokens` tokens, in a run with the prefix cache on or off, after
    a step `left` of whose requests the plan does not carry on (`rows_left`; the formula: `cbjax.sim.profiled`)."""
    cached_rows = float(rows) if prefix_caching else 0.0
    return [1.0, float(rows), float(prefill_rows > 0), float(prefill_rows), float(tokens), cached_rows, float(left)]


def rows_left(rows_before: int, rows: Sequence[tuple[int, int, bool]]) -> int:
    """How many of the `rows_before` requests of the step in flight a plan of `rows`
    ((num_new_tokens, num_context_tokens, decode), `Schedule.cost_rows`) does not carry on: the
    step's rows less the plan's rows that continue a request, those with context already
    computed (a decode, or a prefill's later chunk). A new request's prefill starts at context 0;
    one behind a cached prefix, or swapped back in, counts as carried on (an undercount)."""
    return max(0, rows_before - sum(1 for _, context, _ in rows if context > 0))


def launch_cost(
    coefficients: dict, rows: int, prefill_rows: int, tokens: int, prefix_caching: bool = False, left: int = 0
) -> float:
    """The LAUNCH_TERMS' host time for launching that plan (`launch_features`; a term a profile
    lacks is 0)."""
    features = launch_features(rows, prefill_rows, tokens, prefix_caching, left)
    return sum(coefficients.get(k, 0.0) * f for k, f in zip(LAUNCH_TERMS, features))


def held_cost(coefficients: dict, prefill_rows: int, tokens: int) -> float:
    """The HELD_TERMS' time more for launching a plan of `tokens` tokens with `prefill_rows`
    prefills (0 without prefills, or for a profile without the terms)."""
    if not prefill_rows:
        return 0.0
    return coefficients.get("held_prefill_s", 0.0) + coefficients.get("held_prefill_token_s", 0.0) * tokens
