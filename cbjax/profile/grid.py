"""The batch compositions `python -m cbjax.profile` times, built as real `Schedule`s (no jax).

Decode-only steps (rows x context), prefill-only steps (one long prompt, several prompts filling
a step), a chunk continuing cached context, and mixed steps, plus in every bucket between the
slot count and max_model_len a prompt alone and a prompt joining a quarter of the slots'
decodes (the steps a served run is made of); sizes are fractions of the run's slot count,
max_model_len and largest step, so every config gets a grid that fits it. A run that speculates
(`spec_tokens` > 0) adds verify steps: decodes of 1 + k tokens each, k drafts to verify.
"""

from __future__ import annotations

from dataclasses import dataclass

from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.request import SamplingParams
from cbjax.layout.shapes import ShapePlan

GRIDS = ("full", "small")


@dataclass
class GridPoint:
    kind: str  # decode | verify | prefill | chunk | mixed
    rows: list[tuple[int, int]]  # (num_new_tokens, num_context_tokens) per row, decodes first


def _uniq(values) -> list[int]:
    return sorted({int(v) for v in values if v >= 1})


def profile_grid(shapes: ShapePlan, max_model_len: int, grid: str = "full", spec_tokens: int = 0) -> list[GridPoint]:
    """The grid for a run: `full` for a profile, `small` (a few points) for tests; with
    `spec_tokens` (spec.num_tokens while speculating), decodes verifying 1 and that many drafts."""
    if grid not in GRIDS:
        raise ValueError(f"grid: unknown value {grid!r}; choose one of {', '.join(GRIDS)}")
    r, length, most, ps = shapes.num_rows, max_model_len, shapes.token_buckets[-1], shapes.page_size
    small = grid == "small"
    row_counts = _uniq([1, r] if small else [1, r // 4, r // 2, r])
    contexts = _uniq([ps, length - 1] if small else [ps, length // 4, length - 1])
    points = [GridPoint("decode", [(1, c)] * n) for n in row_counts for c in contexts]
    for k in _uniq([1, spec_tokens] if spec_tokens else []):
        width = min(1 + k, length - 1)
        points += [GridPoint("verify", [(width, min(c, length - width))] * max(1, min(n, most // width)))
                   for n in row_counts for c in contexts]  # fmt: skip
    lengths = _uniq([length // 8, length // 2] if small else [length // 16, length // 4, length])
    points += [GridPoint("prefill", [(min(n, most), 0)]) for n in lengths]
    for total in _uniq([most] if small else [most // 2, most]):  # several prompts filling a step
        each = min(length, total)
        count = max(1, min(r, total // each))
        points.append(GridPoint("prefill", [(each, 0)] * count))
    quarter = max(2, length // 4)
    if not small:
        points.append(GridPoint("chunk", [(min(quarter, most), length // 2)]))
    if r >= 2:
        decodes = max(1, r // 2) if small else r - 1
        points.append(GridPoint("mixed", [(1, length // 2)] * decodes + [(min(quarter, most - decodes), 0)]))
        if not small:
            points.append(
                GridPoint("mixed", [(1, length // 4)] * (r // 2) + [(min(quarter, most - r // 2), length // 2)])
            )
    if (
        not small
    ):  # where served steps live: a prompt alone, and a prompt joining a few decodes, in each bucket past the slots
        for b in shapes.token_buckets:
            if r < b <= length:
                n = max(2, 3 * b // 4)
                points.append(GridPoint("prefill", [(n, 0)]))
                if r >= 4:
                    points.append(GridPoint("mixed", [(1, length // 8)] * (r // 4) + [(n - r // 4, 0)]))
    if not small:  # one more point in each bucket no point landed in: every program is timed
        timed = {shapes.bucket(sum(n for n, _ in p.rows)) for p in points}
        for b in shapes.token_buckets:
            if b in timed:
                continue
            if b <= r:
                points.append(GridPoint("decode", [(1, length // 4)] * b))
            else:
                each = min(length, b)
                points.append(GridPoint("prefill", [(each, 0)] * min(r, b // each)))
    return points


def build_schedule(point: GridPoint, shapes: ShapePlan, num_pages: int, vocab_size: int) -> Schedule:
    """A plan of `point`'s rows in slots 0.., with page tables over pages 1 .. num_pages - 1
    (reused round-robin when the grid needs more: the timing does not depend on their contents)."""
    ps = shapes.page_size
    decodes, prefills = [], []
    next_page = 0
    for slot, (n, ctx) in enumerate(point.rows):
        total = ctx + n
        num = -(-total // ps)
        decode = point.kind in ("decode", "verify") or (n == 1 and ctx > 0)
        entry = ScheduledRequest(
            request_id=f"p{slot}", slot=slot, num_computed=ctx, num_new_tokens=n, is_decode=decode,
            token_ids=tuple((slot * 7 + i) % vocab_size for i in range(ctx, total)),
            page_table=tuple((next_page + i) % (num_pages - 1) + 1 for i in range(num)),
            sampling=SamplingParams(), num_drafts=n - 1 if point.kind == "verify" else 0,
        )  # fmt: skip
        next_page += num
        (decodes if decode else prefills).append(entry)
    return Schedule(num_slots=shapes.num_rows, scheduled=decodes + prefills, page_size=ps)
