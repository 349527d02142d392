"""One validation for both executors, sane inputs, and the fates max_model_len and error."""

import json

from conftest import CheckingExecutor, make_requests
from test_config_schema import composed
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.engine.offline import serve
from cbjax.core.executor import StepOutput
from cbjax.report.metrics import request_row, summarize
from cbjax.core.request import FinishReason, Request, SamplingParams
from cbjax.app.run import run_experiment
from cbjax.scheduler import Scheduler

LOOSE = {"max_num_batched_tokens": 100000}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_rows(out):
    return {r["request_id"]: r for r in map(json.loads, (out / "requests.jsonl").read_text().splitlines())}


def test_a_request_cut_at_the_model_length_ends_max_model_len():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, **LOOSE), CacheConfig(num_pages=64, page_size=4), max_model_len=20)
    cut, own = (Request(str(i), 0.0, 16, sampling=SamplingParams(max_tokens=m)) for i, m in enumerate((10, 4)))
    result = serve([cut, own], sched, CheckingExecutor(sched))
    # 16 prompt tokens + 4 generated fill the 20-token context before cut's max_tokens=10
    assert (cut.num_generated, cut.finish_reason) == (4, FinishReason.MAX_MODEL_LEN)
    assert (own.num_generated, own.finish_reason) == (4, FinishReason.LENGTH)
    summary = summarize(result)
    assert summary["num_max_model_len"] == 1 and summary["num_finished"] == 2
    assert request_row(cut)["finish_reason"] == "max_model_len"


class FailingExecutor(CheckingExecutor):
    """Reports request `victim`'s step as failed at iteration `at`, as an engine does for
    non-finite logits; tokens are otherwise real (0)."""

    def __init__(self, scheduler, victim, at):
        super().__init__(scheduler)
        self.victim, self.at = victim, at

    def execute(self, plan):
        super().execute(plan)
        ids = [s.request_id for s in plan.scheduled]
        errors = {ids.index(self.victim): "logits are not finite"} if self.plans == self.at else None
        return StepOutput(token_ids=[0] * len(ids), errors=errors)


def test_a_step_error_ends_that_request_with_error_and_the_run_goes_on():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, **LOOSE), CacheConfig(num_pages=64, page_size=4), 1000)
    reqs = make_requests([5, 5, 5])
    result = serve(reqs, sched, FailingExecutor(sched, victim="1", at=3))
    bad = reqs[1]
    # its prefill (iteration 1) and first decode (2) yielded tokens; iteration 3 failed
    assert (bad.finish_reason, bad.error, bad.num_generated, bad.finish_s) == (
        FinishReason.ERROR, "logits are not finite", 2, 3.0
    )
    assert [(r.finish_reason, r.num_generated) for r in (reqs[0], reqs[2])] == [(FinishReason.LENGTH, 5)] * 2
    assert len(bad.output_token_ids) == 2
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages and not sched.running
    summary = summarize(result)
    assert (summary["num_errors"], summary["num_finished"], summary["iterations"]) == (1, 2, 5)
    assert request_row(bad)["error"] == "logits are not finite"


def test_the_scheduler_rejects_prompt_ids_outside_the_vocabulary():
    sched = Scheduler(SchedulerConfig(**LOOSE), CacheConfig(), 1000, vocab_size=512)
    bad = Request("b", 0.0, 3, prompt_token_ids=[1, 512, 2])
    assert sched.rejection_reason(bad) == "request b: prompt token id 512 is outside the vocabulary (model.vocab_size=512)"
    assert sched.rejection_reason(Request("n", 0.0, 2, prompt_token_ids=[-1, 0])).startswith("request n: prompt token id -1")
    fits = Request("s", 0.0, 100, synthetic_prompt=(7, 512))
    assert sched.rejection_reason(fits) is None and fits.prompt_token_ids is None  # never drawn
    wide = Request("w", 0.0, 100, synthetic_prompt=(7, 100000))
    assert "outside the vocabulary" in sched.rejection_reason(wide)


def test_sim_and_jax_reject_the_same_requests_for_the_same_reasons(tmp_path):
    trace = write_jsonl(tmp_path / "t.jsonl", [
        {"arrival_s": 0.0, "prompt_token_ids": [1, 2, 3, 4], "max_tokens": 2},
        {"arrival_s": 0.0, "prompt_token_ids": [1, 600, 3], "max_tokens": 2},  # tiny vocab is 512
        {"arrival_s": 0.0, "prompt_len": 32, "max_tokens": 2},  # max_model_len 32 below
        {"arrival_s": 0.0, "prompt_len": 5, "max_tokens": 0},
        {"arrival_s": 0.0, "prompt_len": 5, "output_len": 3},
    ])  # fmt: skip
    common = ["progress=false", "model=tiny", "workload=trace", f"workload.path={trace}", "model.max_model_len=32",
              "scheduler.max_num_seqs=2", "scheduler.max_num_batched_tokens=32", "cache.num_pages=32",
              "executor.token_buckets=[8,32]", "executor.attention=reference"]  # fmt: skip
    fates = {}
    for name in ("sim", "jax"):
        summary = run_experiment(composed(*common, f"executor={name}"), tmp_path / name, verbose=False)
        rows = read_rows(tmp_path / name)
        fates[name] = (summary["num_rejected"], {k: r["reject_reason"] for k, r in rows.items() if r["reject_reason"]})
    assert fates["sim"] == fates["jax"]
    num_rejected, reasons = fates["sim"]
    assert num_rejected == 3 and set(reasons) == {"1", "2", "3"}
    assert "prompt token id 600 is outside the vocabulary" in reasons["1"]
    assert "max_model_len is 32" in reasons["2"]


def test_an_arrival_beyond_max_arrival_s_is_rejected_and_leaves_the_metrics_sane(tmp_path):
    trace = write_jsonl(tmp_path / "t.jsonl", [
        {"arrival_s": 0.0, "prompt_len": 4, "output_len": 3},
        {"arrival_s": 1e18, "prompt_len": 4, "output_len": 3},
        {"arrival_s": 2.0, "prompt_len": 4, "output_len": 3},
    ])  # fmt: skip
    cfg = composed("progress=false", "workload=trace", f"workload.path={trace}", "executor.cost_model=unit")
    summary = run_experiment(cfg, tmp_path / "out", verbose=False)
    rows = read_rows(tmp_path / "out")
    assert rows["1"]["finish_reason"] == "rejected"
    assert "arrival_s 1e+18 is beyond workload.max_arrival_s=1e+07" in rows["1"]["reject_reason"]
    assert summary["num_finished"] == 2 and summary["makespan_s"] == 5.0  # 0..3, then 2..5
    assert summary["e2e_s_p50"] == 3.0
    small = composed("progress=false", "workload=trace", f"workload.path={trace}", "workload.max_arrival_s=1")
    assert run_experiment(small, verbose=False)["num_rejected"] == 2


def test_duplicate_ids_are_renamed_without_colliding_and_keep_the_original(tmp_path):
    trace = write_jsonl(tmp_path / "t.jsonl", [
        {"arrival_s": 0.0, "prompt_len": 4, "output_len": 2, "request_id": "x"},
        {"arrival_s": 0.0, "prompt_len": 4, "output_len": 2, "request_id": "x"},
        {"arrival_s": 0.0, "prompt_len": 4, "output_len": 2, "request_id": "x@line2"},
    ])  # fmt: skip
    summary = run_experiment(composed("progress=false", "workload=trace", f"workload.path={trace}"), tmp_path, verbose=False)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len({r["request_id"] for r in rows}) == 3
    by_original = {(r["original_request_id"], r["finish_reason"]) for r in rows}
    assert ("x", "rejected") in by_original
    renamed = next(r for r in rows if r["original_request_id"] == "x")
    assert renamed["request_id"] not in ("x", "x@line2") and "duplicate request_id 'x'" in renamed["reject_reason"]
    kept = {r["request_id"]: r for r in rows if r["original_request_id"] is None}
    assert set(kept) == {"x", "x@line2"} and all(r["finish_reason"] == "length" for r in kept.values())
    assert summary["num_rejected"] == 1
