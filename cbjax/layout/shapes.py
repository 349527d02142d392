"""The shape plan: which token counts the step is compiled for (pure Python, no jax).

A step's only varying dimension is T, the number of tokens in its flat buffer; the slot
array (rows), the page-table width and the page pool are fixed. T is padded up to a bucket:
fine-grained up to the slot count, where decode-only steps live (a thinning batch should
not pay for idle slots), then doubling up to the largest step the scheduler can plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class ShapePlan:
    token_buckets: tuple[int, ...]  # ascending; the last holds any step
    num_rows: int  # the slot array: scheduler.max_num_seqs
    max_pages: int  # page-table width: ceil(max_model_len / page_size)
    page_size: int

    def bucket(self, num_tokens: int) -> int:
        """The smallest bucket holding `num_tokens` tokens."""
        for b in self.token_buckets:
            if b >= num_tokens:
                return b
        raise ValueError(
            f"a step of {num_tokens} tokens exceeds the largest token bucket {self.token_buckets[-1]} "
            f"(executor.token_buckets)"
        )


# From this many tokens on, a bucket halfway (1.5x) between doublings: a large step's padding is
# compute, not a fixed cost. A SmolLM-shaped first step of about 2,660 prompt tokens took 5.3 s
# padded to 4096 tokens and 3.8 s padded to 3072 (the whole 24-request run 13.1 against 11.7 s).
LARGE_STEP = 1024


def default_token_buckets(num_rows: int, max_tokens: int) -> list[int]:
    """4, 8, then steps of about sqrt(2) (multiples of 8) up to `num_rows`, then doubling up to
    `max_tokens`, with a bucket at 1.5x between doublings from LARGE_STEP tokens on: at most
    41% padding on decode-only steps above 8 rows, at most 2x on prefills below LARGE_STEP
    tokens and 1.5x above. Below 4 tokens a step costs what a 4-token step does (the weights
    are read either way), so 1 and 2 would only add compiles."""
    buckets = [b for b in (4, 8) if b < num_rows]
    b = 8.0
    while b * math.sqrt(2) < num_rows:
        b *= math.sqrt(2)
        size = 8 * math.ceil(b / 8)
        if size > buckets[-1] and size < num_rows:
            buckets.append(size)
    if not buckets or num_rows > buckets[-1]:
        buckets.append(num_rows)
    while buckets[-1] < max_tokens:
        base = buckets[-1]
        if base >= LARGE_STEP and base * 3 // 2 < max_tokens:
            buckets.append(base * 3 // 2)
        buckets.append(min(2 * base, max_tokens))
    return buckets


def plan_shapes(
    num_rows: int,
    max_model_len: int,
    page_size: int,
    max_num_batched_tokens: int,
    token_buckets: Optional[Sequence[int]] = None,
) -> ShapePlan:
    """The shape plan for a slot array of `num_rows` rows. A step holds at most
    min(max_num_batched_tokens, num_rows * max_model_len) tokens; explicit `token_buckets`
    must reach that."""
    max_tokens = min(max_num_batched_tokens, num_rows * max_model_len)
    if token_buckets is None:
        buckets = default_token_buckets(num_rows, max_tokens)
    else:
        buckets = sorted({int(b) for b in token_buckets})
        if not buckets or buckets[0] < 1:
            raise ValueError(f"executor.token_buckets must be sizes >= 1, got {list(token_buckets)}")
        if buckets[-1] < max_tokens:
            raise ValueError(
                f"executor.token_buckets: the largest bucket {buckets[-1]} is smaller than the largest step, "
                f"min(scheduler.max_num_batched_tokens, scheduler.max_num_seqs * model.max_model_len) = {max_tokens}"
            )
    return ShapePlan(
        token_buckets=tuple(buckets), num_rows=num_rows, max_pages=-(-max_model_len // page_size), page_size=page_size
    )
