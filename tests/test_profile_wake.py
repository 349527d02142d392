"""`cbjax.profile.wake`: the wake after an idle loop fitted on lone requests' TTFT, by hand and
against the simulator's own charge."""

import numpy as np
import pytest

from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.core.timing import StepContext
from cbjax.engine.offline import serve
from cbjax.layout.shapes import plan_shapes
from cbjax.profile.grid import GridPoint, build_schedule
from cbjax.profile.wake import MIN_WAKE_REQUESTS, fit_served_wake, fit_wake, lone_requests
from cbjax.scheduler.core import Scheduler
from cbjax.sim.executor import SimExecutor
from cbjax.sim.profiled import STEP_TERMS, SWAP_TERMS, ProfiledCost, model_coefficients

SHAPES = plan_shapes(4, 128, 4, 64, [4, 16, 64])


def coefficients(**terms) -> dict:
    """Bucket costs alone (4: 1 ms, 16: 2 ms, 64: 4 ms), no loop or wake, plus `terms`."""
    zero = dict.fromkeys(STEP_TERMS + SWAP_TERMS + ("loop_s", "loop_seq_s", "wake_s"), 0.0)
    return {**zero, "bucket_s": {"4": 1e-3, "16": 2e-3, "64": 4e-3}, "bucket_scale": 1.0, "wake_ramp_s": 1.0, **terms}


def test_the_wake_grows_with_the_steps_tokens_by_hand():
    cost = ProfiledCost(model_coefficients(coefficients(wake_s=5e-4, wake_token_s=1e-5, wake_ramp_s=4e-3)), SHAPES)
    decode = build_schedule(GridPoint("decode", [(1, 8)]), SHAPES, 64, 512)
    prefill = build_schedule(GridPoint("prefill", [(12, 0)]), SHAPES, 64, 512)
    # a decode (1 token, bucket 4: 1 ms) after a 10 ms idle, past the ramp: 0.5 + 0.01 ms more;
    # a 12-token prefill (bucket 16: 2 ms) after 2 ms, half the ramp: (0.5 + 0.12) / 2 ms more
    assert cost(decode, StepContext(idle_s=0.01)).total_s == pytest.approx(1e-3 + 5.1e-4)
    assert cost(prefill, StepContext(idle_s=0.002)).total_s == pytest.approx(2e-3 + 3.1e-4)
    assert cost(prefill).total_s == pytest.approx(2e-3)  # busy: no wake


def test_fit_wake_recovers_hand_set_terms_and_ignores_a_stalled_request():
    idles, tokens, extra = [], [], []
    for i in range(70):
        idle = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032)[i % 7]
        n = (8, 32, 64, 128, 256)[i % 5]
        idles.append(idle)
        tokens.append(n)
        extra.append((4e-4 + 3e-6 * n) * min(1.0, idle / 0.004))
    extra[3] += 0.01  # one request stalled 10 ms
    fitted = fit_wake(idles, tokens, extra)
    assert fitted["wake_ramp_s"] == pytest.approx(0.004)
    assert fitted["wake_s"] == pytest.approx(4e-4, rel=1e-3)
    assert fitted["wake_token_s"] == pytest.approx(3e-6, rel=1e-3)


def simulated_record(coef: dict, lengths: list[int], gaps: list[float]) -> dict:
    """Lone requests served by the simulator under `coef` in one run, recorded as
    `measure_served_wake` records the engine's: request i > 0 arrives `gaps[i]` after request
    i - 1 ended (the first, with no step before it, has no idle time)."""
    cost = ProfiledCost(model_coefficients(coef), SHAPES)
    arrivals: list[float] = []
    requests: list = []
    for i, gap in enumerate(gaps):
        arrivals.append(gap if i == 0 else requests[-1].finish_s + gap)
        requests = lone_requests(lengths[: i + 1], arrivals, 512, 0)
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                              CacheConfig(page_size=4, num_pages=64, prefix_caching=False), 128)  # fmt: skip
        serve(requests, scheduler, SimExecutor(cost, pipelined=True))
    rows = [{"pass": 0, "prompt_len": r.prompt_len, "arrival_s": r.arrival_s, "ttft_s": r.first_token_s - r.arrival_s,
             "idle_s": gap if i else None} for i, (r, gap) in enumerate(zip(requests, gaps))]  # fmt: skip
    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128, "pipelined": True}
    return {"settings": settings, "requests": rows}


def test_the_fit_recovers_the_wake_the_simulator_charged():
    # the simulator, charging a known wake, stands in for the engine: the fit, which serves the
    # same requests on the simulator with no wake, gets that wake back
    base = coefficients(launch_iter_s=2e-4, drain_s=1e-4)
    truth = {"wake_s": 6e-4, "wake_token_s": 5e-6, "wake_ramp_s": 0.004}
    lengths = [(8, 16, 32, 48)[i % 4] for i in range(28)]
    gaps = [(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032)[i // 4] for i in range(28)]
    record = simulated_record({**base, **truth}, lengths, gaps)
    fitted = fit_served_wake(record, base, SHAPES)
    assert fitted == pytest.approx(truth, rel=1e-6)
    extra = [r["wake_extra_s"] for r in record["requests"][1:]]
    expected = [(6e-4 + 5e-6 * n) * min(1.0, g / 0.004) for n, g in zip(lengths[1:], gaps[1:])]
    assert extra == pytest.approx(expected, rel=1e-6)


def test_too_few_lone_requests_keep_the_wake_timed_on_the_executor():
    # the first request has no idle time: MIN_WAKE_REQUESTS requests leave one short
    record = simulated_record(coefficients(), [8] * MIN_WAKE_REQUESTS, [0.01] * MIN_WAKE_REQUESTS)
    assert fit_served_wake(record, coefficients(), SHAPES) == {}
    assert fit_served_wake(None, coefficients(), SHAPES) == {}
    assert np.isfinite([r["ttft_s"] for r in record["requests"]]).all()
    record = simulated_record(coefficients(), [8] * (MIN_WAKE_REQUESTS + 1), [0.01] * (MIN_WAKE_REQUESTS + 1))
    assert set(fit_served_wake(record, coefficients(), SHAPES)) == {"wake_s", "wake_token_s", "wake_ramp_s"}
