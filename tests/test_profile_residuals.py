"""The profile's residual table by regime and bucket, by hand: opposite biases do not cancel."""

import numpy as np
import pytest

from cbjax.profile.launch_residuals import launch_residuals
from cbjax.profile.residuals import format_table, regime_of, regime_residuals, round_speeds


def step(source, bucket, measured, predicted, idle=False):
    return {"source": source, "bucket": bucket, "measured_s": measured, "predicted_s": predicted, "idle": idle}


def test_regime_of_the_served_runs():
    assert [regime_of(x) for x in ("fcfs_chunked_on", "static", "fcfs_poisson_30pct", "fcfs_poisson_60pct",
                                   "fcfs_poisson_90pct")] == ["burst", "burst", "light", "medium", "heavy"]  # fmt: skip


def test_residual_table_by_hand():
    served = (
        # light: 10 decode steps of bucket 4 over-predicted by 20%, 2 of bucket 16 by 10%
        [step("fcfs_poisson_30pct", 4, 1.0, 1.2) for _ in range(10)]
        + [step("fcfs_poisson_30pct", 16, 2.0, 2.2) for _ in range(2)]
        # burst: 10 steps under-predicted by 4%, 10 over by 2%; an idle-woken step is left out
        + [step("static", 64, 1.0, 0.96) for _ in range(10)]
        + [step("fcfs_chunked_on", 64, 1.0, 1.02) for _ in range(10)]
        + [step("fcfs_chunked_on", 64, 1.0, 9.0, idle=True)]
    )
    t = regime_residuals(served)
    light, burst = t["regimes"]["light"], t["regimes"]["burst"]
    # light: (10 x 0.2 + 2 x 0.1) / 12 = 0.18333; median |error| 0.2
    assert light["num_steps"] == 12 and light["mean_signed_error"] == pytest.approx(2.2 / 12)
    assert light["median_abs_error"] == pytest.approx(0.2)
    assert light["buckets"]["16"] == {"num_steps": 2, "mean_signed_error": pytest.approx(0.1),
                                      "median_abs_error": pytest.approx(0.1),
                                      "total_signed_error": pytest.approx(0.1)}  # fmt: skip
    # light's total: (10 x 1.2 + 2 x 2.2) / (10 x 1.0 + 2 x 2.0) - 1 = 16.4 / 14 - 1
    assert light["total_signed_error"] == pytest.approx(16.4 / 14 - 1)
    # burst: (10 x -0.04 + 10 x 0.02) / 20 = -0.01, within 5%
    assert burst["num_steps"] == 20 and burst["mean_signed_error"] == pytest.approx(-0.01)
    assert burst["median_abs_error"] == pytest.approx(0.03)
    assert list(t["regimes"]) == ["burst", "light"]
    assert t["failures"] == ["regime light: mean signed step-time error +18.3% over 12 steps exceeds ±5%"]
    assert t["sparse"] == ["regime light: bucket 16 has 2 served steps (< 10)"]
    assert format_table(t, buckets=False)[0] == "burst: 20 steps, mean signed -1.0%, median |error| 3.0%, total -1.0%"


def test_a_cancelling_pool_still_fails_per_regime():
    # pooled, +10% on 10 steps and -10% on 10 steps average 0; per regime both fail
    served = [step("fcfs_poisson_30pct", 4, 1.0, 1.1) for _ in range(10)] + [step("static", 4, 1.0, 0.9) for _ in range(10)]
    t = regime_residuals(served)
    assert len(t["failures"]) == 2 and not t["sparse"]


def test_served_terms_recover_per_row_and_per_page_costs_the_grid_got_wrong():
    from cbjax.profile.served_fit import fit_served
    from cbjax.sim.profiled import STEP_TERMS

    # truth: bucket 4 costs 1 ms, bucket 8 2 ms, plus 0.1 ms per row and 0.01 ms per single page;
    # the grid's model says 0.5 ms per row and nothing per page
    rng = np.random.default_rng(0)
    served = []
    for i in range(60):
        bucket = 4 if i % 2 else 8
        rows, pages = int(rng.integers(1, bucket + 1)), int(rng.integers(1, 40))
        features = [1.0, rows, 0.0, 0.0, 0.0, 0.0, pages, 0.0, rows]
        measured = {4: 1e-3, 8: 2e-3}[bucket] + 1e-4 * rows + 1e-5 * pages
        served.append({"bucket": bucket, "features": features, "measured_s": measured, "since_larger": 0})
    grid = {**dict.fromkeys(STEP_TERMS, 0.0), "seq_s": 5e-4, "bucket_s": {4: 1e-3, 8: 2e-3}, "bucket_scale": 1.0}
    fitted = fit_served(served, {4: 1e-3, 8: 2e-3}, grid, served_terms=True)
    assert fitted["seq_s"] == pytest.approx(1e-4, rel=1e-6)
    assert fitted["single_page_s"] == pytest.approx(1e-5, rel=1e-6)
    assert fitted["served_bucket_s"] == {"4": pytest.approx(1e-3, rel=1e-6), "8": pytest.approx(2e-3, rel=1e-6)}
    # without: the grid's per-row cost stays, and the intercepts absorb what they can of the difference
    plain = fit_served(served, {4: 1e-3, 8: 2e-3}, grid)
    assert "seq_s" not in plain and plain["served_bucket_s"]["4"] != pytest.approx(1e-3, rel=1e-2)


def test_machine_speed_by_round_by_hand():
    # rounds 0 and 2 run as the model says; round 1 at half its speed (every step twice the
    # prediction), round 3 a quarter faster on one bucket only. An idle-woken step is left out.
    served = (
        [dict(step("static", 4, 1.0, 1.0), round=0) for _ in range(3)]
        + [dict(step("fcfs_poisson_30pct", 4, 2.0, 1.0), round=1) for _ in range(4)]
        + [dict(step("fcfs_poisson_30pct", 4, 2.0, 2.0), round=2)]
        + [dict(step("static", 16, 0.8, 1.0), round=3), dict(step("static", 4, 1.0, 1.0), round=3)]
        + [dict(step("static", 4, 5.0, 1.0, idle=True), round=1)]
    )
    d = round_speeds(served)
    # predicted / measured time per round: 3/3, 4/8, 2/2, 2/1.8
    assert d["rounds"] == {"0": {"num_steps": 3, "speed": pytest.approx(1.0)},
                           "1": {"num_steps": 4, "speed": pytest.approx(0.5)},
                           "2": {"num_steps": 1, "speed": pytest.approx(1.0)},
                           "3": {"num_steps": 2, "speed": pytest.approx(2 / 1.8)}}  # fmt: skip
    # the fastest round over the slowest, less 1: (2 / 1.8) / 0.5 - 1
    assert d["spread"] == pytest.approx((2 / 1.8) / 0.5 - 1)
    assert d["drifted"] is True  # beyond the 5% limit
    steady = [dict(step("static", 4, 1.0, 1.0 + 0.01 * r), round=r) for r in range(4)]
    assert round_speeds(steady)["spread"] == pytest.approx(1.03 - 1) and round_speeds(steady)["drifted"] is False
    assert round_speeds([step("static", 4, 1.0, 1.0)]) == {"rounds": {}, "spread": None, "drifted": False}


def launch_point(regime, next_prefill_rows, host, predicted, held_out=True):
    return {"regime": regime, "next_prefill_rows": next_prefill_rows, "host_s": host, "launch_predicted_s": predicted,
            "held_out": held_out, "idle": False}  # fmt: skip


def test_prefill_launches_are_judged_per_regime_where_a_pooled_figure_cancels():
    # light: 2 prefill launches predicted 40% short; burst: 4 predicted 20% long. Pooled, the
    # prefill launches' mean signed error is (2 x -0.4 + 4 x 0.2) / 6 = 0: per regime -40% and
    # +20%. A stall (host time over HOST_STALL x its prediction) and a fitted round's point are
    # left out; decodes alone are apart.
    served = (
        [launch_point("light", 1, 1.0, 0.6) for _ in range(2)]
        + [launch_point("burst", 1, 1.0, 1.2) for _ in range(4)]
        + [launch_point("light", 1, 10.0, 1.0), launch_point("medium", 1, 1.0, 0.1, held_out=False)]
        + [launch_point("light", 0, 1.0, 1.1) for _ in range(3)]
    )
    r = launch_residuals(served)
    assert r["steps"] == "held-out"
    assert r["prefill"]["num_steps"] == 6 and r["prefill"]["mean_signed_error"] == pytest.approx(0.0, abs=1e-12)
    by_regime = r["prefill_by_regime"]
    assert sorted(by_regime) == ["burst", "light"]
    assert by_regime["light"]["num_steps"] == 2 and by_regime["light"]["mean_signed_error"] == pytest.approx(-0.4)
    assert by_regime["burst"]["num_steps"] == 4 and by_regime["burst"]["mean_signed_error"] == pytest.approx(0.2)
    assert r["decode"]["num_steps"] == 3 and r["decode"]["mean_signed_error"] == pytest.approx(0.1)


def test_prefill_launches_are_judged_apart_by_the_arrivals_taken_in_before_them():
    # 3 prefill launches after the loop took in an arrival, predicted 30% short; 2 with none
    # taken in, predicted 10% long; one without the field (a profile recorded before it) counts
    # in neither group, as decodes alone do not.
    served = (
        [{**launch_point("light", 1, 1.0, 0.7), "arrivals": 1} for _ in range(3)]
        + [{**launch_point("burst", 2, 1.0, 1.1), "arrivals": 0} for _ in range(2)]
        + [launch_point("burst", 1, 1.0, 1.5), {**launch_point("light", 0, 1.0, 0.5), "arrivals": 2}]
    )
    by_arrivals = launch_residuals(served)["prefill_by_arrivals"]
    assert by_arrivals["some"]["num_steps"] == 3 and by_arrivals["some"]["mean_signed_error"] == pytest.approx(-0.3)
    assert by_arrivals["none"]["num_steps"] == 2 and by_arrivals["none"]["mean_signed_error"] == pytest.approx(0.1)


def test_prefill_launches_are_judged_apart_by_whether_their_step_call_held_the_loop():
    # Calls of 1, 2 and 3 (x 0.1 ms) whose collect then waited found the device busy: the floor
    # is their median, 0.2 ms (the other calls' collects found their step done). Prefill
    # launches whose call took over 2 x 0.2 ms held the loop (2, predicted 20% short); those at
    # or under it queued their step (2, 10% long); one without the field counts in neither, nor
    # do decode launches.
    def call(regime, prefills, call_s, predicted, wait_s):
        return {**launch_point(regime, prefills, 1.0, predicted), "next_dispatch_s": call_s, "collect_wait_s": wait_s}

    served = [call("burst", 0, c * 1e-4, 1.0, 1e-3) for c in (1, 2, 3)]
    served += [call("light", 1, 2e-3, 0.8, 0.0) for _ in range(2)] + [call("burst", 1, 4e-4, 1.1, 0.0) for _ in range(2)]
    served += [launch_point("light", 1, 1.0, 0.5)]
    by_call = launch_residuals(served)["prefill_by_call"]
    assert by_call["floor_s"] == pytest.approx(2e-4)
    assert by_call["held"]["num_steps"] == 2 and by_call["held"]["mean_signed_error"] == pytest.approx(-0.2)
    assert by_call["queued"]["num_steps"] == 2 and by_call["queued"]["mean_signed_error"] == pytest.approx(0.1)
    assert "prefill_by_call" not in launch_residuals([launch_point("light", 1, 1.0, 0.5)])  # no call recorded
