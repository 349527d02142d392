"""client_service, client_service.csv and metrics.window_s on hand-computed unit-cost runs."""

import csv

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_requests
from cbjax.config import CacheConfig, MetricsConfig, SchedulerConfig, ServiceWeights, SLOConfig
from cbjax.engine.offline import serve
from cbjax.report.metrics import summarize
from cbjax.scheduler.core import Scheduler
from cbjax.report.service import ServiceLog, client_service, service_series, service_summary, write_service_series
from cbjax.sim import SimExecutor
from cbjax.sim.cost import UnitCost


def _run(reqs, max_num_seqs=1, num_pages=64, page_size=16):
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
                      CacheConfig(num_pages=num_pages, page_size=page_size), max_model_len=256)  # fmt: skip
    log = ServiceLog()
    result = serve(reqs, sched, SimExecutor(UnitCost()), on_step=log.on_step)
    return result, log


def _two_clients():
    # a: prompt 4, 2 tokens, at t=0; b: prompt 3, 3 tokens, at t=1. One slot, 1 s per iteration:
    # t=1 a prefill (+1 token), t=2 a's 2nd token (done), t=3 b prefill (+1), t=4 and t=5 b.
    reqs = make_requests([2, 3], prompt_lens=[4, 3], arrivals=[0, 1])
    reqs[0].client_id, reqs[1].client_id = "a", "b"
    return _run(reqs)


def test_client_service_over_the_run_hand_computed():
    result, log = _two_clients()
    assert result.makespan_s == 5.0
    summary = service_summary(result, log, MetricsConfig(), SLOConfig())
    # a: 4 prompt + 2 * 2 tokens = 8 over 5 s; b: 3 + 2 * 3 = 9 over 5 s
    assert summary["client_service"] == pytest.approx({"a": 1.6, "b": 1.8})
    other = MetricsConfig(service_weights=ServiceWeights(input=0.5, output=1.0))
    assert client_service(log, ["a", "b"], other, 0.0, 5.0) == pytest.approx({"a": 4 / 5, "b": 4.5 / 5})


def test_window_restricts_requests_tokens_and_iterations():
    result, log = _two_clients()
    metrics = MetricsConfig(window_s=[1.0, 4.0])
    whole = summarize(result)
    s = {**whole, **service_summary(result, log, metrics, SLOConfig(ttft_s=1.5))}
    assert s["window_s"] == [1.0, 4.0]
    # requests arriving in [1, 4): b only, with its whole latency (it finishes at 5)
    assert (s["num_requests"], s["num_finished"]) == (1, 1)
    assert s["e2e_s_p50"] == 4.0 and s["ttft_s_p50"] == 2.0
    # tokens from iterations ending in (1, 4]: t=2 (a), t=3 (b), t=4 (b)
    assert s["output_tokens"] == 3 and s["throughput_tok_s"] == pytest.approx(1.0)
    # served requests finishing in (1, 4]: a (t=2), whose TTFT 1 s meets the 1.5 s target
    assert s["throughput_req_s"] == pytest.approx(1 / 3) and s["goodput_req_s"] == pytest.approx(1 / 3)
    assert s["slo_attainment"] == 0.0  # b's TTFT is 2 s
    # iterations ending in (1, 4]: batch 1 each; batched tokens 1 (a decode), 3 (b prefill), 1
    assert s["iterations"] == 3 and s["mean_batch_size"] == 1.0 and s["slot_utilization"] == 1.0
    assert s["mean_batched_tokens"] == pytest.approx(5 / 3)
    # service in (1, 4]: a 2 (one token), b 3 + 2 + 2 = 7, over 3 s
    assert s["client_service"] == pytest.approx({"a": 2 / 3, "b": 7 / 3})
    assert s["makespan_s"] == whole["makespan_s"] == 5.0  # whole-run fields stay


def test_service_series_bins_hand_computed(tmp_path):
    result, log = _two_clients()
    rows = service_series(log, ["a", "b"], MetricsConfig(series_bin_s=2.0), result.makespan_s)
    got = [(r["t_start_s"], r["client_id"], r["prompt_tokens"], r["output_tokens"], r["service_per_s"]) for r in rows]
    assert got == [
        (0.0, "a", 4, 2, 4.0), (0.0, "b", 0, 0, 0.0),   # (0, 2]: a's prefill and its 2nd token
        (2.0, "a", 0, 0, 0.0), (2.0, "b", 3, 2, 3.5),   # (2, 4]: b's prefill and one decode
        (4.0, "a", 0, 0, 0.0), (4.0, "b", 0, 1, 1.0),   # (4, 6]: b's last token
    ]  # fmt: skip
    path = write_service_series(tmp_path, rows)
    with open(path) as f:
        assert len(list(csv.DictReader(f))) == 6


def test_recompute_does_not_count_the_prompt_twice():
    # Five usable one-token pages: b is preempted (recompute) when a grows, and prefills again.
    reqs = make_requests([3, 3], prompt_lens=[2, 2])
    reqs[0].client_id, reqs[1].client_id = "a", "b"
    result, log = _run(reqs, max_num_seqs=2, num_pages=6, page_size=1)
    assert result.preemptions >= 1
    span = result.makespan_s
    total = {k: v * span for k, v in client_service(log, ["a", "b"], MetricsConfig(), 0.0, span).items()}
    assert total == pytest.approx({"a": 2 + 2 * 3, "b": 2 + 2 * 3})


@settings(max_examples=40, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 6), st.sampled_from("xyz")),
        min_size=1, max_size=12,
    ),
    num_pages=st.integers(6, 20),
    preemption=st.sampled_from(["recompute", "swap"]),
    chunked=st.booleans(),
    policy=st.sampled_from(["fcfs", "vtc"]),
)  # fmt: skip
def test_service_totals_equal_each_clients_tokens(reqs, num_pages, preemption, chunked, policy):
    """Whatever preempts or chunks, a client's service over the run is its requests' prompt
    tokens plus twice their generated tokens; the series and a whole-run window agree."""
    requests = make_requests([r[1] for r in reqs], [r[0] for r in reqs], [r[2] for r in reqs])
    for req, r in zip(requests, reqs):
        req.client_id = r[3]
    sched = Scheduler(
        SchedulerConfig(name=policy, max_num_seqs=3, max_num_batched_tokens=16, preemption=preemption,
                        chunked_prefill=chunked),
        CacheConfig(num_pages=num_pages, page_size=2), max_model_len=64,
    )  # fmt: skip
    log = ServiceLog()
    result = serve(requests, sched, SimExecutor(UnitCost()), on_step=log.on_step)
    expected = {c: 0.0 for c in "xyz"}
    for req in requests:
        if req.num_generated:
            expected[req.client_id] += req.prompt_len + 2 * req.num_generated
    span = result.makespan_s
    metrics = MetricsConfig(series_bin_s=1.5)
    got = client_service(log, list("xyz"), metrics, 0.0, span) if span else dict.fromkeys("xyz", 0.0)
    assert {c: v * span for c, v in got.items()} == pytest.approx(expected)
    series = service_series(log, list("xyz"), metrics, span)
    for c in "xyz":
        assert sum(r["service"] for r in series if r["client_id"] == c) == pytest.approx(expected[c])
    if span:
        window = service_summary(result, log, MetricsConfig(window_s=[0.0, span]), SLOConfig())
        assert window["output_tokens"] == sum(r.num_generated for r in requests)
        assert window["num_requests"] == len([r for r in requests if r.arrival_s < span])
