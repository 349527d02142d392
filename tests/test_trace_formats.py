"""Public trace formats (BurstGPT, Azure 2024, Mooncake) on small files written here, checked by
hand; default request ids that never collide with explicit ones; headers of no known format;
arrivals that go backwards."""

import json
import logging
import re

import pytest

from cbjax.config import WorkloadConfig
from cbjax.app.run import run_experiment
from cbjax.workload import build_workload
from cbjax.workload.trace import encode_text_prompts, load_trace
from test_config_schema import composed
from test_workload import _trace, _write

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
47,GPT-4,417,276,693,API log
47.5,ChatGPT,10,5,16,API log
"""


@pytest.mark.parametrize("fmt", ["auto", "burstgpt"])
def test_burstgpt_csv(tmp_path, fmt):
    r = _trace(tmp_path, "burst.csv", BURSTGPT, format=fmt)
    # arrivals: Timestamp minus the first (5 s); the client is the Model column
    assert [x.arrival_s for x in r] == [0.0, 40.0, 42.0, 42.5]
    assert [x.prompt_len for x in r] == [472, 1087, 417, 10]
    assert [x.target_output_len for x in r] == [18, 0, 276, 5]
    assert [x.client_id for x in r] == ["ChatGPT", "ChatGPT", "GPT-4", "ChatGPT"]
    assert r[0].input_error is None and r[2].input_error is None
    assert r[1].input_error == "burst.csv line 3: Response tokens 0: the request failed in the trace"
    assert r[3].input_error == "burst.csv line 5: Total tokens 16 is not Request tokens 10 + Response tokens 5"
    assert r[2].sampling.max_tokens == 276 and r[2].sampling.ignore_eos


def test_burstgpt_header_missing_a_column_names_it(tmp_path):
    text = "Timestamp,Model,Request tokens,Total tokens,Log Type\n5,ChatGPT,472,490,API log\n"
    with pytest.raises(ValueError, match="missing Response tokens"):
        _trace(tmp_path, "b.csv", text, format="burstgpt")
    with pytest.raises(ValueError, match=r"cannot tell its format.*burstgpt"):
        _trace(tmp_path, "b2.csv", text)


AZURE_2024 = """TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-12 00:00:00+00:00,584,3
2024-05-12 00:00:00.041683+00:00,1452,3
2024-05-12 00:00:01.5+00:00,862,38
2024-05-12 01:00:02+01:00,617,104
"""


@pytest.mark.parametrize("fmt", ["auto", "azure2024"])
def test_azure_2024_csv(tmp_path, fmt):
    # the 2024 release: UTC offsets on every stamp, the fraction dropped when it is zero
    r = _trace(tmp_path, "conv.csv", AZURE_2024, format=fmt)
    # 01:00:02+01:00 is 00:00:02 UTC
    assert [x.arrival_s for x in r] == pytest.approx([0.0, 0.041683, 1.5, 2.0], abs=1e-12)
    assert [x.prompt_len for x in r] == [584, 1452, 862, 617]
    assert [x.target_output_len for x in r] == [3, 3, 38, 104]
    assert all(x.input_error is None for x in r)


MOONCAKE = [
    {"timestamp": 0, "input_length": 20, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 12, "output_length": 7, "hash_ids": [0, 3]},
    {"timestamp": 1500, "input_length": 17, "output_length": 2, "hash_ids": [0, 1, 4]},
    {"timestamp": 3000, "input_length": 9, "output_length": 1, "hash_ids": [5]},
    {"timestamp": 4000, "input_length": 8, "output_length": 1},
]


def _mooncake(tmp_path, lines=MOONCAKE, seed=0, **kw):
    path = _write(tmp_path, "mooncake.jsonl", "\n".join(json.dumps(x) for x in lines))
    return load_trace(WorkloadConfig(name="trace", path=str(path), hash_block_size=8, vocab_size=1000, **kw), seed)


def test_mooncake_jsonl_shared_hash_ids_are_shared_prefixes(tmp_path):
    r = _mooncake(tmp_path)
    assert [x.arrival_s for x in r] == [0.0, 1.5, 1.5, 3.0, 4.0]  # milliseconds
    assert [x.prompt_len for x in r] == [20, 12, 17, 9, 8]
    assert [x.target_output_len for x in r] == [5, 7, 2, 1, 1]
    a, b, c = (x.prompt_token_ids for x in r[:3])
    assert [len(a), len(b), len(c)] == [20, 12, 17]
    assert a[:8] == b[:8] == c[:8]  # hash id 0
    assert a[8:16] == c[8:16]  # hash id 1
    assert a[8:12] != b[8:12]  # hash id 3 is not hash id 1
    assert r[3].input_error == (
        "mooncake.jsonl line 4: hash_ids has 1 blocks, input_length 9 needs 2 of 8 tokens (workload.hash_block_size)"
    )
    assert r[4].input_error == "mooncake.jsonl line 5: hash_ids is missing"
    assert all(x.input_error is None for x in r[:3])
    # the blocks follow the run's seed, the same for the same seed
    assert _mooncake(tmp_path)[0].prompt_token_ids == a
    assert _mooncake(tmp_path, seed=1)[0].prompt_token_ids[:8] != a[:8]


def test_mooncake_format_forced_and_a_misspelled_key_named(tmp_path):
    lines = [{"timestamp": 0, "input_lenght": 8, "output_length": 1, "hash_ids": [0]}]
    r = _mooncake(tmp_path, lines, format="mooncake")
    assert r[0].input_error.startswith("mooncake.jsonl line 1: unknown key 'input_lenght'; a Mooncake line has")
    assert "input_length is missing" in r[0].input_error


def test_a_negative_length_is_named_by_the_files_own_column(tmp_path):
    azure = _trace(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:07,-5,8\n")
    assert azure[0].input_error == "a.csv line 2: ContextTokens must be >= 0, got -5"
    lines = [{"timestamp": 0, "input_length": 8, "output_length": -2, "hash_ids": [0]}]
    assert _mooncake(tmp_path, lines)[0].input_error == "mooncake.jsonl line 1: output_length must be >= 0, got -2"
    plain = _trace(tmp_path, "p.csv", "arrival_s,prompt_len,output_len\n0,-1,1\n")
    assert plain[0].input_error == "p.csv line 2: prompt_len must be >= 0, got -1"


def test_a_text_prompt_without_a_tokenizer_is_named_by_file_and_line(tmp_path):
    reqs = _trace(tmp_path, "t.jsonl", '{"arrival_s": 0, "prompt_len": 4, "output_len": 1}\n{"arrival_s": 0, "prompt": "hi", "output_len": 1}\n')
    encode_text_prompts(reqs, None, where="model 'm'")
    assert reqs[1].input_error.startswith("t.jsonl line 2: prompt is text, but model 'm' has no tokenizer")


def test_a_mooncake_line_with_a_bad_length_names_that_field_alone(tmp_path):
    lines = [{"timestamp": 0, "input_length": "8", "output_length": 1, "hash_ids": [0]},
             {"timestamp": 1, "input_length": 8, "output_length": 1, "hash_ids": "0"}]  # fmt: skip
    r = _mooncake(tmp_path, lines, format="mooncake")
    assert r[0].input_error == "mooncake.jsonl line 1: input_length '8' is not an integer"
    assert r[1].input_error == "mooncake.jsonl line 2: hash_ids must be a list of integers, got str"


def test_a_bad_mooncake_timestamp_is_named_in_milliseconds(tmp_path):
    lines = [{"timestamp": -5, "input_length": 8, "output_length": 1, "hash_ids": [0]},
             {"timestamp": 7, "input_length": 8, "output_length": 1, "hash_ids": [0]}]  # fmt: skip
    r = _mooncake(tmp_path, lines, format="mooncake")
    assert r[0].input_error == "mooncake.jsonl line 1: timestamp -5 must be a finite number of milliseconds >= 0"
    assert r[1].input_error is None and r[1].arrival_s == 0.007


def test_mooncake_prefix_cache_hits_only_on_shared_hash_ids(tmp_path):
    def hit_rate(lines):
        path = _write(tmp_path, "m.jsonl", "\n".join(json.dumps(x) for x in lines))
        cfg = composed("progress=false", "workload=trace", f"workload.path={path}", "workload.hash_block_size=8",
                       "cache.prefix_caching=true", "cache.page_size=4", "executor.cost_model=unit")  # fmt: skip
        return run_experiment(cfg, verbose=False)["prefix_cache_hit_rate"]

    shared = [{"timestamp": 1000 * i, "input_length": 16, "output_length": 2, "hash_ids": [0, 1]} for i in range(3)]
    distinct = [{"timestamp": 1000 * i, "input_length": 16, "output_length": 2, "hash_ids": [2 * i, 2 * i + 1]}
                for i in range(3)]  # fmt: skip
    assert hit_rate(shared) > 0.0
    assert hit_rate(distinct) == 0.0


def test_a_default_id_never_collides_with_an_explicit_one(tmp_path):
    lines = [
        {"arrival_s": 0.0, "prompt_len": 2, "output_len": 1},  # default "0"
        {"arrival_s": 0.0, "prompt_len": 2, "output_len": 1, "request_id": "0"},
        {"arrival_s": 0.0, "prompt_len": 2, "output_len": 1, "request_id": 3},
        {"arrival_s": 0.0, "prompt_len": 2, "output_len": 1},  # default "3"
    ]
    r = _trace(tmp_path, "t.jsonl", "\n".join(json.dumps(x) for x in lines))
    assert [x.input_error for x in r] == [None] * 4
    assert [x.request_id for x in r] == ["0@line1", "0", "3", "3@line4"]
    assert all(x.original_request_id is None for x in r)
    # two explicit equal ids are still a duplicate
    lines[3]["request_id"] = 3
    r = _trace(tmp_path, "u.jsonl", "\n".join(json.dumps(x) for x in lines))
    assert r[3].input_error == "u.jsonl line 4: duplicate request_id '3' (first on line 3)"


def test_a_negative_hash_id_rejects_its_line_alone_and_the_run_goes_on(tmp_path):
    lines = [dict(MOONCAKE[0]), {"timestamp": 500, "input_length": 12, "output_length": 3, "hash_ids": [0, -3]},
             dict(MOONCAKE[1])]  # fmt: skip
    r = _mooncake(tmp_path, lines)
    assert r[1].input_error == "mooncake.jsonl line 2: hash_ids[1] -3 is not a hash id (an integer >= 0)"
    assert r[0].input_error is None and r[2].input_error is None
    path = tmp_path / "mooncake.jsonl"
    cfg = composed("progress=false", "workload=trace", f"workload.path={path}", "workload.hash_block_size=8",
                   "executor.cost_model=unit")  # fmt: skip
    summary = run_experiment(cfg, verbose=False)
    assert (summary["num_rejected"], summary["num_finished"]) == (1, 2)


def test_arrivals_going_backwards_are_sorted_with_one_warning_counting_them(tmp_path, caplog):
    # lines 2-6 arrive at 0, 5, 2, 3, 6: lines 4 and 5 arrive before line 3
    text = "arrival_s,prompt_len,output_len\n0,4,1\n5,4,1\n2,4,1\n3,4,1\n6,4,1\n"
    path = _write(tmp_path, "back.csv", text)
    with caplog.at_level(logging.WARNING, logger="cbjax"):
        reqs = build_workload(WorkloadConfig(name="trace", path=str(path)), 0)
    assert [r.arrival_s for r in reqs] == [0, 2, 3, 5, 6]
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert warnings == [
        f"trace file {path}: arrival times go backwards; 2 of 5 rows arrive before a row above them "
        "(first at line 4) and are replayed in arrival order"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cbjax"):  # in order, ties included: no warning
        _trace(tmp_path, "sorted.csv", "arrival_s,prompt_len,output_len\n0,4,1\n2,4,1\n2,4,1\n")
    assert caplog.records == []


@pytest.mark.parametrize("header, closest", [
    ("TIMESTAMP,ContextTokens", "closest is azure (missing column GeneratedTokens)"),
    ("Timestamp,Model,Request tokens,Log Type", "closest is burstgpt (missing columns Response tokens, Total tokens)"),
    ("arrival_s,prompt_len,output_len,client", "closest is csv (unexpected column client)"),
])  # fmt: skip
def test_an_unknown_header_names_the_closest_format_and_its_missing_columns(tmp_path, header, closest):
    with pytest.raises(ValueError, match=re.escape(f"cannot tell its format from the first line {header!r}; {closest}")):
        _trace(tmp_path, "h.csv", f"{header}\n1,2\n")


def test_lines_the_scheduler_refuses_are_named_by_file_and_line(tmp_path):
    """Problems found at the scheduler (once the model and the cache are known, or by the
    scheduler's own checks) name the line, as the reader's own do."""
    lines = [
        {"arrival_s": 0, "prompt_len": 4, "output_len": 2},
        {"arrival_s": 0, "prompt_len": 4, "output_len": 2, "temperature": -1},
        {"arrival_s": 0, "prompt_len": 9000, "output_len": 2},
        {"arrival_s": 0, "prompt_token_ids": [], "output_len": 2},
        {"arrival_s": 0, "prompt_len": 4, "output_len": 0},
        {"arrival_s": 0, "prompt_token_ids": [1, 999999999], "output_len": 2},
    ]
    path = _write(tmp_path, "t.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
    cfg = composed("progress=false", "workload=trace", f"workload.path={path}", "executor.cost_model=unit")
    run_experiment(cfg, tmp_path / "run", verbose=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert [r["reject_reason"] for r in rows] == [
        None,
        "t.jsonl line 2: temperature must be >= 0, got -1.0",
        "t.jsonl line 3: prompt has 9000 tokens, model max_model_len is 8192 (no room to generate)",
        "t.jsonl line 4: empty prompt",
        "t.jsonl line 5: max_tokens must be >= 1, got 0",  # (output_len sets max_tokens)
        "t.jsonl line 6: request 5: prompt token id 999999999 is outside the vocabulary (model.vocab_size=128256)",
    ]


@pytest.mark.parametrize("bad", ["nan", "-inf", "inf", "-30"])
def test_a_bad_burstgpt_timestamp_rejects_its_line_alone(tmp_path, bad):
    # arrivals are Timestamps minus the earliest: a bad one must not shift or poison the rest
    head, *lines = BURSTGPT.splitlines()
    text = "\n".join([head, f"{bad},ChatGPT,10,5,15,API log", *lines]) + "\n"
    r = _trace(tmp_path, "burst.csv", text)
    assert r[0].input_error == f"burst.csv line 2: Timestamp {float(bad)} must be a finite number >= 0"
    assert [x.arrival_s for x in r[1:]] == [0.0, 40.0, 42.0, 42.5]
    assert r[1].input_error is None and r[3].input_error is None


def test_a_late_arrival_is_named_by_file_and_line(tmp_path):
    text = "arrival_s,prompt_len,output_len\n0.0,4,2\n1e20,4,2\n1.0,4,2\n"
    r = build_workload(WorkloadConfig(name="trace", path=str(_write(tmp_path, "t.csv", text)), max_arrival_s=10.0), 0)
    late = next(x for x in r if x.request_id == "1")
    assert late.input_error == "t.csv line 3: arrival_s 1e+20 is beyond workload.max_arrival_s=10"
    assert [x.input_error for x in r if x.request_id != "1"] == [None, None]


def test_a_corrupt_first_json_line_is_rejected_alone_not_the_format(tmp_path):
    # the format comes from the first line that is a JSON object, here Mooncake's
    lines = MOONCAKE[:3]
    text = '{"timestamp": 0, "input_le\n' + "\n".join(json.dumps(x) for x in lines) + "\n"
    r = load_trace(WorkloadConfig(name="trace", path=str(_write(tmp_path, "m.jsonl", text)), hash_block_size=8), 0)
    assert r[0].input_error.startswith("m.jsonl line 1: invalid JSON")
    assert [x.input_error for x in r[1:]] == [None] * len(lines)
    assert [x.prompt_len for x in r[1:]] == [x["input_length"] for x in lines]
