"""The conversation readers on small files written here, checked by hand: ShareGPT JSON (and
JSONL), BurstGPT with its session columns, Mooncake lines with a session id. Sessions, turns,
lengths, pauses and the rejected lines with their line and field."""

from __future__ import annotations

import json
import math

import pytest

from cbjax.config import PauseConfig, WorkloadConfig
from cbjax.core.request import FinishReason
from cbjax.engine.offline import serve
from cbjax.scheduler.core import Scheduler
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.sim import SimExecutor
from cbjax.sim.cost import UnitCost
from cbjax.workload import build_workload
from cbjax.workload.trace import load_trace

FIXED_PAUSE = PauseConfig(dist="fixed", value=1.5)


def _load(tmp_path, name, text, tokenizer=None, **kw):
    path = tmp_path / name
    path.write_text(text)
    cfg = WorkloadConfig(name="trace", path=str(path), pause=FIXED_PAUSE, **kw)
    return load_trace(cfg, seed=0, tokenizer=tokenizer)


def msg(role, n, text="..."):
    return {"from": role, "value": text, "num_tokens": n}


SHAREGPT = [
    # line 2: system + human = turn 0's input (2 + 5), then 7; 4, then two replies 3 + 1; a
    # trailing question without a reply is dropped
    {"id": "x", "conversations": [msg("system", 2), msg("human", 5), msg("gpt", 7), msg("human", 4),
                                  msg("gpt", 3), msg("gpt", 1), msg("human", 9)]},
    # line 3: the model speaks first: its greeting joins turn 0's input (3 + 2)
    {"id": 42, "conversations": [msg("gpt", 3), msg("human", 2), msg("gpt", 6)]},
    # line 4: an unknown role
    {"id": "bad", "conversations": [msg("human", 2), msg("bot", 6)]},
    # line 5: the id of line 2 again
    {"id": "x", "conversations": [msg("human", 2), msg("gpt", 6)]},
    # line 6: no reply
    {"conversations": [msg("human", 2)]},
]  # fmt: skip


def sharegpt_text():
    return "[\n" + ",\n".join(json.dumps(c) for c in SHAREGPT) + "\n]\n"


def test_sharegpt_conversations_become_sessions_of_turns_by_hand(tmp_path):
    reqs = _load(tmp_path, "chats.json", sharegpt_text())
    got = [
        (r.request_id, r.session_id, r.turn, r.more_turns, r.prompt_len, r.target_output_len, r.pause_s) for r in reqs
    ]
    assert got == [
        ("x.0", "x", 0, True, 7, 7, None), ("x.1", "x", 1, False, 4, 4, 1.5),
        ("42.0", "42", 0, False, 5, 6, None),
        ("bad.0", "bad", 0, False, 0, None, None),
        ("x@line5.0", "x@line5", 0, False, 0, None, None),
        ("4.0", "4", 0, False, 0, None, None),
    ]  # fmt: skip
    assert [r.arrival_s for r in reqs] == [0.0, math.inf, 0.0, 0.0, 0.0, 0.0]  # workload.arrival: all_at_once
    errors = [r.input_error for r in reqs]
    assert errors[:3] == [None, None, None]
    assert errors[3].startswith("chats.json line 4: conversations[1].from 'bot' is not a ShareGPT role")
    assert errors[4] == "chats.json line 5: duplicate id 'x' (first on line 2)"
    assert errors[5].startswith("chats.json line 6: conversations has no reply from the model")
    assert reqs[0].synthetic_prompt == reqs[1].synthetic_prompt != reqs[2].synthetic_prompt
    # served: turn 1's prompt is the conversation so far, 7 + 7 + 4
    sched = Scheduler(SchedulerConfig(), CacheConfig(num_pages=64, page_size=4), 256)
    result = serve(reqs, sched, SimExecutor(UnitCost()))
    assert reqs[1].prompt_len == 18 and reqs[1].finish_reason is FinishReason.LENGTH
    assert [r.finish_reason for r in result.requests[3:]] == [FinishReason.REJECTED] * 3


def test_sharegpt_default_ids_never_take_an_explicit_one_and_session_ids_stay_unique(tmp_path):
    chat = [msg("human", 2), msg("gpt", 3)]
    # one line: no id (its index 0), then id "0", then id "a" three times
    convs = [{"conversations": chat}, {"id": "0", "conversations": chat}] + [{"id": "a", "conversations": chat}] * 3
    reqs = _load(tmp_path, "one_line.json", json.dumps(convs))
    assert [r.input_error for r in reqs[:3]] == [None, None, None]  # the explicit "0" is served
    assert reqs[1].session_id == "0"
    assert reqs[0].session_id != "0"
    assert [r.input_error for r in reqs[3:]] == ["one_line.json line 1: duplicate id 'a' (first on line 1)"] * 2
    assert len({r.session_id for r in reqs}) == len({r.request_id for r in reqs}) == 5


class Words:
    """A tokenizer counting words."""

    def encode(self, text):
        return text.split()


def test_sharegpt_jsonl_lengths_from_the_models_tokenizer_and_limit(tmp_path):
    lines = [
        {"id": "a", "conversations": [{"from": "user", "value": "one two three"}, {"from": "assistant", "value": "four five"},
                                      {"from": "user", "value": "six"}, {"from": "assistant", "value": "seven eight nine ten"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]},
    ]  # fmt: skip
    text = "\n".join(json.dumps(c) for c in lines) + "\n"
    reqs = _load(tmp_path, "chats.jsonl", text, tokenizer=Words(), format="sharegpt", limit=1)
    assert [(r.request_id, r.prompt_len, r.target_output_len) for r in reqs] == [("a.0", 3, 2), ("a.1", 1, 4)]
    with pytest.raises(ValueError, match=r"line 1: conversations\[0\] has no num_tokens, and no tokenizer"):
        _load(tmp_path, "chats.jsonl", text)


def test_sharegpt_first_turns_arrive_by_the_workloads_arrival_process(tmp_path):
    reqs = _load(tmp_path, "chats.json", sharegpt_text(), arrival="uniform", rate=2.0)
    assert [r.arrival_s for r in reqs if r.turn == 0] == [0.5, 1.0, 1.5, 2.0, 2.5]


BURSTGPT_SESSIONS = """Timestamp,SessionID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type
5,a,2.5,ChatGPT,472,18,490,Conversation log
10,b,1.0,GPT-4,100,20,120,Conversation log
20,a,3.0,ChatGPT,530,40,570,Conversation log
21,,0.5,ChatGPT,50,5,55,API log
30,a,1.0,ChatGPT,600,10,610,Conversation log
31,b,-1,GPT-4,90,9,99,Conversation log
"""


def test_burstgpt_sessions_by_hand(tmp_path):
    reqs = _load(tmp_path, "b.csv", BURSTGPT_SESSIONS)
    got = [
        (r.session_id, r.turn, r.more_turns, r.arrival_s, r.pause_s, r.prompt_len, r.target_output_len) for r in reqs
    ]
    assert got == [
        ("a", 0, True, 0.0, None, 472, 18),
        ("b", 0, True, 5.0, None, 100, 20),
        # a's turn 1: sent at 20, 12.5 s after turn 0 ended (5 + 2.5); its new input 530 - 472 - 18
        ("a", 1, True, math.inf, 12.5, 40, 40),
        (None, 0, False, 16.0, None, 50, 5),
        ("a", 2, False, math.inf, 30 - 23.0, 600 - 530 - 40, 10),
        # b's turn 1 holds less than the conversation so far: 1 new token; paused 31 - 11 s
        ("b", 1, False, math.inf, 20.0, 1, 9),
    ]  # fmt: skip
    assert [r.input_error for r in reqs][:5] == [None] * 5
    assert reqs[5].input_error == "b.csv line 7: Elapsed time -1.0 must be >= 0"
    assert reqs[0].synthetic_prompt == reqs[2].synthetic_prompt == reqs[4].synthetic_prompt
    with pytest.raises(ValueError, match="burstgpt header has SessionID but not Elapsed time"):
        _load(tmp_path, "c.csv", BURSTGPT_SESSIONS.replace("Elapsed time", "Elapsed"))


def test_burstgpt_time_scale_shortens_the_pauses_too(tmp_path):
    reqs = _load(tmp_path, "b.csv", BURSTGPT_SESSIONS, time_scale=2.0)
    assert [r.pause_s for r in reqs if r.session_id == "a"] == [None, 6.25, 3.5]


MOONCAKE_SESSIONS = [
    {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0, 1], "session_id": "s"},
    {"timestamp": 500, "input_length": 12, "output_length": 2, "hash_ids": [5, 6]},
    {"timestamp": 1000, "input_length": 20, "output_length": 3, "hash_ids": [0, 1, 2], "session_id": "s"},
    {"timestamp": 1500, "input_length": 8, "output_length": 1, "hash_ids": [7], "session_id": True},
]


def test_mooncake_session_ids_give_turns_at_their_own_timestamps(tmp_path):
    text = "\n".join(json.dumps(x) for x in MOONCAKE_SESSIONS) + "\n"
    reqs = _load(tmp_path, "m.jsonl", text, hash_block_size=8)
    got = [(r.session_id, r.turn, r.more_turns, r.arrival_s, r.pause_s, r.prompt_len) for r in reqs]
    assert got == [("s", 0, True, 0.0, None, 10), (None, 0, False, 0.5, None, 12), ("s", 1, False, 1.0, None, 20),
                   (None, 0, False, 1.5, None, 8)]  # fmt: skip
    assert reqs[2].prompt_token_ids[:10] == reqs[0].prompt_token_ids  # hash ids 0, 1 shared (the second cut)
    assert [r.input_error for r in reqs][:3] == [None] * 3
    assert reqs[3].input_error == "m.jsonl line 4: session_id must be a string or an integer, got True"


def test_a_late_first_turn_is_rejected_but_held_turns_are_not_judged_by_arrival(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text(BURSTGPT_SESSIONS)
    reqs = build_workload(WorkloadConfig(name="trace", path=str(path), max_arrival_s=4.0), 0)
    late = {r.request_id for r in reqs if r.input_error and "max_arrival_s" in r.input_error}
    assert late == {"1", "3"}  # b's first turn (5 s) and the lone request (16 s); a's turns are not


def test_a_sharegpt_file_with_no_valid_json_line_stops_before_the_run(tmp_path):
    with pytest.raises(ValueError, match=r"trace file .*t\.csv: no line is valid JSON \(line 1: invalid JSON"):
        _load(tmp_path, "t.csv", "arrival_s,prompt_len,output_len\n0.0,5,5\n", format="sharegpt")
