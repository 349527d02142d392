"""How the pipelined loop's launch terms fare on the served steps the fit did not see, apart by
what a new request's first token waits behind (pure numpy: no jax import)."""

from __future__ import annotations

from typing import Any

import numpy as np

from cbjax.profile.served_fit import HELD_CALL, HOST_STALL, held_floor


def launch_residuals(served: list[dict]) -> dict[str, Any]:
    """The launch terms' error on the host times the fit did not see (held-out rounds; all of
    them when none is held out), apart for launches of decodes alone and of plans with a prefill
    (what a new request's first token waits behind), and the latter again per load regime
    (`prefill_by_regime`: a request's TTFT holds one such launch, and a bias of one regime's
    prefill launches, a few percent of its steps, hides in its step-time residuals and in the
    pooled figure): steps, mean signed and median |relative error| of `launch_predicted_s`
    against `host_s`, stalls (`HOST_STALL`) left out as in the fit."""
    points = [s for s in served if "launch_predicted_s" in s and s.get("host_s", 0.0) > 0 and not s.get("idle")]
    held = [s for s in points if s.get("held_out")]
    points = held or points
    points = [s for s in points if s["host_s"] <= HOST_STALL * s["launch_predicted_s"]]
    prefill = [s for s in points if s["next_prefill_rows"]]
    out: dict[str, Any] = {"steps": "held-out" if held else "in-sample",
                           "decode": _launch_errors([s for s in points if not s["next_prefill_rows"]]),
                           "prefill": _launch_errors(prefill)}  # fmt: skip
    regimes = dict.fromkeys(s.get("regime") for s in prefill if s.get("regime"))
    out["prefill_by_regime"] = {r: _launch_errors([s for s in prefill if s.get("regime") == r]) for r in regimes}
    # apart again by whether the loop took in arrivals before planning it (their intake is in
    # that host time; a profile recorded before `arrivals` has none of these)
    counted = [s for s in prefill if "arrivals" in s]
    out["prefill_by_arrivals"] = {
        "none": _launch_errors([s for s in counted if not s["arrivals"]]),
        "some": _launch_errors([s for s in counted if s["arrivals"]]),
    }
    # and by whether the launch's step call held the loop while the step ran (where the host and
    # the device share a CPU core, a call that finds the device idle runs the step in its place):
    # over HELD_CALL times the median call of launches that found it busy (their collect waited)
    floor = held_floor(points)
    if floor is not None:
        timed = [s for s in prefill if "next_dispatch_s" in s]
        out["prefill_by_call"] = {
            "floor_s": floor,
            "held": _launch_errors([s for s in timed if s["next_dispatch_s"] > HELD_CALL * floor]),
            "queued": _launch_errors([s for s in timed if s["next_dispatch_s"] <= HELD_CALL * floor]),
        }
    return out


def _launch_errors(group: list[dict]) -> dict[str, Any]:
    """Steps, mean signed and median |relative error| of `launch_predicted_s` against `host_s`."""
    err = np.array([(s["launch_predicted_s"] - s["host_s"]) / s["host_s"] for s in group])
    return {
        "num_steps": len(group),
        "mean_signed_error": float(err.mean()) if len(err) else None,
        "median_abs_error": float(np.median(np.abs(err))) if len(err) else None,
    }
