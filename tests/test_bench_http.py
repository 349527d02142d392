"""cbjax-bench's lean HTTP/1.1 client against a scripted local server: chunked and sized bodies
read as they come, connections kept alive and reused, a stale one replaced, errors named."""

from __future__ import annotations

import asyncio

import pytest

from cbjax.bench.http import Client, HTTPError


async def scripted_server(answers: list[bytes], close_after: set[int] = frozenset()):
    """A server on 127.0.0.1 that answers the i-th request it reads with answers[i], closing
    the connection after the requests numbered in `close_after`. Returns the server, its URL
    and the log of (connection number, request head, body) it received."""
    log: list[tuple[int, bytes, bytes]] = []
    conns = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        me = conns
        while True:
            head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
            if not head:
                break
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
            body = await reader.readexactly(length)
            n = len(log)
            log.append((me, head, body))
            writer.write(answers[n])
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
