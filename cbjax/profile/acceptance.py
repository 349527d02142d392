"""The acceptance rule for the simulator against the engine, one that the engine's noise cannot loosen.

Per cell and figure: the engine's median over its repeats, a seeded bootstrap 90% interval of
that median, and the simulator's signed error against the median. A figure with a target
passes when |error| <= target; lying inside the engine's interval is reported beside it but
never passes a cell on its own, and no target is ever replaced by a spread (a noisier machine
must not pass more easily). Per regime (burst, light, medium, heavy) a figure is summarised by
its mean signed error, which exposes a bias that cancels in a pooled median, and its worst cell.

Pure numpy: no jax import.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

REGIMES = ("burst", "light", "medium", "heavy")
# The mean signed error per regime that a figure may carry.
REGIME_BIAS_PCT = 5.0


def bootstrap_median_interval(
    values: Sequence[float], level: float = 0.90, num_resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """(lo, hi): the central `level` interval of the medians of `num_resamples` resamples (with
    replacement, seeded) of `values`; the empirical quantiles, not interpolated between values."""
    x = np.asarray(values, float)  # f64[num_runs]
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError(f"bootstrap_median_interval: values must be a non-empty list of finite numbers, got {values!r}")
    if not 0 < level < 1:
        raise ValueError(f"bootstrap_median_interval: level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(x, size=(num_resamples, x.size), replace=True), axis=1)
    tail = (1 - level) / 2
    lo, hi = np.quantile(medians, [tail, 1 - tail], method="inverted_cdf")
    return float(lo), float(hi)


def signed_error_pct(sim: float, engine: float) -> float:
    """100 (sim - engine) / engine: positive when the simulator over-predicts."""
    if not engine:
        raise ValueError(f"signed_error_pct: the engine's figure is {engine!r}; an error needs a non-zero one")
    return 100.0 * (sim - engine) / engine


def judge(sim: float, engine_values: Sequence[float], target_pct: Optional[float], seed: int = 0) -> dict:
    """One cell's figure: the engine's median and 90% interval, the simulator's signed error,
    whether the simulator lies inside the interval and within the target, and the verdict
    (`pass` / `fail` by the target alone; `-` where the figure has no target)."""
    median = float(np.median(np.asarray(engine_values, float)))
    lo, hi = bootstrap_median_interval(engine_values, seed=seed)
    error = signed_error_pct(sim, median)
    within = None if target_pct is None else bool(abs(error) <= target_pct)
    return {
        "sim": sim,
        "engine": median,
        "engine_runs": [float(v) for v in engine_values],
        "interval": [lo, hi],
        "error_pct": error,
        "in_interval": bool(lo <= sim <= hi),  # plain bools: the result goes to JSON
        "target_pct": target_pct,
        "within_target": within,
        "verdict": "-" if within is None else ("pass" if within else "fail"),
    }


def unmeasured(sim: float, target_pct: Optional[float]) -> dict:
    """A cell's figure with no engine run to judge it by (`judge`'s keys; the engine's median,
    interval and error None): it fails where it has a target, as a figure nobody measured
    cannot be shown within one."""
    return {
        "sim": sim, "engine": None, "engine_runs": [], "interval": [None, None], "error_pct": None,
        "in_interval": False, "target_pct": target_pct, "within_target": None if target_pct is None else False,
        "verdict": "-" if target_pct is None else "fail",
    }  # fmt: skip


def judge_runs(
    sim: Optional[float], values: Sequence[float], target_pct: Optional[float], *, judged: int, repeats: int = 0,
    made: int = 0, seed: int = 0,
) -> Optional[dict]:  # fmt: skip
    """`judge` under the calibrations' anchor rule (`cbjax.profile.anchor`): `values` is the
    figure over the runs made at the profile's machine speed, `judged` of them, of `made` runs.
    None without a simulated figure or with no run made; `unmeasured` when runs were made but
    none gave a value; with fewer than `repeats` judged a targeted figure fails (the cell was
    not measured at the profile's speed)."""
    if sim is None or not (values or made):
        return None
    j = judge(sim, values, target_pct, seed=seed) if values else unmeasured(sim, target_pct)
    if judged < repeats and target_pct is not None:
        j.update(within_target=False, verdict="fail")
    return j


def summarize_regimes(cells: list[dict], figures: Sequence[str]) -> list[dict]:
    """Per regime and figure: the cells' mean signed error, the worst cell (largest |error|), how
    many cells pass their target, and whether the regime's bias is within REGIME_BIAS_PCT.

    `cells`: dicts with `regime`, a `name` and, per figure present in the cell, `judge`'s dict."""
    out = []
    order = [r for r in REGIMES if any(c["regime"] == r for c in cells)]
    order += sorted({c["regime"] for c in cells} - set(order))
    for regime in order:
        for fig in figures:
            judged = [(c["name"], c[fig]) for c in cells if c["regime"] == regime and c.get(fig) is not None]
            if not judged:
                continue
            measured = [(n, j) for n, j in judged if j["error_pct"] is not None]  # not `unmeasured`
            errors = [j["error_pct"] for _, j in measured]
            mean = sum(errors) / len(errors) if errors else float("nan")
            worst_name, worst = max(measured, key=lambda nj: abs(nj[1]["error_pct"])) if measured else judged[0]
            targeted = [j for _, j in judged if j["within_target"] is not None]
            out.append({
                "regime": regime,
                "figure": fig,
                "num_cells": len(judged),
                "mean_signed_error_pct": mean,
                "worst_error_pct": worst["error_pct"],
                "worst_cell": worst_name,
                "num_pass": sum(j["within_target"] for j in targeted),
                "num_targeted": len(targeted),
                # a regime with a cell no run measured is not shown unbiased
                "bias_ok": abs(mean) <= REGIME_BIAS_PCT and math.isfinite(mean) and len(measured) == len(judged),
            })  # fmt: skip
    return out
