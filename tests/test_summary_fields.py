"""summary.json's request fields on hand-built runs, each expected value computed by hand."""

import pytest

from cbjax.config import MetricsConfig, SLOConfig
from cbjax.core.request import FinishReason, Request, Status
from cbjax.core.results import IterationStats, RunResult
from cbjax.report.metrics import summarize
from cbjax.report.service import ServiceLog, service_summary


def _req(i, arrival, first, finish, generated, reason=FinishReason.LENGTH):
    req = Request(request_id=str(i), arrival_s=arrival, prompt_len=4)
    req.first_token_s, req.finish_s, req.num_generated = first, finish, generated
    req.finish_reason, req.status = reason, Status.FINISHED
    return req


def _result(reqs, makespan):
    return RunResult(reqs, IterationStats(), num_slots=1, makespan_s=makespan, preemptions=0, wall_s=0.0)


def test_a_served_request_without_a_token_is_judged_by_when_its_empty_answer_ended():
    # A server may end a stream "stop" with no token text and no usage (an EOS first): served,
    # no first token. Its empty answer ended at 0.5 s (a 1 s TTFT target met) or at 3 s (missed).
    quick = _req(0, 0.0, None, 0.5, 0, FinishReason.STOP)
    slow = _req(1, 1.0, None, 4.0, 0, FinishReason.STOP)
    normal = _req(2, 0.0, 0.25, 1.0, 4)  # TTFT 0.25 s, TPOT 0.25 s
    s = summarize(_result([quick, slow, normal], 4.0), slo_ttft_s=1.0, slo_tpot_s=0.5)
    assert s["ttft_s_p50"] == 0.25 and s["ttft_s_mean"] == 0.25  # only the request with a token
    assert s["goodput_req_s"] == pytest.approx(2 / 4)  # quick and normal, over 4 s
    assert s["slo_attainment"] == pytest.approx(2 / 3)


def test_a_window_leaves_requests_that_never_arrived_out_of_slo_attainment():
    # The run stopped at 3 s, before b's arrival at 5 s: b was never submitted (not_arrived).
    # a arrived at 0, first token at 1, done at 2 with 2 tokens: TTFT 1 s, TPOT 1 s.
    a = _req(0, 0.0, 1.0, 2.0, 2)
    b = Request(request_id="1", arrival_s=5.0, prompt_len=4)
    b.finish_reason, b.status = FinishReason.NOT_ARRIVED, Status.FINISHED
    result = _result([a, b], 3.0)
    whole = summarize(result, slo_ttft_s=1.5)
    assert whole["slo_attainment"] == 1.0  # a met it; b was never submitted
    window = service_summary(result, ServiceLog(), MetricsConfig(window_s=[0.0, 10.0]), SLOConfig(ttft_s=1.5))
    assert window["slo_attainment"] == 1.0


def test_a_window_restricts_every_request_field_to_its_arrivals():
    # a and m arrive in the window [0, 2); b and e after it. Latency per output token:
    # a (0 -> 2, 2 tokens) 1 s, m (0.5 -> 4.5, 2 tokens, cut at the model's length) 2 s,
    # b (3 -> 5, 1 token) 2 s; e failed.
    a = _req(0, 0.0, 1.0, 2.0, 2)
    m = _req(1, 0.5, 1.5, 4.5, 2, FinishReason.MAX_MODEL_LEN)
    b = _req(2, 3.0, 4.0, 5.0, 1)
    e = _req(3, 3.5, None, 4.0, 0, FinishReason.ERROR)
    result = _result([a, m, b, e], 5.0)
    whole = summarize(result)
    assert (whole["num_errors"], whole["num_max_model_len"]) == (1, 1)
    assert whole["normalized_latency_s_per_token"] == pytest.approx(5 / 3)
    s = {**whole, **service_summary(result, ServiceLog(), MetricsConfig(window_s=[0.0, 2.0]), SLOConfig())}
    assert (s["num_requests"], s["num_finished"], s["num_errors"], s["num_max_model_len"]) == (2, 2, 0, 1)
    assert s["normalized_latency_s_per_token"] == pytest.approx(1.5)
