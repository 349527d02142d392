"""`cbjax.profile.anchor`: the machine-speed anchor's record, its speed test, and its config
surviving profile.json."""

from __future__ import annotations

import json

import pytest

from cbjax.config import LengthConfig, RunConfig, SchedulerConfig, SpecConfig, WorkloadConfig
from cbjax.profile.anchor import anchor_config, anchor_record, anchor_spec, anchor_speed, on_speed, spread, steady, time_anchor


def test_the_record_keeps_every_timing_and_their_median():
    rec = anchor_record({"seed": 1}, [0.12, 0.10, 0.11, 0.13, 0.30])
    assert rec["timings_s"] == [0.12, 0.10, 0.11, 0.13, 0.30] and rec["reference_s"] == 0.12
    assert spread(rec) == (pytest.approx(0.10 / 0.12), pytest.approx(0.30 / 0.12))
    assert spread(None) is None
    # 0.10 .. 0.30 over 0.12: a spread of 167%, not steady; within 10% of each other, steady
    assert not steady(rec) and steady(anchor_record({}, [0.100, 0.105, 0.109])) and not steady(None)


def test_speed_is_the_mean_of_the_anchors_around_a_run_and_both_must_be_on_speed():
    assert anchor_speed(0.11, 0.13, 0.10) == pytest.approx(1.2)
    assert on_speed(0.104, 0.096, 0.10) and not on_speed(0.10, 0.106, 0.10)
    # one anchor 10% fast and one 10% slow average to 1.0, but the run is not on speed
    assert anchor_speed(0.09, 0.11, 0.10) == pytest.approx(1.0) and not on_speed(0.09, 0.11, 0.10)
    with pytest.raises(ValueError, match="reference_s"):
        anchor_speed(0.1, 0.1, 0.0)


def test_the_spec_rebuilds_the_run_through_json_and_a_missing_key_is_named():
    run = RunConfig(
        scheduler=SchedulerConfig(name="fcfs", max_num_seqs=8, chunked_prefill=False),
        workload=WorkloadConfig(num_requests=24, prompt_len=LengthConfig(dist="uniform", low=8, high=64)),
        seed=1101,
    )
    spec = json.loads(json.dumps(anchor_spec(run)))
    rebuilt = anchor_config(RunConfig(), spec)
    assert (rebuilt.scheduler, rebuilt.workload, rebuilt.seed) == (run.scheduler, run.workload, 1101)
    assert rebuilt.workload.prompt_len == LengthConfig(dist="uniform", low=8, high=64)
    del spec["workload"]
    with pytest.raises(ValueError, match="workload"):
        anchor_config(RunConfig(), spec)


def test_a_speculating_profile_s_anchor_speculates_when_rebuilt():
    # the anchor is one of the profile's bursts, served with the profile's speculation: timed
    # without it, a calibration would compare another run's time with the reference
    run = RunConfig(spec=SpecConfig(method="ngram", num_tokens=3), seed=7)
    rebuilt = anchor_config(RunConfig(), json.loads(json.dumps(anchor_spec(run))))
    assert rebuilt.spec == SpecConfig(method="ngram", num_tokens=3)
    # an anchor recorded before speculation was kept: the run's own (no speculation)
    old = {k: v for k, v in anchor_spec(run).items() if k != "spec"}
    assert anchor_config(RunConfig(), old).spec == RunConfig().spec


def test_a_timing_is_the_median_of_its_runs_and_long_runs_stop_early():
    short = iter([0.3, 0.1, 0.2, 0.5, 0.4, 9.0])
    assert time_anchor(lambda: next(short), runs=5, budget_s=10.0) == 0.3  # median of the first 5
    long = iter([0.6, 0.5, 9.0])
    assert time_anchor(lambda: next(long), runs=5, budget_s=1.0) == pytest.approx(0.55)  # 1.1 s >= 1 s: 2 runs
