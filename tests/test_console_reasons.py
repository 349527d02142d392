"""The console says why requests did not run: under the table of cbjax and of cbjax-bench, the
rejected and failed requests' most common reasons with their counts."""

from __future__ import annotations

import json
import logging

from test_bench import bench_config
from test_bench_client import MODELS, scripted_server, server_thread, sized
from test_defaults import composed
from cbjax.app.run import run_single
from cbjax.bench.run import run_bench
from cbjax.core.request import FinishReason, Request
from cbjax.report.reasons import format_reasons


def ended(rid: int, finish: FinishReason, reason: str) -> Request:
    req = Request(request_id=str(rid), arrival_s=0.0, prompt_len=4)
    req.finish_reason = finish
    if finish is FinishReason.REJECTED:
        req.reject_reason = reason
    else:
        req.error = reason
    return req


def console(caplog) -> str:
    return "\n".join(rec.getMessage() for rec in caplog.records if rec.name == "cbjax")


def test_reasons_differing_only_in_numbers_are_grouped_most_common_first():
    reqs = [ended(i, FinishReason.REJECTED, f"t.jsonl line {i}: needs {i + 30} KV pages, the cache has 9") for i in range(5)]
    reqs += [ended(5, FinishReason.REJECTED, "t.jsonl line 6: invalid JSON"), ended(6, FinishReason.REJECTED, "empty prompt"),
             ended(7, FinishReason.REJECTED, "ids out of vocabulary"), ended(10, FinishReason.REJECTED, "too long")]  # fmt: skip
    reqs += [ended(8, FinishReason.ERROR, "HTTP 404: model: 'nope' does not exist")]
    reqs += [ended(9, FinishReason.EOS, "")]
    assert format_reasons(reqs, top=3).splitlines() == [
        "9 requests rejected; the most common reasons (each request's is in requests.jsonl):",
        "  5 x t.jsonl line 0: needs 30 KV pages, the cache has 9",
        "  1 x t.jsonl line 6: invalid JSON",
        "  1 x empty prompt",
        "  2 x other reasons (2 different)",
        "1 request failed; the most common reasons (each request's is in requests.jsonl):",
        "  1 x HTTP 404: model: 'nope' does not exist",
    ]
    four = format_reasons(reqs[:8], top=3).splitlines()  # a fourth reason alone is shown, not counted
    assert four[0].startswith("8 requests rejected") and four[4] == "  1 x ids out of vocabulary"
    assert format_reasons([ended(0, FinishReason.LENGTH, "")]) == ""
    assert format_reasons([ended(0, FinishReason.REJECTED, "x" * 50)], width=10).endswith("  1 x xxxxxxx...")


def test_a_run_whose_every_line_is_rejected_says_why_under_its_table(tmp_path, caplog):
    # a Mooncake trace read as cbjax's JSONL: every line has the wrong keys
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 600, "output_length": 40, "hash_ids": [0]}) + "\n" for t in (0, 3)))
    cfg = composed("progress=false", "workload=trace", f"workload.path={path}", "workload.format=jsonl")
    with caplog.at_level(logging.INFO, logger="cbjax"):
        summary = run_single(cfg, tmp_path / "out")
    assert summary["num_rejected"] == 2
    assert "2 requests rejected; the most common reasons" in console(caplog)
    assert "  2 x mooncake.jsonl line 1: unknown keys 'timestamp', 'input_length', 'output_length', 'hash_ids'" in console(caplog)


def not_found(n, head):
    if b"/models" in head:
        return MODELS
    return sized(404, json.dumps({"error": {"message": "model: 'nope' does not exist", "type": "NotFoundError"}}).encode())


async def not_found_server():
    return await scripted_server(not_found)


def test_cbjax_bench_says_why_its_requests_failed_under_its_table(tmp_path, caplog):
    with server_thread(not_found_server) as url:
        cfg = bench_config(f"bench.url={url}", "bench.model=nope", "workload.num_requests=3")
        with caplog.at_level(logging.INFO, logger="cbjax"):
            summary = run_bench(cfg, tmp_path / "bench")
    assert summary["num_http_errors"] == 3
    lines = console(caplog).splitlines()
    assert "3 requests failed; the most common reasons (each request's is in requests.jsonl):" in lines
    assert any(line.startswith("  3 x HTTP 404") and "'nope' does not exist" in line for line in lines)


def test_a_profile_the_simulators_cost_model_will_not_read_is_named_on_the_console(caplog):
    """executor.profile with the roofline: the run predicts the datasheet, not the profiled
    machine; it still runs (a sweep over cost models may share one profile)."""
    cfg = composed("executor.profile=/some/profile.json", "workload.num_requests=3")
    with caplog.at_level(logging.WARNING, logger="cbjax"):
        summary = run_single(cfg, None, verbose=False)
    assert summary["num_finished"] == 3
    assert "executor.profile=/some/profile.json is not read: executor.cost_model is roofline, not profiled" in console(caplog)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cbjax"):
        run_single(composed("workload.num_requests=3"), None, verbose=False)
    assert "is not read" not in console(caplog)


def test_an_overhead_the_unit_cost_model_will_not_read_is_named_on_the_console(caplog):
    with caplog.at_level(logging.WARNING, logger="cbjax"):
        run_single(composed("executor.cost_model=unit", "overhead=step_2ms", "workload.num_requests=3"), None, verbose=False)
    assert "overhead=step_2ms is not read: executor.cost_model=unit prices every step alike" in console(caplog)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cbjax"):
        run_single(composed("executor.cost_model=unit", "workload.num_requests=3"), None, verbose=False)
    assert "is not read" not in console(caplog)
