"""The profile's residual table by load regime and bucket, and the failures it must not hide.

A pooled error lets biases of opposite sign cancel: light-load steps over-predicted and burst
steps under-predicted can sum to a total within 0%. Per regime (burst, light, medium, heavy:
the served run a step came from) and per bucket, the table gives the count, the mean signed
relative error of the step time (+: the model over-predicts), the median absolute one and the
summed prediction's error (`total_signed_error`). The profile computes it on the served steps
held out of the fit (`held_out_residuals`). A
regime whose mean signed error exceeds REGIME_BIAS_LIMIT is a failure of the profile, and a
bucket a regime uses with fewer than MIN_STEPS served steps is reported as under-sampled.

Pure numpy: no jax import.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import numpy as np

REGIME_BIAS_LIMIT = 0.05
MIN_STEPS = 10
REGIMES = ("burst", "light", "medium", "heavy")


def regime_of(label: str) -> str:
    """The load regime of a served run by its label (`cbjax.profile.serving.serving_runs`): a
    Poisson run at P% of the saturated rate is light below 45%, medium below 75%, else heavy;
    every other run (all requests at t=0) is a burst."""
    if "poisson_" in label and label.endswith("pct"):
        share = float(label.rsplit("_", 1)[1][: -len("pct")]) / 100.0
        return "light" if share < 0.45 else "medium" if share < 0.75 else "heavy"
    return "burst"


def _stats(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """Over (predicted, measured) pairs: the count, the mean signed and median absolute relative
    error, and `total_signed_error`, the summed prediction over the summed measurement less 1
    (what the steps add up to in a run's time; beside the mean, which a skewed spread of the
    measurements pulls away from it)."""
    p, m = (np.asarray(x, float) for x in zip(*pairs))
    e = (p - m) / m
    return {"num_steps": int(e.size), "mean_signed_error": float(e.mean()), "median_abs_error": float(np.median(np.abs(e))),
            "total_signed_error": float(p.sum() / m.sum() - 1.0)}  # fmt: skip


def regime_residuals(served: list[dict], limit: float = REGIME_BIAS_LIMIT, min_steps: int = MIN_STEPS) -> dict[str, Any]:
    """{"regimes": {regime: stats and "buckets": {bucket: stats}}, "failures": [...], "sparse": [...]}
    over the served steps that have `predicted_s` (idle-woken steps left out: `wake_s` charges them).

    Each step's relative error is (predicted_s - measured_s) / measured_s; a step's regime is its
    own `regime` or `regime_of(its source)`."""
    by_regime: dict[str, list[tuple[float, float]]] = defaultdict(list)
    by_bucket: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for s in served:
        if s.get("idle") or s.get("predicted_s") is None or not s.get("measured_s"):
            continue
        regime = s.get("regime") or regime_of(str(s.get("source", "")))
        pair = (s["predicted_s"], s["measured_s"])
        by_regime[regime].append(pair)
        by_bucket[regime][int(s["bucket"])].append(pair)
    order = [r for r in REGIMES if r in by_regime] + sorted(set(by_regime) - set(REGIMES))
    table, failures, sparse = {}, [], []
    for regime in order:
        row = _stats(by_regime[regime])
        row["buckets"] = {str(b): _stats(e) for b, e in sorted(by_bucket[regime].items())}
        table[regime] = row
        if abs(row["mean_signed_error"]) > limit:
            failures.append(
                f"regime {regime}: mean signed step-time error {row['mean_signed_error']:+.1%} over "
                f"{row['num_steps']} steps exceeds ±{limit:.0%}"
            )
        sparse += [f"regime {regime}: bucket {b} has {len(e)} served steps (< {min_steps})"
                   for b, e in sorted(by_bucket[regime].items()) if len(e) < min_steps]  # fmt: skip
    return {"limit": limit, "min_steps": min_steps, "regimes": table, "failures": failures, "sparse": sparse}


def round_speeds(served: list[dict], limit: float = REGIME_BIAS_LIMIT) -> dict[str, Any]:
    """The machine's speed in each serving round, against the fitted model: per round (the
    steps' `round`) its summed predicted over its summed measured step time (1: as the model
    says; 0.5: every step took twice as long), over the steps `regime_residuals` counts. The
    fit and the residual table see different rounds, so when the machine itself runs at other
    speeds in different rounds (a VM's speed states), that drift shows in the table as bias.
    `spread` is the fastest round over the slowest less 1 (None with fewer than two rounds);
    `drifted`: it exceeds `limit`. A diagnosis beside the table; it loosens no failure."""
    num: dict[int, int] = defaultdict(int)
    pred: dict[int, float] = defaultdict(float)
    meas: dict[int, float] = defaultdict(float)
    for s in served:
        if s.get("idle") or s.get("predicted_s") is None or not s.get("measured_s") or s.get("round") is None:
            continue
        r = int(s["round"])
        num[r] += 1
        pred[r] += s["predicted_s"]
        meas[r] += s["measured_s"]
    rounds = {str(r): {"num_steps": num[r], "speed": pred[r] / meas[r]} for r in sorted(num)}
    if len(rounds) < 2:
        return {"rounds": rounds, "spread": None, "drifted": False}
    speeds = [x["speed"] for x in rounds.values()]
    spread = max(speeds) / min(speeds) - 1.0
    return {"rounds": rounds, "spread": spread, "drifted": bool(spread > limit)}


def held_out_residuals(served: list[dict], limit: float = REGIME_BIAS_LIMIT, min_steps: int = MIN_STEPS) -> dict[str, Any]:
    """`regime_residuals` over the served steps held out of the fit (`held_out`: the profile's odd
    serving rounds, other requests and arrivals than the fitted rounds'), with `steps` saying so;
    when none was held out (one round), over all of them, `steps` "in-sample" (the fit's own
    steps: a weaker check)."""
    held = [s for s in served if s.get("held_out")]
    table = regime_residuals(held or served, limit, min_steps)
    table["steps"] = "held-out" if held else "in-sample"
    table["machine"] = round_speeds(served, limit)
    return table


def format_table(table: dict[str, Any], buckets: Optional[bool] = True) -> list[str]:
    """Printable lines: per regime its count, mean signed and median absolute error, then per bucket."""
    lines = []
    for regime, row in table["regimes"].items():
        lines.append(f"{regime}: {row['num_steps']} steps, mean signed {row['mean_signed_error']:+.1%}, "
                     f"median |error| {row['median_abs_error']:.1%}, total {row['total_signed_error']:+.1%}")  # fmt: skip
        if buckets:
            lines += [f"  bucket {b}: {r['num_steps']} steps, mean signed {r['mean_signed_error']:+.1%}, "
                      f"median |error| {r['median_abs_error']:.1%}, total {r['total_signed_error']:+.1%}"
                      for b, r in row["buckets"].items()]  # fmt: skip
    return lines
