"""The latency anchor: the profile's lone requests served again, against their TTFTs in the profile (no jax at import).

The profile's anchor (`cbjax.profile.anchor`) times a saturated burst: the machine's speed for a
loop that never idles. A light-load TTFT follows another state of the machine: what a request
arriving at an idle loop pays (the sleep's overshoot, a cold step, a launch with nothing to hide
behind). The profile keeps the TTFT of every lone request it served (`served_wake`,
`cbjax.profile.wake`); the first pass of each serving round times each prompt length with the
loop idle FIRST_PASS_IDLE_S before each request. `lone_timer` serves such first passes again on a
warm engine and returns their speed against the profile's (`lone_speed`: per prompt length the
median TTFT over the profile's median, the median of those; above 1, slower than at the
profile). A calibration that judges latency cells judges a run by these timings around it, as
`cbjax.profile.anchor.on_speed` judges the burst anchor's, with a reference of 1.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import numpy as np

from cbjax.profile.wake import lone_config, serve_first_pass, wake_prompts

# first passes per timing: one lone request's TTFT moves from request to request, so each prompt
# length's median is taken over several passes' requests
LONE_REPEATS = 4
# lone TTFTs per prompt length a reference needs (the profile's first passes give 7 a round)
MIN_REFERENCE = 5


def lone_reference(record: Optional[dict[str, Any]]) -> dict[int, float]:
    """The median TTFT per prompt length over the first passes (even `pass`) of the profile's
    `served_wake` record, lengths with fewer than MIN_REFERENCE timed requests left out; {} for a
    profile without the record."""
    if not record:
        return {}
    ttfts: dict[int, list[float]] = {}
    for r in record.get("requests", []):
        if r["pass"] % 2 == 0 and r.get("ttft_s") is not None:
            ttfts.setdefault(int(r["prompt_len"]), []).append(float(r["ttft_s"]))
    return {n: float(np.median(v)) for n, v in sorted(ttfts.items()) if len(v) >= MIN_REFERENCE}


def lone_speed(ttfts: dict[int, list[float]], reference: dict[int, float]) -> float:
    """The median over prompt lengths of (median TTFT now) / (the profile's, `lone_reference`),
    over the lengths both have (above 1: slower than at the profile). A ValueError when they
    share none."""
    ratios = [float(np.median(v)) / reference[n] for n, v in ttfts.items() if v and reference.get(n)]
    if not ratios:
        raise ValueError(f"latency anchor: no prompt length timed now ({sorted(ttfts)}) is in the profile's "
                         f"lone requests ({sorted(reference)})")  # fmt: skip
    return float(np.median(ratios))


def serve_first_passes(executor, cfg, repeats: int = LONE_REPEATS, seed: int = 0) -> dict[int, list[float]]:
    """`repeats` first passes of the profile's lone requests (`wake_prompts` of `cfg`, arriving
    FIRST_PASS_IDLE_S apart) served by the warm engine `executor`, the prefix cache and host tier
    off, as the profile served them: the TTFTs per prompt length."""
    run_cfg = lone_config(cfg)
    ttfts: dict[int, list[float]] = {}
    for r in serve_first_pass(executor, run_cfg, wake_prompts(run_cfg) * repeats, seed):
        if r.first_token_s is not None:
            ttfts.setdefault(r.prompt_len, []).append(r.first_token_s - r.arrival_s)
    return ttfts


def lone_timer(cfg, reference: dict[int, float], repeats: int = LONE_REPEATS) -> Callable[[], float]:
    """A warm engine of `cfg`'s model and scheduler; returns what times the latency anchor now
    (`lone_speed` of `repeats` first passes against `reference`). Each timing draws new prompts."""
    from cbjax.app.run import build_executor, resolve

    run_cfg = resolve(lone_config(cfg))
    executor = build_executor(run_cfg)
    executor.sampling = False
    executor.warmup()
    serve_first_passes(executor, run_cfg, 1)  # untimed: the first serving's one-time costs
    timings = itertools.count(1)
    return lambda: lone_speed(serve_first_passes(executor, run_cfg, repeats, seed=next(timings) * 1000), reference)
