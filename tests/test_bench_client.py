"""cbjax-bench's send_one against a scripted local server: what it records of a stream (token
times, usage, finish reason) and of each way a request fails."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from test_bench_http import HEAD, bytewise, chunked, cut, scripted_server, sized
from cbjax.bench.client import loads, send_one
from cbjax.bench.config import BenchClientConfig
from cbjax.bench.http import Client
from cbjax.core.request import Request


def sse(*chunks) -> bytes:
    return b"".join(b"data: %s\n\n" % (c if isinstance(c, bytes) else json.dumps(c).encode()) for c in chunks)


def text(t, reason=None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": reason}], "usage": None}


def delta(d, reason=None) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
COMPLETION = sse(text("a"), text(""), text("c"), text("", "length"), USAGE, b"[DONE]")
CHAT = sse(delta({"role": "assistant", "content": ""}), delta({"content": "x"}), delta({"content": "y"}), delta({}, "stop"), b"[DONE]")


def send(answer, endpoint: str = "completions", timeout_s: float = 60.0, close: bool = False):
    async def run():
        server, url, log = await scripted_server([answer], close_after={0} if close else set())
        cfg = BenchClientConfig(url=url, endpoint=endpoint, prompt="text" if endpoint == "chat" else "ids", timeout_s=timeout_s)
        client = Client(url)
        req = Request(request_id="r7", arrival_s=0.0, prompt_len=4, prompt_token_ids=[1, 2, 3, 4], target_output_len=3)
        t0 = time.perf_counter()
        try:
            return await send_one(client, cfg, "m", req, t0, "run"), log
        finally:
            await client.aclose()
            server.close()

    return asyncio.run(run())


def test_a_completion_stream_however_it_is_split():
    for answer in (chunked(COMPLETION), bytewise(chunked(*cut(COMPLETION, 7, 50, 51, 200)))):
        timing, log = send(answer)
        assert timing.error is None and timing.status == 200
        assert len(timing.token_s) == 3 and timing.finish_reason == "length" and timing.completion_tokens == 3
        assert timing.send_s <= timing.token_s[0] <= timing.token_s[1] <= timing.token_s[2] <= timing.end_s
        body = json.loads(log[0][2])
        assert body["max_tokens"] == 3 and body["stream"] is True and b"x-request-id: run-r7\r\n" in log[0][1]


def test_a_chat_stream_counts_neither_its_role_nor_its_finish_chunk():
    timing, log = send(chunked(CHAT), endpoint="chat")
    assert timing.error is None and len(timing.token_s) == 2 and timing.finish_reason == "stop"
    assert timing.completion_tokens is None and log[0][1].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")


def test_each_way_a_request_fails_is_named():
    ended = send(chunked(sse(text("a"), text("b", "length"))))[0]
    assert ended.error == "the stream ended without data: [DONE]" and len(ended.token_s) == 2
    bad_json = send(chunked(sse(text("a")) + b"data: {nope\n\n"))[0]
    assert bad_json.error.startswith("JSONDecodeError: Expecting property name") and len(bad_json.token_s) == 1
    refused = send(sized(429, json.dumps({"error": {"message": "busy"}}).encode()))[0]
    assert refused.error == "HTTP 429: busy" and refused.status == 429 and refused.token_s == []
    in_stream = send(chunked(sse(text("a"), {"error": {"message": "engine died"}}, b"[DONE]")))[0]
    assert in_stream.error == "stream error: engine died" and len(in_stream.token_s) == 1
    cut_short = send(HEAD + b"transfer-encoding: chunked\r\n\r\n5\r\ndata:\r\n", close=True)[0]
    assert cut_short.error == "HTTPError: the server closed the connection mid-body" and cut_short.status == 200


def test_a_request_past_its_timeout_is_named():
    async def run():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(HEAD + b"transfer-encoding: chunked\r\n\r\n")  # and nothing more
            await asyncio.sleep(5)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
        client = Client(url)
        req = Request(request_id="r1", arrival_s=0.0, prompt_len=4, prompt_token_ids=[1, 2, 3, 4], target_output_len=3)
        try:
            return await send_one(client, BenchClientConfig(url=url, timeout_s=0.2), "m", req, time.perf_counter(), "run")
        finally:
            await client.aclose()
            server.close()

    timing = asyncio.run(run())
    assert timing.error == "no answer within bench.timeout_s=0.2" and timing.status == 200 and timing.token_s == []


@pytest.mark.parametrize("data", [b'{"a": [1, 2.5, null, true], "t": "caf\xc3\xa9 \xf0\x9f\x98\x80"}', b'{"t": "\\ud83d\\ude00 \\n"}',
                                  b"[1]", b'"s"', b"7", b'{"a": 1} x', b'{"a": 1}{"b": 2}', b"", b"nope", b'{"a": }', b'{"a": 1'])  # fmt: skip
def test_loads_is_json_loads_for_a_stripped_line(data):
    try:
        want = ("value", json.loads(data))
    except ValueError as e:
        want = ("error", type(e), str(e))
    try:
        got = ("value", loads(data))
    except ValueError as e:
        got = ("error", type(e), str(e))
    assert got == want
