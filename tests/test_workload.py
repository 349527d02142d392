"""Workloads: synthetic draws, trace formats, Azure timestamps and the bad-input policy."""

from __future__ import annotations

import json
import math
from datetime import date, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbjax.config import LengthConfig, ModelConfig, RunConfig, WorkloadConfig
from cbjax.config.workload import SharedPrefixConfig
from cbjax.workload import build_workload
from cbjax.workload.synthetic import arrival_times, sample_lengths
from cbjax.workload.trace import load_trace, parse_timestamp

AZURE_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "AzureLLMInferenceTrace_code.csv"


def _key(r):
    s = r.sampling
    return (r.request_id, r.arrival_s, r.prompt_len, tuple(r.prompt_ids()), r.target_output_len,
            s.max_tokens, s.seed, s.ignore_eos, r.input_error)  # fmt: skip


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def _trace(tmp_path, name, text, **kw):
    return load_trace(WorkloadConfig(name="trace", path=str(_write(tmp_path, name, text)), **kw), seed=0)


# ---- synthetic ----


def test_same_seed_same_workload_other_seed_differs():
    cfg = WorkloadConfig(num_requests=64, arrival="poisson", rate=10.0)
    assert [_key(r) for r in build_workload(cfg, 3)] == [_key(r) for r in build_workload(cfg, 3)]
    assert [_key(r) for r in build_workload(cfg, 3)] != [_key(r) for r in build_workload(cfg, 4)]


def test_output_distribution_does_not_move_arrivals_or_prompts():
    a = WorkloadConfig(num_requests=50, arrival="gamma", cv=2.0)
    b = WorkloadConfig(num_requests=50, arrival="gamma", cv=2.0, output_len=LengthConfig(value=7))
    ra, rb = build_workload(a, 1), build_workload(b, 1)
    assert [(r.arrival_s, r.prompt_ids()) for r in ra] == [
        (r.arrival_s, r.prompt_ids()) for r in rb
    ]  # fmt: skip
    assert all(r.target_output_len == 7 for r in rb)


def test_synthetic_request_fields():
    cfg = WorkloadConfig(num_requests=40, arrival="poisson", vocab_size=50,
                         output_len=LengthConfig(dist="uniform", low=1, high=20, max=20))  # fmt: skip
    reqs = build_workload(cfg, 0)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert sorted(int(r.request_id) for r in reqs) == list(range(40))
    for r in reqs:
        assert len(r.prompt_ids()) == r.prompt_len and 16 <= r.prompt_len <= 512
        assert all(0 <= t < 50 and type(t) is int for t in r.prompt_ids())
        assert r.sampling.max_tokens == r.target_output_len and r.sampling.ignore_eos
        assert r.input_error is None
    assert len({r.sampling.seed for r in reqs}) > 30


def test_max_tokens_caps_sampling_but_not_target():
    out = LengthConfig(dist="fixed", value=100)
    reqs = build_workload(WorkloadConfig(num_requests=3, output_len=out, max_tokens=10), 0)
    assert [(r.target_output_len, r.sampling.max_tokens) for r in reqs] == [(100, 10)] * 3


def test_all_at_once_arrives_at_zero():
    assert build_workload(WorkloadConfig(num_requests=5), 0)[-1].arrival_s == 0.0


def test_poisson_mean_gap():
    times = arrival_times("poisson", 20000, 4.0, 1.0, np.random.default_rng(0))
    assert times[0] > 0  # a renewal process: the first arrival is one gap after t=0
    gaps = np.diff(times, prepend=0.0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_mean_and_cv(cv):
    gaps = np.diff(arrival_times("gamma", 20000, 2.0, cv, np.random.default_rng(1)), prepend=0.0)
    assert gaps.mean() == pytest.approx(0.5, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


def test_a_fixed_length_outside_its_bounds_fails_instead_of_being_clipped():
    # output_len's default max is 1024: a fixed 3000 would silently become 1024-token outputs
    with pytest.raises(ValueError, match=r"workload\.output_len\.value must be in \[1, 1024\].*got 3000"):
        WorkloadConfig(output_len=LengthConfig(dist="fixed", value=3000, max=1024))
    with pytest.raises(ValueError, match=r"workload\.turns\.value must be in \[2, 64\]"):
        WorkloadConfig(turns=LengthConfig(dist="fixed", value=1, min=2, max=64))
    ok = WorkloadConfig(output_len=LengthConfig(dist="fixed", value=3000, max=3000))
    assert build_workload(ok, 0)[0].target_output_len == 3000


def test_spec_acceptance_draws_the_3000_token_outputs_it_describes():
    from test_config_schema import composed

    cfg = composed("experiment=spec_acceptance", "workload.num_requests=2")
    assert [r.target_output_len for r in build_workload(cfg.workload, 0)] == [3000, 3000]


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert (sample_lengths(LengthConfig(dist="fixed", value=37), 100, rng) == 37).all()
    uniform = sample_lengths(LengthConfig(dist="uniform", low=3, high=6), 2000, rng)
    assert set(uniform.tolist()) == {3, 4, 5, 6}
    capped = sample_lengths(LengthConfig(dist="exponential", mean=100.0, max=120), 20000, rng)
    assert capped.max() == 120 and capped.min() >= 1
    free = sample_lengths(LengthConfig(dist="exponential", mean=50.0, max=100000), 20000, rng)
    assert free.mean() == pytest.approx(50.0, rel=0.05)
    logn = sample_lengths(LengthConfig(dist="lognormal", mean=200.0, sigma=0.5, max=100000), 20000, rng)
    assert logn.mean() == pytest.approx(200.0, rel=0.03)
    assert np.median(logn) < 200.0  # the mean, not the median, is pinned


@settings(max_examples=50, deadline=None)
@given(
    dist=st.sampled_from(["fixed", "uniform", "exponential", "lognormal"]),
    a=st.integers(1, 300),
    b=st.integers(1, 300),
    mean=st.floats(0.1, 1e4),
    sigma=st.floats(0.0, 3.0),
)
def test_lengths_stay_in_bounds(dist, a, b, mean, sigma):
    lo, hi = min(a, b), max(a, b)
    cfg = LengthConfig(dist=dist, value=a, low=lo, high=hi, mean=mean, sigma=sigma, min=lo, max=hi)
    draws = sample_lengths(cfg, 200, np.random.default_rng(a))
    assert draws.dtype == np.int64 and draws.min() >= lo and draws.max() <= hi


def test_synthetic_prompt_ids_are_seeded_per_request_and_drawn_lazily():
    cfg = WorkloadConfig(num_requests=3, vocab_size=1000)
    a, b = build_workload(cfg, seed=9), build_workload(cfg, seed=9)
    assert all(r.prompt_token_ids is None for r in a)
    assert [r.prompt_ids() for r in a] == [r.prompt_ids() for r in b]
    assert [len(r.prompt_ids()) for r in a] == [r.prompt_len for r in a]
    assert a[0].prompt_ids() != a[1].prompt_ids()


# ---- Azure timestamps ----


def test_parse_timestamp_hand_checked():
    day = date(2023, 11, 16).toordinal() * 86400
    whole, frac = parse_timestamp("2023-11-16 18:17:03.9799600")
    assert whole == day + 18 * 3600 + 17 * 60 + 3 and frac == pytest.approx(0.97996, abs=1e-12)
    assert parse_timestamp("2023-11-16T18:17:03") == (whole, 0.0)
    assert parse_timestamp("2023-11-16 19:17:03.5+01:00") == (whole, 0.5)


@settings(max_examples=100, deadline=None)
@given(
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)),
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)),
    st.integers(0, 9),
)
def test_parse_timestamp_differences_match_datetime(a, b, seventh):
    # Seven fractional digits: datetime's microseconds plus one more digit.
    def text(t):
        return t.strftime("%Y-%m-%d %H:%M:%S.%f") + str(seventh)

    (wa, fa), (wb, fb) = parse_timestamp(text(a)), parse_timestamp(text(b))
    assert (wb - wa) + (fb - fa) == pytest.approx((b - a) / timedelta(seconds=1), abs=1e-6)


# ---- trace formats ----

AZURE_TEXT = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 23:59:59.9999999,1,2
2023-11-17 00:00:01.5000000,7,1
"""


def test_azure_format(tmp_path):
    reqs = _trace(tmp_path, "az.csv", AZURE_TEXT, vocab_size=100)
    arrivals = [0.0, 0.052, 20576.0200399, 20577.52004]  # 18:17:03.97996 -> 24:00:01.5 = 5:42:57.52004
    assert [r.arrival_s for r in reqs] == pytest.approx(arrivals, abs=1e-9)
    assert [(r.prompt_len, r.target_output_len, r.sampling.max_tokens) for r in reqs] == [
        (4808, 10, 10), (3180, 8, 8), (1, 2, 2), (7, 1, 1)
    ]  # fmt: skip
    assert all(r.sampling.ignore_eos and r.input_error is None for r in reqs)
    assert [r.request_id for r in reqs] == ["0", "1", "2", "3"]
    assert all(len(r.prompt_ids()) == r.prompt_len and max(r.prompt_ids()) < 100 for r in reqs)
    again = _trace(tmp_path, "az2.csv", AZURE_TEXT, vocab_size=100)
    assert [_key(r)[1:] for r in again] == [_key(r)[1:] for r in reqs]


def test_azure_time_scale_limit_and_forced_format(tmp_path):
    reqs = _trace(tmp_path, "az.txt", AZURE_TEXT, format="azure", time_scale=2.0, limit=2)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.026])


@pytest.mark.skipif(not AZURE_TRACE.is_file(), reason=f"Azure trace not found at {AZURE_TRACE}")
def test_real_azure_trace_first_rows():
    cfg = WorkloadConfig(name="trace", path=str(AZURE_TRACE), limit=200)
    reqs = build_workload(cfg, 0)
    assert len(reqs) == 200 and all(r.input_error is None for r in reqs)
    first = [0.0, 0.052, 0.098189, 0.140684, 0.444994, 0.539187]  # hand-subtracted timestamps
    assert [r.arrival_s for r in reqs[:6]] == pytest.approx(first, abs=1e-9)
    assert [r.prompt_len for r in reqs[:6]] == [4808, 3180, 110, 7433, 34, 374]
    assert [r.target_output_len for r in reqs[:6]] == [10, 8, 27, 14, 12, 14]


def test_plain_csv(tmp_path):
    text = "arrival_s,prompt_len,output_len\n0.5,3,4\n\n0.25,2,1\n"
    reqs = build_workload(WorkloadConfig(name="trace", path=str(_write(tmp_path, "t.csv", text))), 0)
    assert [(r.request_id, r.arrival_s, r.prompt_len, r.target_output_len) for r in reqs] == [
        ("1", 0.25, 2, 1), ("0", 0.5, 3, 4)
    ]  # fmt: skip
    assert all(r.sampling.max_tokens == r.target_output_len and r.sampling.ignore_eos for r in reqs)


def test_csv_columns_in_any_order_and_workload_max_tokens(tmp_path):
    reqs = _trace(tmp_path, "t.csv", "output_len,arrival_s,prompt_len\n50,1.0,3\n", max_tokens=8)
    assert (reqs[0].arrival_s, reqs[0].prompt_len, reqs[0].target_output_len) == (1.0, 3, 50)
    assert reqs[0].sampling.max_tokens == 8


def test_jsonl(tmp_path):
    lines = [
        {"arrival_s": 0.0, "prompt_token_ids": [5, 6, 7], "max_tokens": 4, "temperature": 0.7, "top_k": 5,
         "top_p": 0.9, "seed": 11, "priority": 2, "client_id": "a", "stop_token_ids": [1],
         "request_id": "x"},
        {"arrival_s": 1.0, "prompt_len": 4, "output_len": 6},
        {"arrival_s": 2.0, "prompt_len": 2, "output_len": 6, "max_tokens": 3, "ignore_eos": False},
        {"arrival_s": 3.0, "prompt_len": 1, "max_tokens": 9, "request_id": 17},
    ]  # fmt: skip
    dumped = [json.dumps(x) for x in lines]
    text = "\n".join(dumped[:2]) + "\n\n" + "\n".join(dumped[2:])  # a blank line is skipped
    r = _trace(tmp_path, "t.jsonl", text)
    assert [x.input_error for x in r] == [None] * 4
    assert [x.request_id for x in r] == ["x", "1", "2", "17"]
    s = r[0].sampling
    assert (r[0].prompt_token_ids, r[0].prompt_len, r[0].target_output_len) == ([5, 6, 7], 3, None)
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.seed) == (4, 0.7, 5, 0.9, 11)
    assert (s.stop_token_ids, s.ignore_eos, r[0].priority, r[0].client_id) == ((1,), False, 2, "a")
    lengths = [(x.target_output_len, x.sampling.max_tokens, x.sampling.ignore_eos) for x in r[1:]]
    assert lengths == [(6, 6, True), (6, 3, False), (None, 9, False)]
    assert r[1].prompt_len == 4
    assert r[3].arrival_s == 3.0 and len(r[3].prompt_ids()) == 1


def test_synthetic_ids_reproducible_and_limit_keeps_prefix(tmp_path):
    text = "arrival_s,prompt_len,output_len\n" + "".join(f"{i},{i + 3},2\n" for i in range(6))
    full = _trace(tmp_path, "t.csv", text)
    assert [_key(r) for r in _trace(tmp_path, "u.csv", text, limit=3)] == [_key(r) for r in full[:3]]
    other = load_trace(WorkloadConfig(name="trace", path=str(tmp_path / "t.csv")), seed=1)
    assert [r.prompt_ids() for r in other] != [r.prompt_ids() for r in full]


# ---- bad input ----


def test_malformed_csv_lines_become_input_errors(tmp_path):
    text = "arrival_s,prompt_len,output_len\n1.5,3,4\nxyz,abc,5\n2.0,4\n-1,2,2\nnan,2,2\n3.0,0,0\n"
    r = _trace(tmp_path, "trace.csv", text)
    assert len(r) == 6
    assert r[0].input_error is None
    assert r[1].input_error == (
        "trace.csv line 3: arrival_s 'xyz' is not a number; prompt_len 'abc' is not an integer"
    )
    assert (r[1].arrival_s, r[1].prompt_len, r[1].prompt_ids()) == (1.5, 0, [])
    assert r[1].target_output_len == 5
    assert r[2].input_error.startswith("trace.csv line 4: expected 3 fields") and r[2].arrival_s == 1.5
    assert r[3].input_error == "trace.csv line 5: arrival_s must be a finite number >= 0, got -1.0"
    assert r[3].arrival_s == 0.0
    assert "line 6: arrival_s must be a finite number >= 0, got nan" in r[4].input_error
    # Empty prompts and max_tokens < 1 are the scheduler's to reject, not the reader's.
    assert (r[5].input_error, r[5].prompt_len, r[5].sampling.max_tokens) == (None, 0, 0)


def test_malformed_azure_lines(tmp_path):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.5,4,1\n2023-13-16 18:17:04.0,4,1\n"
    r = _trace(tmp_path, "az.csv", text)
    bad = "TIMESTAMP '2023-13-16 18:17:04.0' is not a valid date and time"
    assert r[1].input_error == f"az.csv line 3: {bad}"
    assert r[1].arrival_s == 0.0 and r[1].prompt_len == 4


def test_malformed_jsonl_lines(tmp_path):
    good = '{"arrival_s": 1.0, "prompt_len": 2, "output_len": 3}'
    lines = [
        good,
        '{"arrival_s": 2.0, "prompt_len": 2',
        '{"arrival_s": "2", "prompt_len": 2, "output_len": 3}',
        '{"prompt_len": 2, "output_len": 3}',
        '{"arrival_s": 2.0, "prompt_len": 2, "output_len": 3, "temprature": 0.5}',
        '[1, 2]',
        '{"arrival_s": 2.0, "prompt_token_ids": [1, -4], "max_tokens": 3}',
        '{"arrival_s": 2.0, "prompt_len": 2}',
        '{"arrival_s": 2.0, "prompt_token_ids": [], "max_tokens": 0, "request_id": "0"}',
    ]  # fmt: skip
    r = _trace(tmp_path, "t.jsonl", "\n".join(lines))
    errors = [x.input_error for x in r]
    assert errors[0] is None
    assert errors[1].startswith("t.jsonl line 2: invalid JSON")
    assert errors[2] == "t.jsonl line 3: arrival_s '2' is not a number"
    assert errors[3] == "t.jsonl line 4: arrival_s is missing"
    assert errors[4].startswith("t.jsonl line 5: unknown key 'temprature'")
    assert errors[5] == "t.jsonl line 6: expected a JSON object, got list"
    assert errors[6] == "t.jsonl line 7: prompt_token_ids[1] -4 is not a token id (an integer >= 0)"
    assert errors[7] == "t.jsonl line 8: needs max_tokens or output_len"
    # line 9's explicit id '0' is line 1's default index: the default yields, nothing is rejected
    assert errors[8] is None and r[8].request_id == "0" and r[0].request_id == "0@line1"
    assert all(x.arrival_s == 1.0 for x in r[1:4])  # the previous valid arrival
    assert len({x.request_id for x in r}) == len(r)
    assert all(len(x.prompt_ids()) == x.prompt_len for x in r)


def test_whole_file_problems_raise_naming_the_path(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(ValueError, match="nope.csv"):
        build_workload(WorkloadConfig(name="trace", path=str(missing)), 0)
    bad = _write(tmp_path, "bad.csv", "time,prompt,output\n1,2,3\n")
    with pytest.raises(ValueError, match=r"bad\.csv.*arrival_s,prompt_len,output_len"):
        load_trace(WorkloadConfig(name="trace", path=str(bad)), 0)
    plain = _write(tmp_path, "plain.csv", "arrival_s,prompt_len,output_len\n1,2,3\n")
    with pytest.raises(ValueError, match=r"plain\.csv.*TIMESTAMP,ContextTokens,GeneratedTokens"):
        load_trace(WorkloadConfig(name="trace", path=str(plain), format="azure"), 0)
    with pytest.raises(ValueError, match=r"plain\.csv: no line is valid JSON"):
        load_trace(WorkloadConfig(name="trace", path=str(plain), format="jsonl"), 0)
    empty = _write(tmp_path, "empty.jsonl", "\n\n")
    with pytest.raises(ValueError, match="empty.jsonl is empty"):
        load_trace(WorkloadConfig(name="trace", path=str(empty)), 0)
    header_only = _write(tmp_path, "h.csv", "arrival_s,prompt_len,output_len\n")
    with pytest.raises(ValueError, match="h.csv holds no requests"):
        load_trace(WorkloadConfig(name="trace", path=str(header_only)), 0)


def test_build_workload_sorts_stably(tmp_path):
    text = "arrival_s,prompt_len,output_len\n2,1,1\n1,1,1\n2,1,1\n1,1,1\n"
    reqs = build_workload(WorkloadConfig(name="trace", path=str(_write(tmp_path, "t.csv", text))), 0)
    assert [r.request_id for r in reqs] == ["1", "3", "0", "2"]
    assert not any(math.isnan(r.arrival_s) for r in reqs)


def test_a_shared_prefix_with_no_room_in_the_context_fails_at_startup_naming_both_lengths():
    def run_cfg(prefix_len, max_model_len):
        workload = WorkloadConfig(name="shared_prefix", shared_prefix=SharedPrefixConfig(prefix_len=prefix_len))
        return RunConfig(workload=workload, model=ModelConfig(max_model_len=max_model_len))

    with pytest.raises(ValueError) as err:
        run_cfg(2048, 1024)
    msg = str(err.value)
    assert "\n" not in msg
    assert "workload.shared_prefix.prefix_len 2048" in msg and "model.max_model_len 1024" in msg
    # a prefix plus the shortest suffix (workload.prompt_len.min, 1) must leave a token to generate
    with pytest.raises(ValueError, match=r"prefix_len 1023 plus workload\.prompt_len\.min 1"):
        run_cfg(1023, 1024)
    assert run_cfg(1022, 1024).workload.shared_prefix.prefix_len == 1022


def test_the_trace_knobs_fail_on_other_workloads_instead_of_doing_nothing():
    for name in ("synthetic", "sessions", "shared_prefix"):
        with pytest.raises(ValueError, match=r"^workload.time_scale applies only to workload=trace, got 2.0$"):
            WorkloadConfig(name=name, time_scale=2.0)
        with pytest.raises(ValueError, match=r"^workload.limit applies only to workload=trace, got 5$"):
            WorkloadConfig(name=name, limit=5)
    with pytest.raises(ValueError, match=r"^workload.time_scale must be > 0, got inf$"):
        WorkloadConfig(name="trace", path="t.csv", time_scale=math.inf)
    assert WorkloadConfig(name="trace", path="t.csv", time_scale=2.0, limit=5).limit == 5


def test_a_uniform_range_past_its_bounds_fails_instead_of_piling_on_them():
    with pytest.raises(ValueError, match=r"^workload.prompt_len.high must be <= workload.prompt_len.max \(4096\), "):
        WorkloadConfig(prompt_len=LengthConfig(dist="uniform", low=8, high=8192))
    with pytest.raises(ValueError, match=r"^workload.prompt_len.low must be >= workload.prompt_len.min \(16\), "):
        WorkloadConfig(prompt_len=LengthConfig(dist="uniform", low=8, high=64, min=16))
    rng = np.random.default_rng(0)
    draws = sample_lengths(LengthConfig(dist="uniform", low=4000, high=8192, max=8192), 2000, rng)
    assert draws.min() >= 4000 and draws.max() <= 8192 and (draws > 6000).mean() > 0.4  # none piled on 4096
