"""cbjax-bench's lean HTTP/1.1 client against a scripted local server: chunked and sized bodies
read as they come, connections kept alive and reused, a stale one replaced, errors named."""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import pytest

from cbjax.bench.http import READ_LIMIT, Client, HTTPError


async def scripted_server(answers: list, close_after: set[int] = frozenset(), wrote: Optional[list] = None):
    """A server on 127.0.0.1 that answers the i-th request it reads with answers[i], closing
    the connection after the requests numbered in `close_after`. An answer that is a list of
    byte strings goes out as one write each, a few milliseconds apart (so that the client reads
    them apart); `wrote`, if given, gets each write's bytes and the time.perf_counter() just
    before it. Returns the server, its URL and the log of (connection number, request head,
    body) it received."""
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
            for i, part in enumerate([answers[n]] if isinstance(answers[n], bytes) else answers[n]):
                if i:
                    await asyncio.sleep(0.002)
                if wrote is not None:
                    wrote.append((part, time.perf_counter()))
                writer.write(part)
                await writer.drain()
            if n in close_after:
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1", log


def chunked(*parts: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def sized(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


def test_streams_lines_across_chunks_and_reuses_the_connection():
    async def run():
        server, url, log = await scripted_server([chunked(b"data: 1\n\nda", b"ta: 2\n", b"\ndata: [DONE]\n\n"), sized(404, b'{"e": 1}')])
        client = Client(url, {"Authorization": "Bearer k"})
        resp = await client.request("POST", "/completions", b'{"a": 1}', {"x-request-id": "r1"})
        lines = [line async for line in resp.lines()]
        resp.release()
        second = await client.request("GET", "/models")
        body = await second.read()
        second.release()
        await client.aclose()
        server.close()
        return resp, lines, second, body, log

    resp, lines, second, body, log = asyncio.run(run())
    assert resp.status_code == 200 and lines == [b"data: 1", b"", b"data: 2", b"", b"data: [DONE]", b""]
    assert second.status_code == 404 and body == b'{"e": 1}'
    (c1, head1, body1), (c2, head2, _) = log
    assert c1 == c2 == 1  # the second request went over the first one's connection
    assert head1.startswith(b"POST /v1/completions HTTP/1.1\r\n") and body1 == b'{"a": 1}'
    assert b"authorization: Bearer k\r\n" in head1 and b"x-request-id: r1\r\n" in head1 and b"content-length: 8\r\n" in head1
    assert head2.startswith(b"GET /v1/models HTTP/1.1\r\n")


def test_a_connection_the_server_closed_is_replaced():
    async def run():
        server, url, log = await scripted_server([sized(200, b"a"), sized(200, b"b")], close_after={0})
        client = Client(url)
        bodies = []
        for _ in range(2):
            resp = await client.request("GET", "/x")
            bodies.append(await resp.read())
            resp.release()
            await asyncio.sleep(0.05)  # the server's close reaches the idle connection
        await client.aclose()
        server.close()
        return bodies, log

    bodies, log = asyncio.run(run())
    assert bodies == [b"a", b"b"] and [c for c, _, _ in log] == [1, 2]


def test_errors_name_what_failed():
    async def refused():
        server, url, _ = await scripted_server([])
        server.close()
        await server.wait_closed()
        await Client(url).request("GET", "/models")

    with pytest.raises(HTTPError, match="cannot connect to 127.0.0.1"):
        asyncio.run(refused())

    async def cut():
        server, url, _ = await scripted_server([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab"], close_after={0})
        resp = await Client(url).request("GET", "/x")
        try:
            await resp.read()
        finally:
            server.close()

    with pytest.raises(HTTPError, match="malformed body"):
        asyncio.run(cut())
    with pytest.raises(ValueError, match="bench.url"):
        Client("ftp://host/v1")


# An SSE body with what a stream may hold besides data lines: a comment, an event name, CRLF
# line ends, a data line with no space after the colon, a JSON string with an escaped newline.
SSE = (b": keep-alive\n\n"
       b'data: {"i": 0}\n\n'
       b'event: tick\r\ndata: {"i": 1}\r\n\r\n'
       b'data:{"i": 2}\n\n'
       b'data: {"t": "a\\nb"}\n\n'
       b"data: [DONE]\n\n"
       b'data: {"after": 1}\n\n')  # fmt: skip
DATA = [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}', b'{"t": "a\\nb"}', b"[DONE]", b'{"after": 1}']
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


def cut(data: bytes, *at: int) -> list[bytes]:
    edges = [0, *at, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:])]


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


# the offsets of awkward places in SSE: inside `data:`, between a CR and its LF, inside the
# JSON, between an event's two line ends, and one byte before the end
AWKWARD = (SSE.index(b"data: {") + 2, SSE.index(b"\r\n") + 1, SSE.index(b'"i": 1') + 3, SSE.index(b'2}\n') + 3, len(SSE) - 1)
FRAMINGS = {
    "one chunk": chunked(SSE),
    "a chunk per event": chunked(*(e + b"\n\n" for e in SSE.split(b"\n\n")[:-1])),
    "events split across chunks": chunked(*cut(SSE, *AWKWARD)),
    "a byte per chunk": chunked(*bytewise(SSE)),
    "chunk extensions and trailers": HEAD + b"transfer-encoding: chunked\r\n\r\n"
    + b"".join(b"%X;name=x\r\n%s\r\n" % (len(p), p) for p in cut(SSE, *AWKWARD)) + b"0\r\nx-trailer: 1\r\n\r\n",
    "content-length": HEAD + b"content-length: %d\r\n\r\n%s" % (len(SSE), SSE),
}
# how the response goes over TCP: whole, a write per byte, or split inside the status line,
# the headers' end, a chunk-size line, between a chunk-size line's CR and LF, between a chunk's
# data and its CRLF, and inside the last chunk
WRITES = {
    "one write": lambda r: r,
    "a write per byte": bytewise,
    "awkward writes": lambda r: cut(r, 5, r.index(b"\r\n\r\n") + 3, r.index(b"\r\n\r\n") + 5, r.index(b"\r\n\r\n") + 6,
                                    r.index(b"\r\n", r.index(b"\r\n\r\n") + 4) + 1 + 10, len(r) - 3),
}  # fmt: skip


def data_of(lines: list[bytes]) -> list[bytes]:
    """The values of a stream's `data:` lines, as an SSE reader takes them."""
    return [line[5:].strip() for line in lines if line.startswith(b"data:")]


async def one_response(answer, how: str, close: bool = False):
    """Send one request to a server that answers with `answer`; read the body with `lines`
    or `sse_data` (stopping at [DONE] when `how` is "sse_done"). Returns what came and
    whether sse_data said on_data stopped it."""
    server, url, _ = await scripted_server([answer], close_after={0} if close else set())
    client = Client(url)
    try:
        resp = await client.request("POST", "/completions", b"{}")
        if how == "lines":
            return data_of([line async for line in resp.lines()]), None
        got: list[bytes] = []

        def on_data(stamp: float, value: bytes) -> bool:
            got.append(value)
            return how == "sse_done" and value == b"[DONE]"

        stopped = await resp.sse_data(on_data)
        resp.release()
        return got, stopped
    finally:
        await client.aclose()
        server.close()


# a write per byte of the framings with many chunks adds time and no new case
SPLITS = [(f, w) for f in FRAMINGS for w in WRITES if not (w == "a write per byte" and f in ("a chunk per event", "a byte per chunk"))]


@pytest.mark.parametrize("how", ["lines", "sse", "sse_done"])
@pytest.mark.parametrize("framing, writes", SPLITS)
def test_data_lines_come_whole_however_the_body_is_framed_and_split(framing, writes, how):
    got, stopped = asyncio.run(one_response(WRITES[writes](FRAMINGS[framing]), how))
    if how == "sse_done":
        assert got == DATA[:5] and stopped is True  # nothing after [DONE]
    else:
        assert got == DATA and stopped in (None, False)


@pytest.mark.parametrize("how", ["lines", "sse"])
def test_a_body_read_to_the_close_and_a_last_line_without_its_end(how):
    got, _ = asyncio.run(one_response(cut(HEAD + b"\r\n" + SSE[:-1] + b"data: last", 40, 80), how, close=True))
    assert got == [*DATA, b"last"]
    got, _ = asyncio.run(one_response(chunked(b'data: {"i": 0}\n\ndata: [DONE]'), how))
    assert got == [b'{"i": 0}', b"[DONE]"]


E0 = b'data: {"i": 0}\n\n'
CHUNKED_HEAD = HEAD + b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(E0), E0)
CUTS = {  # a response the server closes mid-body, what comes before, and the error
    "mid-chunk": (CHUNKED_HEAD + b'20\r\ndata: {"i"', "malformed body"),
    "between chunks": (CHUNKED_HEAD, "closed the connection mid-body"),
    "mid-length": (HEAD + b'content-length: 100\r\n\r\n%sdata: {"i"' % E0, "closed the connection mid-body"),
    "bad chunk size": (CHUNKED_HEAD + b"zz\r\n", "malformed body"),
}  # fmt: skip


@pytest.mark.parametrize("how", ["lines", "sse"])
@pytest.mark.parametrize("case", list(CUTS))
def test_a_body_cut_short_is_an_http_error_after_what_came_whole(case, how):
    answer, message = CUTS[case]
    got: list[bytes] = []

    async def run():
        server, url, _ = await scripted_server([cut(answer, len(answer) - 4)], close_after={0})
        resp = await Client(url).request("GET", "/x")
        try:
            if how == "lines":
                async for line in resp.lines():
                    got.extend(data_of([line]))
            else:
                await resp.sse_data(lambda stamp, value: got.append(value))
        finally:
            resp.release()
            server.close()

    with pytest.raises(HTTPError, match=message):
        asyncio.run(run())
    assert got == [b'{"i": 0}']


def test_sse_data_stops_where_on_data_says_and_the_connection_is_reused():
    async def run():
        server, url, log = await scripted_server([chunked(SSE), sized(200, b"x"), chunked(SSE), sized(200, b"y")])
        client = Client(url)
        got, stops = [], []
        for _ in range(2):
            resp = await client.request("POST", "/completions", b"{}")
            stops.append(await resp.sse_data(lambda stamp, value: got.append(value) or value == b"[DONE]"))
            resp.release()
            second = await client.request("GET", "/models")
            got.append(await second.read())
            second.release()
        await client.aclose()
        server.close()
        return got, stops, log

    got, stops, log = asyncio.run(run())
    assert got == [*DATA[:5], b"x", *DATA[:5], b"y"] and stops == [True, True]
    assert [c for c, _, _ in log] == [1, 1, 1, 1]  # the whole body had come with [DONE]: kept alive


def test_a_stream_ended_before_its_last_chunk_is_read_on_to_it_then_pooled():
    body = chunked(SSE)
    done = body.index(b"data: [DONE]") + len(b"data: [DONE]\n\n")

    async def run(answer, close: bool):
        server, url, log = await scripted_server([answer, sized(200, b"x")], close_after={0} if close else set())
        client = Client(url)
        resp = await client.request("POST", "/completions", b"{}")
        got = []
        stopped = await resp.sse_data(lambda stamp, value: got.append(value) or value == b"[DONE]")
        resp.release()
        for _ in range(5000):  # until the rest of the body has come (or the server's close)
            if not client._draining:
                break
            await asyncio.sleep(0.001)
        second = await client.request("GET", "/models")
        tail = await second.read()
        second.release()
        await client.aclose()
        server.close()
        return got, stopped, tail, [c for c, _, _ in log]

    # the last chunk comes a little after [DONE]: the connection waits for it, then serves again
    assert asyncio.run(run(cut(body, done), close=False)) == (DATA[:5], True, b"x", [1, 1])
    # the server closes the connection without the last chunk: a new one serves the next request
    assert asyncio.run(run(body[: body.index(b"0\r\n\r\n")], close=True)) == (DATA[:5], True, b"x", [1, 2])


def test_an_error_in_on_data_ends_the_stream_and_the_connection():
    class Stop(Exception):
        pass

    async def run():
        body = chunked(SSE)
        server, url, log = await scripted_server([cut(body, body.index(b'data:{"i": 2}')), sized(200, b"x")])
        client = Client(url)
        got = []

        def on_data(stamp: float, value: bytes) -> bool:
            got.append(value)
            if len(got) == 2:
                raise Stop(value)
            return False

        resp = await client.request("POST", "/completions", b"{}")
        with pytest.raises(Stop) as err:
            await resp.sse_data(on_data)
        resp.release()
        second = await client.request("GET", "/models")
        body = await second.read()
        second.release()
        await client.aclose()
        server.close()
        return got, err.value, body, log

    got, err, body, log = asyncio.run(run())
    assert got == DATA[:2] and err.args == (DATA[1],) and body == b"x"
    assert [c for c, _, _ in log] == [1, 2]  # the body's end had not come: its connection closed


def test_each_data_line_is_stamped_by_the_read_that_brought_it():
    events = [b'data: {"i": %d}\n\n' % i for i in range(5)]
    answer = [HEAD + b"transfer-encoding: chunked\r\n\r\n"] + [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]

    async def run():
        wrote: list[tuple[bytes, float]] = []
        server, url, _ = await scripted_server([answer], wrote=wrote)
        client = Client(url)
        resp = await client.request("POST", "/completions", b"{}")
        seen = []
        await resp.sse_data(lambda stamp, value: seen.append((value, stamp, time.perf_counter())) and False)
        resp.release()
        await client.aclose()
        server.close()
        return wrote, seen

    wrote, seen = asyncio.run(run())
    assert [v for v, _, _ in seen] == [b'{"i": %d}' % i for i in range(5)]
    for (_, written), (_, stamp, called) in zip(wrote[1:], seen):
        assert written <= stamp <= called  # on the same clock, after its bytes were sent


def test_a_timeout_around_sse_data_interrupts_it():
    go = None

    async def run():
        nonlocal go
        go = asyncio.Event()

        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(CHUNKED_HEAD)
            await go.wait()
            writer.write(b'10\r\ndata: {"i": 1}\n\n\r\n0\r\n\r\n')
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = Client(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1")
        resp = await client.request("POST", "/completions", b"{}")
        got = []
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await resp.sse_data(lambda stamp, value: got.append(value))
        resp.release()
        go.set()
        await asyncio.sleep(0.05)
        server.close()
        return got

    assert asyncio.run(run()) == [b'{"i": 0}']


def test_under_uvloop_too():
    uvloop = pytest.importorskip("uvloop")  # what cbjax-bench runs on where installed
    for framing, writes in (("events split across chunks", "a write per byte"), ("content-length", "awkward writes")):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            got, stopped = runner.run(one_response(WRITES[writes](FRAMINGS[framing]), "sse_done"))
        assert got == DATA[:5] and stopped is True


@pytest.mark.parametrize("answer, message", [
    (b"SSH-2.0-OpenSSH\r\n", "not an HTTP/1.x status line: b'SSH-2.0-OpenSSH"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n", "the server closed the connection mid-headers"),
    (b"", "the server closed the connection before answering"),
])  # fmt: skip
def test_a_bad_or_cut_response_head_is_named(answer, message):
    async def run():
        server, url, _ = await scripted_server([cut(answer, 3) if answer else answer], close_after={0})
        try:
            await Client(url).request("GET", "/models")
        finally:
            server.close()

    with pytest.raises(HTTPError, match=message):
        asyncio.run(run())


def test_a_body_larger_than_the_read_buffer_comes_whole_when_read_late():
    big = bytes(range(256)) * (3 * READ_LIMIT // 256)  # the connection pauses reading, then resumes
    events = b"".join(b'data: {"i": %d}\n\n' % i for i in range(READ_LIMIT // 8))

    async def run():
        server, url, _ = await scripted_server([sized(200, big), chunked(events, b"data: [DONE]\n\n")])
        client = Client(url)
        resp = await client.request("GET", "/big")
        await asyncio.sleep(0.3)  # the body waits unread
        body = await resp.read()
        resp = await client.request("POST", "/completions", b"{}")
        await asyncio.sleep(0.3)
        got = []
        stopped = await resp.sse_data(lambda stamp, value: got.append(value) or value == b"[DONE]")
        resp.release()
        await client.aclose()
        server.close()
        return body, got, stopped

    body, got, stopped = asyncio.run(run())
    assert body == big
    assert stopped and len(got) == READ_LIMIT // 8 + 1 and got[-2:] == [b'{"i": %d}' % (READ_LIMIT // 8 - 1), b"[DONE]"]
    assert got[:-1] == [b'{"i": %d}' % i for i in range(READ_LIMIT // 8)]
