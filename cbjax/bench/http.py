"""A lean HTTP/1.1 client for the load generator: asyncio streams, a keep-alive pool, chunked
and sized bodies read as they arrive.

A load client's timings include its own work between the socket and the clock reading. A
general client's layers (request and response models, a pooled connection state machine, a
pure-Python protocol parser, text and line decoders) cost milliseconds per request on a busy
CPU, and that lands in every TTFT measured. This client does only what a benchmark needs: send
a request, hand back the status, the headers and the body's bytes as they come."""

from __future__ import annotations

import asyncio
import ssl
from typing import AsyncIterator, Optional
from urllib.parse import urlsplit


class HTTPError(Exception):
    """The connection failed or the server's answer was not HTTP/1.1 as expected."""


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class Response:
    """A response whose body is read as it comes (`chunks`, `lines`) or whole (`read`); its
    connection goes back to the pool once the body is read to its end."""

    def __init__(self, client: "Client", conn: _Conn, status: int, headers: dict[str, str]):
        self.client, self.conn, self.status_code, self.headers = client, conn, status, headers
        self._done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        reader = self.conn.reader
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size_line = await reader.readline()
                    if not size_line:
                        raise HTTPError("the server closed the connection mid-body")
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                            pass
                        break
                    data = await reader.readexactly(size)
                    await reader.readexactly(2)  # the chunk's CRLF
                    yield data
            elif "content-length" in self.headers:
                left = int(self.headers["content-length"])
                while left > 0:
                    data = await reader.read(min(left, 65536))
                    if not data:
                        raise HTTPError("the server closed the connection mid-body")
                    left -= len(data)
                    yield data
            else:  # the body runs to the connection's end
                while data := await reader.read(65536):
                    yield data
                self.headers["connection"] = "close"
        except (asyncio.IncompleteReadError, ValueError) as e:
            raise HTTPError(f"malformed body: {e}") from None
        self._done = True
        self.release()

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines (without their line ends) as each completes."""
        buf = b""
        async for data in self.chunks():
            buf += data
            *whole, buf = buf.split(b"\n")
            for line in whole:
                yield line.rstrip(b"\r")
        if buf:
            yield buf

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])

    def release(self) -> None:
        """Back to the pool if the body was read whole on a connection kept alive; else closed."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        if self._done and self.headers.get("connection", "").lower() != "close":
            self.client._idle.append(conn)
        else:
            conn.close()


class Client:
    """Requests to one base URL (`http(s)://host[:port][/path]`), over kept-alive connections."""

    def __init__(self, base_url: str, headers: Optional[dict[str, str]] = None):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"bench.url: {base_url!r} is not an http(s) URL")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.prefix = url.path.rstrip("/")
        netloc = self.host if url.port is None else f"{self.host}:{url.port}"
        self.base_headers = {"host": netloc, "user-agent": "cbjax-bench", **{k.lower(): v for k, v in (headers or {}).items()}}
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=1 << 20)
        except OSError as e:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {e}") from None
        return _Conn(reader, writer)

    async def request(self, method: str, path: str, body: bytes = b"", headers: Optional[dict[str, str]] = None) -> Response:
        """Send a request and read its status and headers; the body is the caller's to read."""
        fields = {**self.base_headers, **(headers or {})}
        if body or method == "POST":
            fields["content-length"] = str(len(body))
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
        data = head.encode("latin-1") + body
        while self._idle:  # a kept-alive connection the server may have closed meanwhile
            conn = self._idle.pop()
            try:
                return await self._exchange(conn, data)
            except (HTTPError, OSError, asyncio.IncompleteReadError):
                conn.close()
        conn = await self._connect()
        try:
            return await self._exchange(conn, data)
        except (OSError, asyncio.IncompleteReadError) as e:
            conn.close()
            raise HTTPError(f"{type(e).__name__}: {e}") from None
        except BaseException:
            conn.close()
            raise

    async def _exchange(self, conn: _Conn, data: bytes) -> Response:
        conn.writer.write(data)
        await conn.writer.drain()
        status_line = await conn.reader.readline()
        if not status_line:
            raise HTTPError("the server closed the connection before answering")
        parts = status_line.decode("latin-1").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HTTPError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        headers: dict[str, str] = {}
        while (line := await conn.reader.readline()) not in (b"\r\n", b"\n"):
            if not line:
                raise HTTPError("the server closed the connection mid-headers")
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        return Response(self, conn, int(parts[1]), headers)

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()
