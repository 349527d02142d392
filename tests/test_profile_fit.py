"""The profile's served fit as the product runs it: per-row, per-page, per-block-step and cold terms
fitted on served steps, weighted so a bucket's mean signed relative error is zero, judged on
served rounds held out of the fit, and refitted offline from a recorded profile. No jax."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cbjax.config import ModelConfig, RunConfig
from cbjax.profile.refit import main as refit_main
from cbjax.profile.refit import refit
from cbjax.profile.residuals import held_out_residuals
from cbjax.profile.served_fit import censored, fit_collect, fit_drain, fit_launch, fit_served
from cbjax.profile.serving import anchor_rounds, held_out_round, serving_round_count, serving_runs
from cbjax.profile.fit import fit_costs
from cbjax.sim.launch_terms import HELD_TERMS, LAUNCH_TERMS
from cbjax.sim.profiled import COLD_TERMS, STEP_TERMS

# the truth the synthetic served logs are drawn from
FIXED = {4: 1.0e-3, 8: 1.5e-3, 16: 2.5e-3}
SEQ_S, SINGLE_PAGE_S, BLOCK_PAGE_S = 4e-5, 2e-6, 6e-6
BLOCK_CHUNK_S, BLOCK_CHUNK_TOKEN_S = 3e-5, 2e-6  # per block step of the prefill attention, and per bucket token
COLD = (5e-4, 3e-4, 1e-4, 5e-5)


def synthetic_log(n: int, seed: int, regime: str = "light", scale: float = 1.0, block_steps: bool = False) -> list[dict]:
    """`n` served steps over buckets 4, 8 and 16 with random rows, pages and steps since a larger
    bucket's (and with `block_steps`, 0-7 block steps of the prefill attention), timed exactly by
    the truth above (times `scale`)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        bucket = int(rng.choice([4, 8, 16]))
        rows = int(rng.integers(1, bucket + 1))
        single, block = int(rng.integers(1, 60)), int(rng.integers(0, 20))
        since = int(rng.integers(0, 5))
        features = [1.0, rows, 0.0, 0.0, 0.0, 0.0, single, block, rows]
        t = FIXED[bucket] + SEQ_S * rows + SINGLE_PAGE_S * single + BLOCK_PAGE_S * block
        t += COLD[since - 1] if since else 0.0
        if block_steps:
            chunks = int(rng.integers(0, 8))
            features[3], features[5] = float(chunks), float(chunks * bucket)
            t += BLOCK_CHUNK_S * chunks + BLOCK_CHUNK_TOKEN_S * chunks * bucket
        out.append({"bucket": bucket, "features": features, "measured_s": scale * t, "since_larger": since,
                    "idle": False, "regime": regime, "source": "fcfs_poisson_30pct"})  # fmt: skip
    return out


# the loop's host time before a collect, by the launched plan (LAUNCH_TERMS' order)
LAUNCH = (1.5e-4, 8e-6, 1.5e-3, 4e-5, 2e-7, 3e-6, 1.6e-5)


def with_launches(log: list[dict], seed: int) -> list[dict]:
    """`log`'s steps, each holding the launch of a next plan of 1-16 rows, none to all of them
    prefills, in a run with the prefix cache on or off, after 0-3 requests left the batch,
    timed exactly by LAUNCH (`host_s`). A step whose host time outlasts it is censored
    (its collect waited 1 us) and its share is that host time; the others' collect waited."""
    rng = np.random.default_rng(seed)
    out = []
    for s in log:
        rows = int(rng.integers(1, 17))
        prefills = int(rng.integers(0, rows + 1)) if rng.random() < 0.3 else 0
        tokens = rows - prefills + prefills * int(rng.integers(16, 257))
        cached = bool(rng.random() < 0.5)
        left = int(rng.integers(0, 4))
        host = LAUNCH[0] + LAUNCH[1] * rows + (LAUNCH[2] + LAUNCH[3] * prefills if prefills else 0.0) + LAUNCH[4] * tokens
        host += (LAUNCH[5] * rows if cached else 0.0) + LAUNCH[6] * left
        step = s["measured_s"]
        out.append({**s, "next_rows": rows, "next_prefill_rows": prefills, "next_tokens": tokens, "host_s": host,
                    "prefix_caching": cached, "left": left,
                    "measured_s": max(step, host), "collect_wait_s": step - host if step > host else 1e-6})  # fmt: skip
    return out


GRID = {**dict.fromkeys(STEP_TERMS, 0.0), "seq_s": 5e-4, "bucket_s": dict(FIXED), "bucket_scale": 1.0}


def test_mean_relative_weighting_fits_the_harmonic_mean_by_hand():
    # one intercept over steps of 1, 2 and 4 ms: weighted by 1 / time, the fit is their harmonic
    # mean, 3 / (1 + 1/2 + 1/4) = 12/7 ms, whose relative errors (+71.4%, -14.3%, -57.1%) sum to 0;
    # relative least squares gives sum(1/t) / sum(1/t^2) = 1.75 / 1.3125 = 4/3 ms, absolute the mean 7/3 ms
    times = [1e-3, 2e-3, 4e-3]
    ones = [[1.0]] * 3
    assert fit_costs(ones, times, weighting="mean_relative")[0] == pytest.approx(12 / 7 * 1e-3)
    assert fit_costs(ones, times, weighting="relative")[0] == pytest.approx(4 / 3 * 1e-3)
    assert fit_costs(ones, times, weighting="absolute")[0] == pytest.approx(7 / 3 * 1e-3)
    with pytest.raises(ValueError, match="weighting"):
        fit_costs(ones, times, weighting="median")


@pytest.mark.parametrize("weighting", ["mean_relative", "absolute", "balanced"])
def test_served_fit_recovers_per_row_per_page_and_cold_terms(weighting):
    # exact synthetic times: whatever the weighting, the fit must find the truth, not the grid's 0.5 ms per row
    served = synthetic_log(300, seed=1)
    coef = fit_served(served, FIXED, GRID, fit_cold=True, served_terms=True, weighting=weighting)
    assert coef["served_bucket_s"] == {str(b): pytest.approx(v, rel=1e-6) for b, v in FIXED.items()}
    assert coef["seq_s"] == pytest.approx(SEQ_S, rel=1e-6)
    assert coef["single_page_s"] == pytest.approx(SINGLE_PAGE_S, rel=1e-6)
    assert coef["block_page_s"] == pytest.approx(BLOCK_PAGE_S, rel=1e-6)
    assert [coef[k] for k in COLD_TERMS] == pytest.approx(COLD, rel=1e-6)


def test_served_fit_recovers_the_block_step_terms_a_grid_put_on_the_buckets_tokens():
    # a grid whose few large mixed steps charged the prefill attention's block steps by the
    # bucket's tokens alone (as a speculating profile's did): the served steps' truth comes back
    served = synthetic_log(300, seed=11, block_steps=True)
    grid = {**GRID, "block_chunk_token_s": 1e-5}
    for weighting in ("mean_relative", "absolute"):
        coef = fit_served(served, FIXED, grid, fit_cold=True, served_terms=True, weighting=weighting)
        assert coef["block_chunk_s"] == pytest.approx(BLOCK_CHUNK_S, rel=1e-6)
        assert coef["block_chunk_token_s"] == pytest.approx(BLOCK_CHUNK_TOKEN_S, rel=1e-6)
        assert coef["served_bucket_s"] == {str(b): pytest.approx(v, rel=1e-6) for b, v in FIXED.items()}
        assert coef["seq_s"] == pytest.approx(SEQ_S, rel=1e-6)


@pytest.mark.parametrize("weighting", ["absolute", "balanced"])
def test_launch_fit_recovers_the_loops_host_time_and_ignores_a_stall(weighting):
    # every step holds a next launch timed exactly by LAUNCH; one step's host time is a 50 ms
    # stall (a garbage collection): left out, it cannot move the fit
    served = with_launches(synthetic_log(300, seed=4), seed=5)
    served[7] = {**served[7], "host_s": 0.05}
    coef = fit_launch(served, weighting)
    assert [coef[k] for k in LAUNCH_TERMS] == pytest.approx(LAUNCH, rel=1e-6)
    assert fit_launch(synthetic_log(10, seed=4)) == dict.fromkeys(LAUNCH_TERMS + HELD_TERMS, 0.0)  # no launch recorded
    assert [coef[k] for k in HELD_TERMS] == [0.0, 0.0]  # no step call recorded: no held launch


# what a prefill plan's launch takes more when its call finds the device idle (HELD_TERMS' order)
HELD = (6e-4, 1.5e-6)


def test_launch_fit_recovers_the_held_terms_apart_from_the_launch_terms():
    # the launches of `with_launches`, each with its step call: 0.1 ms where it queued the step,
    # 1 ms where a prefill plan's call found the device idle and ran the step (every other
    # prefill launch), whose host time then holds HELD more. Both term sets come back exactly;
    # a decode plan's long call is no held launch, and read as one it would spoil the fit.
    served = with_launches(synthetic_log(300, seed=4), seed=5)
    held = 0
    for i, s in enumerate(served):
        call = 1e-4
        if s["next_prefill_rows"]:
            held += 1
            if held % 2:
                call = 1e-3
                s["host_s"] += HELD[0] + HELD[1] * s["next_tokens"]
        elif i % 7 == 0:
            call = 1e-3
        s["next_dispatch_s"] = call
    coef = fit_launch(served, "absolute")
    assert [coef[k] for k in LAUNCH_TERMS] == pytest.approx(LAUNCH, rel=1e-6)
    assert [coef[k] for k in HELD_TERMS] == pytest.approx(HELD, rel=1e-6)


def test_a_step_whose_share_a_prefill_launch_set_stays_out_of_the_step_fit():
    # Where the host time before a prefill's launch outlasts the step, the step's share is that
    # host time: fitted as the step's, it would raise its bucket's intercept. The steps' own
    # truth must come back; a censored step before decodes alone stays in (its share there is
    # the loop's steady host time), so the log keeps those uncensored.
    served = with_launches(synthetic_log(300, seed=6), seed=7)
    assert sum(1 for s in served if censored(s) and s["next_prefill_rows"]) > 20
    served = [s for s in served if not (censored(s) and not s["next_prefill_rows"])]
    coef = fit_served(served, FIXED, GRID, fit_cold=True, served_terms=True, weighting="absolute")
    assert coef["served_bucket_s"] == {str(b): pytest.approx(v, rel=1e-6) for b, v in FIXED.items()}
    assert coef["seq_s"] == pytest.approx(SEQ_S, rel=1e-6)


def test_uncovered_steps_stay_out_of_the_step_fit_and_an_alone_steps_launch_comes_off_it():
    # A step collected with nothing launched behind it takes the device's remainder alone (10 us
    # here): fitted as a served step it would pull its bucket's intercept down. A step launched
    # with nothing in flight holds its own launch (launch_iter_s, 2 ms, and 0.1 ms a row): taken
    # off, the truth comes back exactly; left on, it raises the intercepts.
    launch = {**dict.fromkeys(LAUNCH_TERMS, 0.0), "launch_iter_s": 2e-3, "launch_seq_s": 1e-4}
    log = synthetic_log(200, seed=8)
    uncovered = [{**s, "measured_s": 1e-5, "uncovered": True} for s in log[:20]]
    alone = [{**s, "alone": True, "rows": int(s["features"][1]), "prefill_rows": 0, "tokens": int(s["features"][1]),
              "measured_s": s["measured_s"] + 2e-3 + 1e-4 * s["features"][1]} for s in log[20:60]]  # fmt: skip
    served = log[60:] + uncovered + alone
    for weighting in ("absolute", "mean_relative"):
        coef = fit_served(served, FIXED, GRID, fit_cold=True, served_terms=True, weighting=weighting, launch=launch)
        assert coef["served_bucket_s"] == {str(b): pytest.approx(v, rel=1e-6) for b, v in FIXED.items()}
        assert coef["seq_s"] == pytest.approx(SEQ_S, rel=1e-6)
    coef = fit_served(served, FIXED, GRID, fit_cold=True, served_terms=True, weighting="absolute")
    assert coef["served_bucket_s"]["4"] > 1.1 * FIXED[4]


def test_drain_fit_by_hand():
    # Shares of steps collected with nothing launched behind them: 20 and 40 us, and 530 us for
    # one launched with nothing in flight too, whose own launch (launch_iter_s 500 us) comes off:
    # 30 us. Summed time: their mean, 30 us; without the third, mean relative error zero: their
    # harmonic mean, 2 / (1/20 + 1/40) = 26.67 us. Held out, after an idle loop, or covered: not
    # fitted. None: no drain (the simulator then charges such a step its whole cost).
    launch = {**dict.fromkeys(LAUNCH_TERMS, 0.0), "launch_iter_s": 5e-4}

    def point(t, **kw):
        return {"measured_s": t, "uncovered": True, "rows": 1, "prefill_rows": 0, "tokens": 1, **kw}

    noise = [point(1.0, held_out=True), point(1.0, idle=True), point(1.0, uncovered=False)]
    pair = [point(2e-5), point(4e-5)]
    assert fit_drain(pair + [point(5.3e-4, alone=True)] + noise, launch, "absolute")["drain_s"] == pytest.approx(3e-5)
    assert fit_drain(pair + noise, launch, "mean_relative")["drain_s"] == pytest.approx(2 / (1 / 2e-5 + 1 / 4e-5))
    assert fit_drain(noise, launch) == {}


def test_collect_fit_by_hand():
    # Steps before a prefill plan: their own times 0.2, 0.4 and 5 ms, the launch 1 ms, the shares
    # 1.1, 1.3 and 5 ms. Each share is predicted as max(own, launch + c x own); the third stays
    # its own time for c up to 0.8. Summed squares: 0.2 (0.2 c - 0.1) + 0.4 (0.4 c - 0.3) = 0,
    # c = 0.7; mean relative error zero: (0.2 c - 0.1) / 1.1 + (0.4 c - 0.3) / 1.3 = 0; balanced:
    # their mean. Shares shorter than the launch: 0 (never negative). None: {}.
    step, launch, share = np.array([2e-4, 4e-4, 5e-3]), np.array([1e-3, 1e-3, 1e-3]), np.array([1.1e-3, 1.3e-3, 5e-3])
    relative = (0.1 / 1.1 + 0.3 / 1.3) / (0.2 / 1.1 + 0.4 / 1.3)
    assert fit_collect(step, launch, share, "absolute")["collect_prefill_share"] == pytest.approx(0.7, abs=1e-3)
    assert fit_collect(step, launch, share, "mean_relative")["collect_prefill_share"] == pytest.approx(relative, abs=1e-3)
    assert fit_collect(step, launch, share, "balanced")["collect_prefill_share"] == pytest.approx((0.7 + relative) / 2, abs=1e-3)
    assert fit_collect(step[:1], launch[:1], np.array([9e-4]), "absolute") == {"collect_prefill_share": 0.0}
    assert fit_collect(np.array([]), np.array([]), np.array([])) == {}


def test_held_out_steps_do_not_enter_the_fit():
    # the held-out round runs 3x slower: were it fitted, the intercepts would move
    fit = synthetic_log(200, seed=2)
    held = [{**s, "held_out": True} for s in synthetic_log(100, seed=3, scale=3.0)]
    coef = fit_served(fit + held, FIXED, GRID, fit_cold=True, served_terms=True, weighting="mean_relative")
    assert coef["served_bucket_s"]["8"] == pytest.approx(FIXED[8], rel=1e-6)
    assert coef["seq_s"] == pytest.approx(SEQ_S, rel=1e-6)


def test_balanced_weighting_is_halfway_between_the_sum_and_the_mean_relative_error_by_hand():
    # one bucket, no other term, steps of 1, 2 and 4 ms: the absolute fit is their mean 7/3 ms, the
    # mean_relative fit their harmonic mean 12/7 ms, balanced the mean of the two, (7/3 + 12/7) / 2 = 85/42 ms
    served = [{"bucket": 4, "features": [0.0] * len(STEP_TERMS), "measured_s": t, "since_larger": 0, "idle": False}
              for t in (1e-3, 2e-3, 4e-3) for _ in range(4)]  # fmt: skip
    grid = {**dict.fromkeys(STEP_TERMS, 0.0), "bucket_s": {4: 1e-3}, "bucket_scale": 1.0}
    fixed = {w: fit_served(served, {4: 1e-3}, grid, weighting=w)["served_bucket_s"]["4"]
             for w in ("absolute", "mean_relative", "balanced")}  # fmt: skip
    assert fixed == {"absolute": pytest.approx(7 / 3 * 1e-3), "mean_relative": pytest.approx(12 / 7 * 1e-3),
                     "balanced": pytest.approx(85 / 42 * 1e-3)}  # fmt: skip
    with pytest.raises(ValueError, match="served_weighting"):
        fit_served(served, {4: 1e-3}, grid, weighting="median")


def _step(regime, measured, predicted, held_out):
    return {"regime": regime, "bucket": 4, "measured_s": measured, "predicted_s": predicted, "idle": False,
            "held_out": held_out}  # fmt: skip


def test_residual_table_is_computed_on_the_held_out_steps_by_hand():
    # a 4-step log: two fitted steps (perfect) and two held out: 1.0 predicted 1.1 (+10%) and
    # 2.0 predicted 1.8 (-10%): mean signed 0, median |error| 10%, total 2.9 / 3.0 - 1 = -3.33%
    log = [_step("light", 1.0, 1.0, False), _step("light", 3.0, 3.0, False),
           _step("light", 1.0, 1.1, True), _step("light", 2.0, 1.8, True)]  # fmt: skip
    t = held_out_residuals(log, min_steps=2)
    light = t["regimes"]["light"]
    assert t["steps"] == "held-out" and light["num_steps"] == 2
    assert light["mean_signed_error"] == pytest.approx(0.0, abs=1e-12)
    assert light["median_abs_error"] == pytest.approx(0.1)
    assert light["total_signed_error"] == pytest.approx(-1 / 30)
    assert not t["failures"] and not t["sparse"]
    # none held out (one serving round): the table is the fit's own steps, and says so
    t = held_out_residuals([{**s, "held_out": False} for s in log], min_steps=2)
    assert t["steps"] == "in-sample" and t["regimes"]["light"]["num_steps"] == 4


def test_served_rounds_extend_in_whole_cycles_until_they_take_serving_min_s():
    # 4 rounds of 2 s make 8 of the 40 s: 16 more rounds (4 cycles of 4) reach it
    assert serving_round_count(4, 2.0, 40.0) == 20
    # 3 s rounds: 12 s, 28 s short, 10 more rounds, rounded up to 3 cycles
    assert serving_round_count(4, 3.0, 40.0) == 16
    assert serving_round_count(4, 10.0, 40.0) == 4  # 4 rounds reach it already
    assert serving_round_count(4, 36.0, 40.0) == 4  # a large model's rounds: never fewer
    assert serving_round_count(4, 2.0, 0.0) == 4  # serving_min_s=0: exactly serving_rounds
    assert serving_round_count(1, 5.0, 12.0) == 5  # 7 s short: 2 rounds, 1 cycle
    assert serving_round_count(4, 0.1, 40.0) == 32  # the cap
    assert serving_round_count(40, 0.1, 100.0) == 40  # ... never below what was asked for


def test_the_anchor_is_timed_before_four_evenly_spread_rounds():
    assert anchor_rounds(1) == {0} and anchor_rounds(2) == {0, 1} and anchor_rounds(4) == {0, 1, 2, 3}
    assert anchor_rounds(6) == {0, 1, 3, 4}
    assert anchor_rounds(16) == {0, 4, 8, 12} and anchor_rounds(20) == {0, 5, 10, 15}


def test_odd_rounds_are_held_out_and_each_round_draws_its_own_requests():
    assert [held_out_round(r, 4) for r in range(4)] == [False, True, False, True]
    assert held_out_round(0, 1) is False
    cfg = RunConfig(model=ModelConfig(max_model_len=128))
    r0, r1 = serving_runs(cfg, 10.0, 0), serving_runs(cfg, 10.0, 1)
    assert [a for a, _ in r0] == [b for b, _ in r1]  # the same runs (bursts, static, Poisson 30/60/90%)
    assert all(a.seed != b.seed for (_, a), (_, b) in zip(r0, r1))
    # rounds 0 and 1 prompt up to half of the 128 tokens, rounds 2 and 3 up to an eighth, round 4
    # half again (a shared-prefix prompt: its prefix and its own suffix)
    def top(c):
        wl = c.workload
        return wl.prompt_len.high + (wl.shared_prefix.prefix_len if wl.name == "shared_prefix" else 0)

    longest = [{top(c) for _, c in serving_runs(cfg, 10.0, r)} for r in range(5)]
    assert longest == [{64}, {64}, {16}, {16}, {64}]
    # the prefix-cached burst: half its longest prompt is a prefix shared with other prompts
    prefix = dict(r0)["fcfs_prefix"]
    assert prefix.cache.prefix_caching and prefix.workload.arrival == "all_at_once"
    assert (prefix.workload.shared_prefix.prefix_len, prefix.workload.prompt_len.high) == (32, 32)
    assert not any(c.cache.prefix_caching for name, c in r0 if name != "fcfs_prefix")


def test_refit_from_a_recorded_profile(tmp_path):
    # a recorded profile: one grid step, the served log (rounds 0 fitted, 1 held out), no gaps
    served = [{**s, "round": 0, "held_out": False} for s in synthetic_log(200, seed=4)]
    served += [{**s, "round": 1, "held_out": True} for s in synthetic_log(100, seed=5)]
    grid_step = {"kind": "decode", "bucket": 4, "features": [1.0, 4, 0, 0, 0, 0, 8, 0, 4], "measured_s": 2e-3}
    profile = {"steps": [grid_step], "swaps": [], "served": served, "gaps": [], "coefficients": {
        "bucket_s": {str(b): v for b, v in FIXED.items()}}, "wake": {"wake_s": 1e-4, "wake_ramp_s": 1e-2}}  # fmt: skip
    out = refit(profile, fit_cold=True, served_terms=True, served_weighting="balanced")
    assert out["coefficients"]["seq_s"] == pytest.approx(SEQ_S, rel=1e-6)
    table = out["residuals"]["by_regime"]
    # the held-out round is drawn from the same truth: no error, 100 steps
    assert table["steps"] == "held-out" and table["regimes"]["light"]["num_steps"] == 100
    assert abs(table["regimes"]["light"]["mean_signed_error"]) < 1e-9 and not table["failures"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    refit_main([str(path), "--out", str(tmp_path / "refit.json")])
    assert json.loads((tmp_path / "refit.json").read_text())["served_weighting"] == "mean_relative"  # the profile's default
    with pytest.raises(ValueError, match="gaps"):
        refit({k: v for k, v in profile.items() if k != "gaps"}, True, True, "mean_relative")


def test_the_residual_table_predicts_a_share_as_the_simulator_charges_it():
    # Fitted round: steps timed by the truth, each with a next launch timed by LAUNCH, and ten
    # collected with nothing launched behind them, 30 us each. Held-out round, the same truth:
    # steps launched with nothing in flight take their own launch more (a decode plan of their
    # rows and tokens: LAUNCH's fixed, per-row and per-token terms), and steps collected with
    # nothing behind them 30 us.
    # Predicted as the simulator charges them, the held-out round has no error.
    def decode_plan(s):
        return {**s, "rows": int(s["features"][1]), "prefill_rows": 0, "tokens": int(s["features"][1])}

    fitted = [s for s in with_launches(synthetic_log(200, seed=9), seed=10) if not censored(s)]
    fitted += [{**s, "measured_s": 3e-5, "uncovered": True} for s in synthetic_log(10, seed=11)]
    held = [decode_plan(s) for s in synthetic_log(60, seed=12)]
    for s in held[:20]:
        s.update(alone=True, measured_s=s["measured_s"] + LAUNCH[0] + (LAUNCH[1] + LAUNCH[4]) * s["rows"])
    for s in held[20:40]:
        s.update(uncovered=True, measured_s=3e-5)
    served = [{**s, "round": 0, "held_out": False} for s in fitted] + [{**s, "round": 1, "held_out": True} for s in held]
    grid_step = {"kind": "decode", "bucket": 4, "features": [1.0, 4, 0, 0, 0, 0, 8, 0, 4], "measured_s": 2e-3}
    profile = {"steps": [grid_step], "swaps": [], "served": served, "gaps": [], "coefficients": {
        "bucket_s": {str(b): v for b, v in FIXED.items()}}, "wake": {"wake_s": 1e-4, "wake_ramp_s": 1e-2}}  # fmt: skip
    out = refit(profile, fit_cold=True, served_terms=True, served_weighting="mean_relative")
    assert out["coefficients"]["drain_s"] == pytest.approx(3e-5)
    light = out["residuals"]["by_regime"]["regimes"]["light"]
    assert light["num_steps"] == 60
    assert abs(light["mean_signed_error"]) < 1e-6 and abs(light["total_signed_error"]) < 1e-6


def test_refit_keeps_the_cold_terms_off_for_a_profile_made_without_the_cpu_terms(tmp_path):
    # a profile made with cpu_terms=false (an accelerator's default): its served steps are 1 ms
    # slower on the step after a larger bucket's, but the profiler fitted no cold terms, and a
    # refit with its default options must not add them (the simulator would then read step history)
    served = [{**s, "round": 0, "held_out": False} for s in synthetic_log(200, seed=4)]
    grid_step = {"kind": "decode", "bucket": 4, "features": [1.0, 4, 0, 0, 0, 0, 8, 0, 4], "measured_s": 2e-3}
    profile = {"steps": [grid_step], "swaps": [], "served": served, "gaps": [], "coefficients": {
        "bucket_s": {str(b): v for b, v in FIXED.items()}}, "wake": None, "cpu_terms": False,
        "fit_cold": False}  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    refit_main([str(path), "--out", str(tmp_path / "refit.json")])
    out = json.loads((tmp_path / "refit.json").read_text())
    assert [out["coefficients"][k] for k in COLD_TERMS] == [0.0, 0.0, 0.0, 0.0]
    assert out["fit_cold"] is False
    # with the CPU term set on, the same steps' cold terms are fitted (the truth: COLD)
    on = refit({**profile, "cpu_terms": True}, fit_cold=True, served_terms=True, served_weighting="mean_relative")
    assert on["fit_cold"] is True and on["coefficients"]["cold_s"] == pytest.approx(COLD[0], rel=1e-3)


def test_refit_to_a_path_it_cannot_write_fails_in_one_line_naming_it(tmp_path):
    served = [{**s, "round": 0, "held_out": False} for s in synthetic_log(50, seed=4)]
    grid_step = {"kind": "decode", "bucket": 4, "features": [1.0, 4, 0, 0, 0, 0, 8, 0, 4], "measured_s": 2e-3}
    profile = {"steps": [grid_step], "swaps": [], "served": served, "gaps": [], "coefficients": {
        "bucket_s": {str(b): v for b, v in FIXED.items()}}, "wake": None}  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "refit.json"  # under a regular file: no one can create it, root included
    with pytest.raises(SystemExit) as exit_:
        refit_main([str(path), "--out", str(target)])
    assert str(exit_.value.code) == f"cbjax.profile.refit: error: cannot write {target}: Not a directory"
