"""cbjax-serve's request validation beyond the schema's ranges: strict types, lone surrogates,
null as the default, stream_options without a stream, a body not UTF-8 or not sent as JSON,
the body-size bound, and reused X-Request-IDs (in-process, on the paced simulator)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from test_serve import rows, running, serve_config

CHAT = [{"role": "user", "content": "hi"}]
NOW = "executor.pace=none"  # the simulator answers at once: these tests time nothing

# (path, body, the field the 400 must name): each was served before, coerced or ignored
LOOSE = [
    ("completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": "3"}, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": 3.0}, "max_tokens"),
    ("completions", {"prompt": "a", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "a", "stream": 1}, "stream"),
    ("completions", {"prompt": "a", "temperature": "0.5"}, "temperature"),
    ("completions", {"prompt": "a", "temperature": True}, "temperature"),
    ("completions", {"prompt": "a", "top_p": "1"}, "top_p"),
    ("completions", {"prompt": "a", "top_k": 2.0}, "top_k"),
    ("completions", {"prompt": "a", "top_k": False}, "top_k"),
    ("completions", {"prompt": "a", "seed": True}, "seed"),
    ("completions", {"prompt": "a", "seed": "7"}, "seed"),
    ("completions", {"prompt": "a", "priority": 1.0}, "priority"),
    ("completions", {"prompt": "a", "ignore_eos": 1}, "ignore_eos"),
    ("completions", {"prompt": "a", "ignore_eos": "false"}, "ignore_eos"),
    ("completions", {"prompt": "a", "n": True}, "n"),
    ("completions", {"prompt": "a", "n": 1.0}, "n"),
    ("completions", {"prompt": "a", "echo": 0}, "echo"),
    ("completions", {"prompt": "a", "best_of": True}, "best_of"),
    ("completions", {"prompt": "a", "logprobs": False}, "logprobs"),
    ("completions", {"prompt": "a", "presence_penalty": False}, "presence_penalty"),
    ("completions", {"prompt": "a", "min_tokens": False}, "min_tokens"),
    ("completions", {"prompt": "a", "skip_special_tokens": 1}, "skip_special_tokens"),
    ("completions", {"prompt": "a", "logit_bias": {"5": False}}, "logit_bias.5"),
    ("completions", {"prompt": "a", "stop_token_ids": [1.0]}, "stop_token_ids[0]"),
    ("completions", {"prompt": "a", "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ("completions", {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("completions", {"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": 0}}, "stream_options.continuous_usage_stats"),
    ("completions", {"prompt": [1.0, 2.0]}, "prompt"),
    ("completions", {"prompt": [1, True]}, "prompt"),
    ("completions", {"prompt": [[1.0]]}, "prompt"),
    ("chat/completions", {"messages": CHAT, "max_tokens": True}, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": "4"}, "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "stream": "yes"}, "stream"),
    ("chat/completions", {"messages": CHAT, "temperature": "0"}, "temperature"),
    ("chat/completions", {"messages": CHAT, "top_p": True}, "top_p"),
    ("chat/completions", {"messages": CHAT, "seed": 2.0}, "seed"),
    ("chat/completions", {"messages": CHAT, "logprobs": 0}, "logprobs"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": False}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
]  # fmt: skip

# JSON bodies with a lone surrogate, written as the escape a client's JSON encoder writes, and
# the field the 400 must name
SURROGATES = [
    ("completions", rb'{"prompt": "a\ud800b", "max_tokens": 1}', "prompt"),
    ("completions", rb'{"prompt": ["a\udfffb"], "max_tokens": 1}', "prompt[0]"),
    ("completions", rb'{"prompt": "a", "stop": ["x", "\ud800"], "max_tokens": 1}', "stop[1]"),
    ("completions", rb'{"prompt": "a", "stop": "\ud800", "max_tokens": 1}', "stop"),
    ("completions", rb'{"prompt": "a", "user": "\udc00", "max_tokens": 1}', "user"),
    ("completions", rb'{"prompt": "a", "model": "\ud800", "max_tokens": 1}', "model"),
    ("completions", rb'{"prompt": "a", "\ud800": 1}', "body"),  # an unknown field's name
    ("chat/completions", rb'{"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 1}', "messages[0].content"),
    ("chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("chat/completions", rb'{"messages": [{"role": "user", "content": "a"}], "stop": ["\ud800"], "max_tokens": 1}', "stop[0]"),
]  # fmt: skip


def assert_openai_error(resp: httpx.Response, status: int, param: str, what) -> None:
    assert resp.status_code == status, (what, resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json"), (what, resp.text)
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, (what, error)
    assert error["param"] == param and error["code"] == status and error["type"] == "invalid_request_error", (what, error)
    assert error["message"].startswith(param.split(".")[0].split("[")[0]), (what, error)


def test_loose_types_are_400_naming_the_field_and_exact_types_are_served(tmp_path):
    with running(tmp_path, NOW) as (base, srv):
        with httpx.Client(base_url=base, timeout=30) as http:
            for path, body, param in LOOSE:
                assert_openai_error(http.post(f"/{path}", json=body), 400, param, body)
            # JSON's NaN and Infinity are not JSON, though Python's parser reads them
            for raw, param in ((b'{"prompt": "a", "temperature": NaN}', "temperature"), (b'{"prompt": "a", "top_p": Infinity}', "top_p")):
                resp = http.post("/completions", content=raw, headers={"content-type": "application/json"})
                assert_openai_error(resp, 400, param, raw)
            # an integer is a number: a float field takes one
            ok = http.post("/completions", json={"prompt": [1, 2], "temperature": 0, "top_p": 1, "max_tokens": 2, "seed": 3})
            assert ok.status_code == 200 and ok.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
            ok = http.post("/chat/completions", json={"messages": CHAT, "temperature": 1, "presence_penalty": 0, "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert [r["output_len"] for r in rows(tmp_path)] == [2, 3]  # no loose request reached the engine


def test_completions_logprobs_0_is_refused_as_it_asks_for_the_sampled_tokens_logprobs(tmp_path):
    """OpenAI's completions `logprobs: 0` returns the chosen tokens' log probabilities (with no
    alternatives): it is a request, not the neutral value, which is null."""
    with running(tmp_path, NOW) as (base, srv):
        with httpx.Client(base_url=base, timeout=30) as http:
            assert_openai_error(http.post("/completions", json={"prompt": "a", "max_tokens": 1, "logprobs": 0}), 400, "logprobs", 0)
            ok = http.post("/completions", json={"prompt": "a", "max_tokens": 1, "logprobs": None})
            assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"] is None
    assert [r["output_len"] for r in rows(tmp_path)] == [1]


def test_a_body_not_utf8_or_not_sent_as_json_is_a_400_saying_so(tmp_path):
    with running(tmp_path, NOW) as (base, srv):
        with httpx.Client(base_url=base, timeout=30) as http:
            resp = http.post("/completions", content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"})
            assert_openai_error(resp, 400, "body", "not UTF-8")
            assert "not UTF-8" in resp.json()["error"]["message"]
            resp = http.post("/completions", content=b'{"prompt": "a", "max_tokens": 1}', headers={"content-type": "text/plain"})
            assert_openai_error(resp, 400, "body", "text/plain")
            assert "Content-Type is 'text/plain'" in resp.json()["error"]["message"]
            resp = http.post("/completions", content=b'{"prompt": "a", "max_tokens": 1}')
            assert_openai_error(resp, 400, "body", "no content-type")
            assert "no Content-Type" in resp.json()["error"]["message"]
            # sent as JSON, a field's own error still names the field
            resp = http.post("/completions", content=b'{"prompt": "a", "max_tokens": "1"}', headers={"content-type": "application/json; charset=utf-8"})
            assert_openai_error(resp, 400, "max_tokens", "json")


def test_a_lone_surrogate_is_a_400_naming_where_it_is(tmp_path):
    with running(tmp_path, NOW) as (base, srv):
        with httpx.Client(base_url=base, timeout=30) as http:
            for path, raw, param in SURROGATES:
                resp = http.post(f"/{path}", content=raw, headers={"content-type": "application/json"})
                assert_openai_error(resp, 400, param, raw)
                assert "surrogate" in resp.json()["error"]["message"]
            # a surrogate pair is a character, and is served
            ok = http.post("/completions", content=rb'{"prompt": "\ud83d\ude00", "max_tokens": 1}', headers={"content-type": "application/json"})
            assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 4  # U+1F600: 4 bytes of UTF-8
    assert [r["output_len"] for r in rows(tmp_path)] == [1]


def test_null_means_the_default_as_absence_does():
    nulls = {"max_tokens": None, "temperature": None, "top_p": None, "top_k": None, "n": None, "stream": None, "stream_options": None,
             "stop": None, "seed": None, "user": None, "presence_penalty": None, "frequency_penalty": None, "logit_bias": None,
             "stop_token_ids": None, "ignore_eos": None, "priority": None}  # fmt: skip
    with running(None, NOW) as (base, srv):
        with httpx.Client(base_url=base, timeout=60) as http:
            absent = http.post("/completions", json={"prompt": "a"}).json()
            assert absent["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens
            null = http.post("/completions", json={"prompt": "a", "max_tokens": None})
            assert null.status_code == 200 and null.json()["usage"] == absent["usage"], null.text
            null = http.post("/completions", json={"prompt": "a", **nulls, "echo": None, "best_of": None, "logprobs": None, "suffix": None})
            assert null.status_code == 200 and null.json()["usage"] == absent["usage"], null.text
            assert null.headers["content-type"].startswith("application/json")  # stream: null is no stream
            # chat: with no max_tokens, what the model's length leaves after the prompt
            chat = http.post("/chat/completions", json={"messages": CHAT, **nulls, "max_completion_tokens": None, "logprobs": None,
                                                        "top_logprobs": None, "response_format": None, "tools": None,
                                                        "tool_choice": None, "parallel_tool_calls": None})  # fmt: skip
            assert chat.status_code == 200, chat.text
            usage = chat.json()["usage"]
            assert usage["completion_tokens"] == srv.cfg.model.max_model_len - usage["prompt_tokens"] > 16
            # a required field is not defaulted
            assert_openai_error(http.post("/completions", json={"prompt": None}), 400, "prompt", "null prompt")
            assert_openai_error(http.post("/chat/completions", json={"messages": None}), 400, "messages", "null messages")


def test_a_completions_default_length_stops_at_the_context_left():
    """The default max_tokens (16) is the server's, not the client's: near the model's length it
    is cut to what the context leaves, where a max_tokens the client sent is refused by name."""
    with running(None, NOW) as (base, srv):
        limit = srv.cfg.model.max_model_len
        with httpx.Client(base_url=base, timeout=60) as http:
            prompt = [3] * (limit - 5)
            for body in ({"prompt": prompt}, {"prompt": prompt, "max_tokens": None}):
                r = http.post("/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["usage"] == {"prompt_tokens": limit - 5, "completion_tokens": 5, "total_tokens": limit}
                assert r.json()["choices"][0]["finish_reason"] == "length"
            assert_openai_error(http.post("/completions", json={"prompt": prompt, "max_tokens": 16}), 400, "max_tokens",
                                "an explicit max_tokens past the context")  # fmt: skip


def test_stream_options_without_a_stream_is_a_400():
    bodies = [
        ("completions", {"prompt": "a", "max_tokens": 1, "stream_options": {"include_usage": True}}),
        ("completions", {"prompt": "a", "max_tokens": 1, "stream": False, "stream_options": {"include_usage": False}}),
        ("chat/completions", {"messages": CHAT, "max_tokens": 1, "stream_options": {"include_usage": True}}),
    ]
    with running(None, NOW) as (base, srv):
        with httpx.Client(base_url=base, timeout=30) as http:
            for path, body in bodies:
                assert_openai_error(http.post(f"/{path}", json=body), 400, "stream_options", body)
            streamed = http.post("/completions", json={"prompt": "a", "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}})
            assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")


def _raw_exchange(port: int, head: bytes, body_parts: list[bytes]) -> tuple[int, dict]:
    """Send a request's head and the given body bytes (not necessarily the whole body), then
    read the response: its status and JSON body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(head)
        for part in body_parts:
            conn.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
            chunk = conn.recv(65536)
            assert chunk, f"the server closed the connection: {data!r}"
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def _content_length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    return next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length:"))


def test_a_body_over_server_max_body_bytes_is_a_413_before_it_is_read(tmp_path):
    limit = 1024
    with pytest.raises(ValueError, match=r"server.max_body_bytes must be >= 1"):
        serve_config("server.max_body_bytes=0")
    with running(tmp_path, NOW, f"server.max_body_bytes={limit}") as (base, srv):
        port = int(base.split(":")[-1].split("/")[0])

        def body(size: int) -> bytes:  # a valid request of exactly `size` bytes
            head = b'{"max_tokens": 1, "prompt": "'
            return head + b"a" * (size - len(head) - 2) + b'"}'

        with httpx.Client(base_url=base, timeout=30) as http:
            headers = {"content-type": "application/json"}
            # with a Content-Length, and chunked (a generator body has none)
            assert_openai_error(http.post("/completions", content=body(limit + 1), headers=headers), 413, "body", "length")
            chunks = [body(limit + 1)[i : i + 100] for i in range(0, limit + 1, 100)]
            assert_openai_error(http.post("/completions", content=iter(chunks), headers=headers), 413, "body", "chunked")
            assert "server.max_body_bytes" in http.post("/completions", content=body(limit + 1), headers=headers).json()["error"]["message"]
            # at the limit, both ways are served
            assert http.post("/completions", content=body(limit), headers=headers).status_code == 200
            chunks = [body(limit)[i : i + 100] for i in range(0, limit, 100)]
            assert http.post("/completions", content=iter(chunks), headers=headers).status_code == 200

        # the 413 comes without the body: a Content-Length over the limit with none of it sent,
        # and a chunked upload that passes the limit and never ends
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        status, error = _raw_exchange(port, head + b"content-length: 100000000\r\n\r\n", [b'{"prompt": "'])
        assert status == 413 and error["error"]["param"] == "body"
        chunk = b"a" * 600
        status, error = _raw_exchange(port, head + b"transfer-encoding: chunked\r\n\r\n", [b"%x\r\n%b\r\n" % (len(chunk), chunk)] * 2)
        assert status == 413 and error["error"]["param"] == "body"
        with httpx.Client(base_url=base, timeout=30) as http:
            assert http.get("/models").status_code == 200  # still serving
    assert [r["output_len"] for r in rows(tmp_path)] == [1, 1]  # only the two within the limit reached the engine


def test_a_reused_x_request_id_gets_a_unique_id_and_keeps_the_clients(tmp_path):
    def post(http: httpx.Client, path: str, rid: str) -> str:
        body = {"prompt": "a", "max_tokens": 1} if path == "completions" else {"messages": CHAT, "max_tokens": 1}
        resp = http.post(f"/{path}", json=body, headers={"X-Request-ID": rid})
        assert resp.status_code == 200, resp.text
        return resp.json()["id"]

    with running(tmp_path, NOW) as (base, srv):
        with httpx.Client(base_url=base, timeout=30) as http:
            ids = [post(http, "completions", "dup"), post(http, "completions", "dup"), post(http, "chat/completions", "dup"),
                   post(http, "completions", "dup@2"), post(http, "completions", "dup")]  # fmt: skip
    # the chat request's id differs by its prefix; a client's own "dup@2" is taken by then
    assert ids == ["cmpl-dup", "cmpl-dup@2", "chatcmpl-dup", "cmpl-dup@2@2", "cmpl-dup@3"]
    table = rows(tmp_path)
    assert [r["request_id"] for r in table] == ids
    assert [r["original_request_id"] for r in table] == [None, "cmpl-dup", None, "cmpl-dup@2", "cmpl-dup"]


def test_an_x_request_id_in_flight_is_refused_after_a_rename_too(tmp_path):
    """The X-Request-ID a live request was sent with is in flight, whether that request kept
    it or was renamed (`@2`) because an ended request had it first."""
    with running(tmp_path) as (base, srv):  # paced: 2 ms a token, so the stream below is live
        with httpx.Client(base_url=base, timeout=30) as http:
            head = {"X-Request-ID": "dup"}
            assert http.post("/completions", json={"prompt": "a", "max_tokens": 1}, headers=head).json()["id"] == "cmpl-dup"
            body = {"prompt": "a", "max_tokens": 1000, "stream": True}
            with http.stream("POST", "/completions", json=body, headers=head) as live:
                lines = live.iter_lines()
                assert json.loads(next(lines)[6:])["id"] == "cmpl-dup@2"  # renamed, and running
                again = http.post("/completions", json={"prompt": "a", "max_tokens": 1}, headers=head)
                assert_openai_error(again, 400, "x-request-id", "in flight under a new name")
    assert [r["request_id"] for r in rows(tmp_path)] == ["cmpl-dup", "cmpl-dup@2"]
