"""cbjax-bench's client against scripted local servers: the data: lines of an event stream
however it is split, what send_one records of a stream (token times, usage, finish reason) and
of each way a request fails, and the load's check of bench.url."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from typing import Callable, Optional

import pytest

from cbjax.bench.client import check_server, open_session
from cbjax.bench.config import BenchClientConfig
from cbjax.bench.stream import DataLines, loads, send_one
from cbjax.core.request import Request

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


async def scripted_server(answers, close_after: frozenset[int] = frozenset(), wrote: Optional[list] = None, pause_s: float = 0.002):
    """A server on 127.0.0.1 that answers the n-th request it reads with answers[n] (or
    answers(n, head) where answers is callable), closing the connection after the requests
    numbered in `close_after`. An answer that is a list of byte strings goes out as one write
    each, `pause_s` apart (so that the client reads them apart); `wrote`, if given, gets each
    write's bytes and the time.perf_counter() just before it; an answer that is a coroutine
    function is awaited with the writer. Returns the server, its URL and the log of
    (connection number, request head, body) it received."""
    log: list[tuple[int, bytes, bytes]] = []
    conns = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        me = conns
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):  # the client closed it
                break
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
            body = await reader.readexactly(length)
            n = len(log)
            log.append((me, head, body))
            answer = answers(n, head) if callable(answers) else answers[n]
            if callable(answer):
                await answer(writer)
            else:
                for i, part in enumerate([answer] if isinstance(answer, bytes) else answer):
                    if i:
                        await asyncio.sleep(pause_s)
                    if wrote is not None:
                        wrote.append((part, time.perf_counter()))
                    writer.write(part)
                    await writer.drain()
            if n in close_after:
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", log


@contextmanager
def server_thread(start: Callable):
    """Runs `start()` (a coroutine returning (server, url, ...)) on an event loop of its own
    thread; yields the URL. For a client in another process."""
    loop = asyncio.new_event_loop()
    box: dict = {}
    ready = threading.Event()

    def run() -> None:
        box["server"], box["url"], *_ = loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    async def stop() -> None:  # the server and the handlers still waiting
        box["server"].close()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()
        loop.stop()

    try:
        yield box["url"]
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop)
        thread.join(timeout=30)


def chunked(*parts: bytes) -> bytes:
    return HEAD + b"transfer-encoding: chunked\r\n\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def sized(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


def cut(data: bytes, *at: int) -> list[bytes]:
    edges = [0, *at, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:])]


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def sse(*chunks) -> bytes:
    return b"".join(b"data: %s\n\n" % (c if isinstance(c, bytes) else json.dumps(c).encode()) for c in chunks)


def text(t, reason=None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": reason}], "usage": None}


def delta(d, reason=None) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
COMPLETION = sse(text("a"), text(""), text("c"), text("", "length"), USAGE, b"[DONE]")
CHAT = sse(delta({"role": "assistant", "content": ""}), delta({"content": "x"}), delta({"content": "y"}), delta({}, "stop"), b"[DONE]")
MODELS = sized(200, json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode())


def request(rid: str = "r7") -> Request:
    return Request(request_id=rid, arrival_s=0.0, prompt_len=4, prompt_token_ids=[1, 2, 3, 4], target_output_len=3)


def send(answer, endpoint: str = "completions", timeout_s: float = 10.0, close: bool = False, n: int = 1, **cfg_kw):
    """send_one `n` times, one after another, to a server answering each with `answer`; returns
    the Timing (a list of them for n > 1) and the server's log."""

    async def run():
        server, url, log = await scripted_server([answer] * n, close_after=frozenset({0}) if close else frozenset())
        cfg = BenchClientConfig(url=url, endpoint=endpoint, prompt="text" if endpoint == "chat" else "ids", timeout_s=timeout_s, **cfg_kw)
        try:
            async with open_session(cfg) as session:
                return [await send_one(session, cfg, "m", request(f"r{7 + i}"), time.perf_counter(), "run") for i in range(n)], log
        finally:
            server.close()

    timings, log = asyncio.run(run())
    return (timings[0] if n == 1 else timings), log


# An event stream with what it may hold besides data lines: a comment, an event name, CRLF line
# ends, a data line with no space after the colon, a JSON string with an escaped newline.
SSE = (b": keep-alive\n\n"
       b'data: {"i": 0}\n\n'
       b'event: tick\r\ndata: {"i": 1}\r\n\r\n'
       b'data:{"i": 2}\n\n'
       b'data: {"t": "a\\nb"}\n\n'
       b"data: [DONE]\n\n")  # fmt: skip
DATA = [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}', b'{"t": "a\\nb"}', b"[DONE]"]


def test_data_lines_come_whole_however_the_stream_is_split():
    splits = [[SSE], bytewise(SSE), *(cut(SSE, i) for i in range(1, len(SSE))), cut(SSE, 3, 17, 18, 40, 41, 60)]
    for pieces in splits:
        lines = DataLines()
        got = [value for piece in pieces for value in lines.feed(piece)]
        assert got == DATA and lines.end() == [], pieces
    lines = DataLines()  # a last line without its line end comes at the end
    assert lines.feed(b'data: {"i": 0}\n\ndata: [DONE]') == [b'{"i": 0}'] and lines.end() == [b"[DONE]"]


def test_a_completion_stream_however_it_is_framed_and_split():
    awkward = COMPLETION.index(b'"text": ""') + 4
    for answer in (chunked(COMPLETION),
                   chunked(*(e + b"\n\n" for e in COMPLETION.split(b"\n\n")[:-1])),  # a chunk per event
                   cut(chunked(*cut(COMPLETION, 7, awkward, 200)), 20, 90, 91, 250),
                   HEAD + b"content-length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION)):  # fmt: skip
        timing, log = send(answer)
        assert timing.error is None and timing.status == 200
        assert len(timing.token_s) == 3 and timing.finish_reason == "length" and timing.completion_tokens == 3
        assert timing.send_s <= timing.token_s[0] <= timing.token_s[1] <= timing.token_s[2] <= timing.end_s
        body = json.loads(log[0][2])
        assert body["max_tokens"] == 3 and body["stream"] is True and body["prompt"] == [1, 2, 3, 4]
        assert log[0][1].startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"x-request-id: run-r7\r\n" in log[0][1].lower()


def test_a_stream_the_server_ends_by_closing_the_connection():
    # no [DONE]; the last token's line has no line end
    timing, _ = send(HEAD + b"\r\n" + sse(text("a"), text("b")) + b'data: {"choices": [{"text": "z"}]}', close=True)
    assert timing.error == "the stream ended without data: [DONE]" and len(timing.token_s) == 3
    timing, _ = send(HEAD + b"\r\n" + sse(text("a"), text("b", "length")) + b"data: [DONE]", close=True)
    assert timing.error is None and len(timing.token_s) == 2 and timing.finish_reason == "length"


def test_a_chat_stream_counts_neither_its_role_nor_its_finish_chunk_and_sends_the_key():
    timing, log = send(chunked(CHAT), endpoint="chat", api_key="k")
    assert timing.error is None and len(timing.token_s) == 2 and timing.finish_reason == "stop"
    assert timing.completion_tokens is None and log[0][1].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"authorization: bearer k\r\n" in log[0][1].lower()


def test_each_token_is_stamped_when_its_bytes_came():
    events = [sse(text(str(i))) for i in range(5)]
    answer = [HEAD + b"transfer-encoding: chunked\r\n\r\n"] + [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]

    async def run():
        wrote: list[tuple[bytes, float]] = []
        server, url, _ = await scripted_server([answer], wrote=wrote, pause_s=0.005)
        cfg = BenchClientConfig(url=url)
        t0 = time.perf_counter()
        async with open_session(cfg) as session:
            timing = await send_one(session, cfg, "m", request(), t0, "run")
        server.close()
        return wrote, timing, t0

    wrote, timing, t0 = asyncio.run(run())
    assert len(timing.token_s) == 5
    written = [at for _, at in wrote[1:]]  # one write per token's chunk, then the last chunk
    for i, stamp in enumerate(timing.token_s):
        assert written[i] <= t0 + stamp <= written[i + 1]  # on one clock: after its bytes, before the next's


def test_each_way_a_request_fails_is_named():
    ended = send(chunked(sse(text("a"), text("b", "length"))))[0]
    assert ended.error == "the stream ended without data: [DONE]" and len(ended.token_s) == 2
    bad_json = send(chunked(sse(text("a")) + b"data: {nope\n\n"))[0]
    assert bad_json.error.startswith("JSONDecodeError: Expecting property name") and len(bad_json.token_s) == 1
    not_object = send(chunked(sse(text("a")) + b"data: [1]\n\n"))[0]
    assert not_object.error == "ValueError: a data: line that is not a JSON object: [1]"
    refused = send(sized(429, json.dumps({"error": {"message": "busy"}}).encode()))[0]
    assert refused.error == "HTTP 429: busy" and refused.status == 429 and refused.token_s == []
    in_stream = send(chunked(sse(text("a"), {"error": {"message": "engine died"}}, b"[DONE]")))[0]
    assert in_stream.error == "stream error: engine died" and len(in_stream.token_s) == 1
    cut_short = send(HEAD + b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(sse(text("a"))), sse(text("a"))), close=True)[0]
    assert cut_short.error == "the server closed the connection mid-body" and cut_short.status == 200 and len(cut_short.token_s) == 1
    no_answer = send(b"", close=True)[0]
    assert no_answer.error == "the server closed the connection before answering" and no_answer.status is None
    not_http = send(b"SSH-2.0-OpenSSH\r\n", close=True)[0]
    assert not_http.error.startswith("malformed response: Bad status line")
    bad_chunk = send(HEAD + b"transfer-encoding: chunked\r\n\r\nzz\r\n", close=True)[0]
    assert bad_chunk.error.startswith("malformed response: Invalid character in chunk size")
    assert all(t.aborted is False for t in (ended, bad_json, refused, in_stream, cut_short, no_answer, not_http))


def test_a_request_past_its_timeout_is_named():
    async def stall(writer):
        writer.write(HEAD + b"transfer-encoding: chunked\r\n\r\n")  # and nothing more
        await asyncio.sleep(5)

    timing, _ = send(stall, timeout_s=0.2)
    assert timing.error == "no answer within bench.timeout_s=0.2" and timing.status == 200 and timing.token_s == []


def test_a_cancelled_request_returns_what_came_as_aborted():
    got_one = asyncio.Event()

    async def one_token_then_stall(writer):
        writer.write(chunked(sse(text("a")))[: -len(b"0\r\n\r\n")])
        await writer.drain()
        got_one.set()
        await asyncio.sleep(5)

    async def run():
        server, url, _ = await scripted_server([one_token_then_stall])
        cfg = BenchClientConfig(url=url)
        async with open_session(cfg) as session:
            task = asyncio.create_task(send_one(session, cfg, "m", request(), time.perf_counter(), "run"))
            await got_one.wait()
            while not task.done():
                await asyncio.sleep(0.01)
                task.cancel()
            timing = await task  # returns, does not raise
        server.close()
        return timing

    timing = asyncio.run(run())
    assert timing.aborted and timing.error == "cancelled" and len(timing.token_s) == 1 and timing.end_s is not None


def test_a_stream_read_to_its_end_leaves_its_connection_for_the_next_request():
    timings, log = send(chunked(COMPLETION), n=2)
    assert [t.error for t in timings] == [None, None] and [len(t.token_s) for t in timings] == [3, 3]
    assert [conn for conn, _, _ in log] == [1, 1]


def test_under_uvloop_too():
    uvloop = pytest.importorskip("uvloop")  # what cbjax-bench runs on where installed

    async def run():
        server, url, _ = await scripted_server([cut(chunked(COMPLETION), 30, 100, 101)])
        cfg = BenchClientConfig(url=url)
        async with open_session(cfg) as session:
            timing = await send_one(session, cfg, "m", request(), time.perf_counter(), "run")
        server.close()
        return timing

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        timing = runner.run(run())
    assert timing.error is None and len(timing.token_s) == 3


def check(answers, base: str = "/v1", **cfg_kw) -> str:
    async def run():
        server, url, _ = await scripted_server(answers, close_after=frozenset({0}))
        url = url.removesuffix("/v1") + base
        try:
            async with open_session(BenchClientConfig(url=url, **cfg_kw)) as session:
                return await check_server(session, BenchClientConfig(url=url, **cfg_kw))
        finally:
            server.close()

    return asyncio.run(run())


def test_the_server_check_picks_the_model_or_names_why_not():
    assert check([MODELS]) == "tiny"
    assert check([sized(404, b"<html>\n<body>Not Found</body>\n</html>")], model="m") == "m"  # bench.model set: a 404 is fine
    with pytest.raises(ValueError, match=r"^bench.model: unset, and GET http://127.0.0.1:\d+/v1/models answered 404: <html> <body>Not Found"):
        check([sized(404, b"<html>\n<body>Not Found</body>\n</html>")])
    assert "usually ends" not in str(pytest.raises(ValueError, check, [sized(404, b"")]).value)
    with pytest.raises(ValueError, match=r"^bench.model: unset, and GET http://127.0.0.1:\d+/models answered 404: .*; an OpenAI base URL usually ends in /v1$"):
        check([sized(404, b"")], base="")
    with pytest.raises(ValueError, match=r"lists no model"):
        check([sized(200, b'{"data": []}')])
    with pytest.raises(ValueError, match=r"answered no model list: 'nope'"):
        check([sized(200, b"nope")])
    for odd in (b'{"data": [{"object": "model"}]}', b'{"data": ["tiny"]}', b'{"data": [{"id": 7}]}'):  # a list without ids
        with pytest.raises(ValueError, match=r"^bench.model: unset, and GET http://127.0.0.1:\d+/v1/models answered no model list"):
            check([sized(200, odd)])
    with pytest.raises(ValueError, match=r"^bench.url=http://127.0.0.1:\d+/v1: the server closed the connection before answering$"):
        check([b""], model="m")


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


def test_a_closing_chunk_is_the_last_token_when_the_usage_counts_it():
    """vLLM sends an EOS token (no text) in the chunk that closes the stream: usage counts one
    more token than the chunks that had text. That chunk is then the last token, timed when it
    came; a closing chunk that usage does not count (COMPLETION's) is still none."""
    usage = lambda n: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}}  # noqa: E731
    head = HEAD + b"content-length: %d\r\n\r\n"
    events = [sse(text("a")), sse(text("b")), sse(text("", "stop"), usage(3), b"[DONE]")]
    timing, _ = send([head % len(b"".join(events)), *events])
    assert timing.error is None and timing.finish_reason == "stop" and len(timing.token_s) == 3
    assert timing.token_s[1] <= timing.token_s[2] <= timing.end_s
    eos_only = sse(text("", "stop"), usage(1), b"[DONE]")
    timing, _ = send(head % len(eos_only) + eos_only)
    assert timing.error is None and len(timing.token_s) == 1 and timing.completion_tokens == 1
    chat = sse(delta({"role": "assistant", "content": ""}), delta({"content": "x"}), delta({"content": ""}, "stop"), usage(2), b"[DONE]")
    timing, _ = send(chunked(chat), endpoint="chat")
    assert timing.error is None and len(timing.token_s) == 2
