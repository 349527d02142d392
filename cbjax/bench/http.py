"""A lean HTTP/1.1 client for the load generator: an asyncio protocol per connection, a
keep-alive pool, chunked and sized bodies read as they arrive, and server-sent events handed
over from inside the socket read that completes them.

A load client's timings include its own work between the socket and the clock reading. A
general client's layers (request and response models, a pooled connection state machine, a
pure-Python protocol parser, text and line decoders) cost milliseconds per request on a busy
CPU, and that lands in every TTFT measured. This client does only what a benchmark needs: send
a request, hand back the status, the headers and the body's bytes as they come. For a stream
(`Response.sse_data`) it parses the chunked framing and the event lines inside the read
callback itself, so that a token costs no task switch, no stream-reader await and no async
generator step, and its time is read once per socket read, as its bytes came."""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import AsyncIterator, Callable, Optional
from urllib.parse import urlsplit

# Reading pauses while this many received bytes wait untaken (and resumes below a quarter of
# it); a response head longer than this is refused.
READ_LIMIT = 1 << 21
# Bytes a stream ended early may still bring before its connection is closed rather than pooled.
DRAIN_LIMIT = 1 << 16
# where a chunked body's parser stands: before a size line, inside a chunk's data, before the
# CRLF that ends a chunk, among the trailer lines after the last chunk
_SIZE, _DATA, _CRLF, _TRAILER = range(4)


class HTTPError(Exception):
    """The connection failed or the server's answer was not HTTP/1.1 as expected."""


class _Conn(asyncio.Protocol):
    """One connection. Received bytes wait in `buf` until a response takes them; `stamp` is
    time.perf_counter() at the latest read. While `on_read` is set it runs inside each read
    (and at the connection's end); otherwise a read wakes the coroutine in `wait`."""

    def __init__(self) -> None:
        self.transport: Optional[asyncio.Transport] = None
        self.buf = b""
        self.stamp = 0.0
        self.closed = False  # the server ended its side, or the connection was lost
        self.on_read: Optional[Callable[[], None]] = None
        self._waiter: Optional[asyncio.Future] = None
        self._writable: Optional[asyncio.Future] = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.stamp = time.perf_counter()
        self.buf = self.buf + data if self.buf else data
        if self.on_read is not None:
            self.on_read()
            return
        if len(self.buf) > READ_LIMIT and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self.wake()

    def eof_received(self) -> None:
        self._end()  # and the transport closes

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._end()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def _end(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.on_read is not None:
            self.on_read()
        else:
            self.wake()

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until the next read or the connection's end (the caller checks `buf` and `closed` first)."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def send(self, data: bytes) -> None:
        self.transport.write(data)
        if self._writable is not None:
            await self._writable

    def keep(self, rest: bytes) -> None:
        """What is left in the buffer once a reader has taken its part."""
        self.buf = rest
        if self._paused and len(rest) < READ_LIMIT // 4:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.on_read = None
        self.closed = True
        self.transport.close()
        self.wake()


class Response:
    """A response whose body is read as it comes (`chunks`, `lines`, `sse_data`) or whole
    (`read`); its connection goes back to the pool once the body is read to its end."""

    def __init__(self, client: "Client", conn: _Conn, status: int, headers: dict[str, str]):
        self.client, self.conn, self.status_code, self.headers = client, conn, status, headers
        self._done = False
        self._error: Optional[Exception] = None  # raised once the bytes before it are handed over
        self._chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self._state, self._left = _SIZE, 0  # chunked: the parser's place; sized: bytes to come
        self._sized = not self._chunked and "content-length" in headers
        if self._sized:
            try:
                self._left = int(headers["content-length"])
            except ValueError:
                self._error = HTTPError(f"malformed body: content-length {headers['content-length']!r}")
            self._done = self._error is None and self._left <= 0
        # sse_data: its consumer, the current line's bytes so far, whether on_data ended the
        # stream, and what to raise once it ends
        self._on_data: Optional[Callable[[float, bytes], object]] = None
        self._line = b""
        self._stopped = False
        self._raised: Optional[BaseException] = None

    def _take(self) -> list[bytes]:
        """Take the body's bytes that are in the connection's buffer now. Sets `_done` at the
        body's end, and `_error` where the body breaks off or its framing is wrong."""
        conn = self.conn
        buf, out, pos = conn.buf, [], 0
        if self._chunked:
            n, state, left = len(buf), self._state, self._left
            try:
                while True:
                    if state == _DATA:
                        if pos == n:
                            break
                        if pos + left < n:
                            out.append(buf[pos : pos + left])
                            pos, left, state = pos + left, 0, _CRLF
                        else:
                            out.append(buf[pos:] if pos else buf)
                            left -= n - pos
                            pos = n
                            if left == 0:
                                state = _CRLF
                    elif state == _CRLF:
                        if n - pos < 2:
                            break
                        if buf[pos : pos + 2] != b"\r\n":
                            raise ValueError(f"no CRLF after a chunk's data: {buf[pos : pos + 2]!r}")
                        pos, state = pos + 2, _SIZE
                    else:
                        end = buf.find(b"\n", pos)
                        if end < 0:
                            break
                        line, pos = buf[pos:end], end + 1
                        if state == _SIZE:
                            left = int(line.split(b";", 1)[0], 16)
                            if left < 0:
                                raise ValueError(f"chunk size {line!r}")
                            state = _DATA if left else _TRAILER
                        elif line in (b"", b"\r"):  # the blank line after the trailers
                            self._done = True
                            break
            except ValueError as e:
                self._error = HTTPError(f"malformed body: {e}")
            self._state, self._left = state, left
            if conn.closed and not self._done and self._error is None:
                if state == _TRAILER:  # the last chunk came: the trailers may stop short
                    self._done = True
                elif state == _SIZE:
                    self._error = HTTPError("the server closed the connection mid-body")
                else:
                    self._error = HTTPError("malformed body: the server closed the connection mid-chunk")
        elif self._sized:
            if buf and not self._done and self._error is None:
                pos = min(len(buf), self._left)
                out.append(buf if pos == len(buf) else buf[:pos])
                self._left -= pos
                self._done = self._left == 0
            if conn.closed and not self._done and self._error is None:
                self._error = HTTPError("the server closed the connection mid-body")
        else:  # the body runs to the connection's end
            if buf:
                out.append(buf)
                pos = len(buf)
            if conn.closed:
                self._done = True
                self.headers["connection"] = "close"
        if pos:
            conn.keep(buf[pos:])
        return out

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self.conn
        while True:
            pieces = self._take()
            for piece in pieces:
                yield piece
            if self._error is not None:
                raise self._error
            if self._done:
                break
            if not pieces:
                await conn.wait()
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

    async def sse_data(self, on_data: Callable[[float, bytes], object]) -> bool:
        """Hand each `data:` line of an event stream to `on_data(stamp, value)` as the line
        completes: `value` is what follows `data:`, stripped of white space; `stamp` is
        time.perf_counter() at the socket read that completed it. on_data runs inside that read
        (it must not block); a true result ends the stream there (the rest of the body is not
        read). Returns whether on_data ended it; False: the body ended first. An exception from
        on_data ends the stream and is raised here, as is an HTTPError from the body's framing."""
        conn = self.conn
        self._on_data = on_data
        conn.on_read = self._sse_read
        try:
            self._sse_read()  # what came before
            while conn.on_read is not None:
                await conn.wait()
        finally:
            conn.on_read = None
        if self._raised is not None:
            raise self._raised
        if self._done:
            self.release()
        return self._stopped

    def _sse_read(self) -> None:
        conn = self.conn
        try:
            for piece in self._take():
                if not self._stopped:
                    self._sse_lines(piece, conn.stamp)
            if self._done and self._line and not self._stopped:  # a last line with no line end
                line, self._line = self._line, b""
                if line.startswith(b"data:") and self._on_data(conn.stamp, line[5:].strip()):
                    self._stopped = True
            if self._error is not None:
                raise self._error
        except Exception as e:
            self._raised = e
        if self._done or self._stopped or self._raised is not None:
            conn.on_read = None
            conn.wake()

    def _sse_lines(self, data: bytes, stamp: float) -> None:
        if self._line:
            data = self._line + data
        on_data, start = self._on_data, 0
        while (end := data.find(b"\n", start)) >= 0:
            if data.startswith(b"data:", start) and on_data(stamp, data[start + 5 : end].strip()):
                self._stopped = True
                return
            start = end + 1
        self._line = data[start:] if start < len(data) else b""

    def release(self) -> None:
        """Back to the pool if the body was read whole on a connection kept alive; else closed.
        A stream that on_data ended before its body's end (at `[DONE]`, the last chunk not yet
        come) is first read on to that end, in the background, and pooled then."""
        conn = self.conn
        if conn is None or conn.on_read == self._drain:
            return
        if self._stopped and not self._done and self._error is None and not conn.closed and self._keep_alive():
            self._drained = 0
            conn.on_read = self._drain
            self.client._draining.add(conn)
            return
        self._settle()

    def _drain(self) -> None:
        conn = self.conn
        self._drained += sum(map(len, self._take()))
        if self._done or self._error is not None or conn.closed or self._drained > DRAIN_LIMIT:
            self.client._draining.discard(conn)
            self._settle()

    def _keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"

    def _settle(self) -> None:
        conn, self.conn = self.conn, None
        conn.on_read = None
        if self._done and not conn.closed and not conn.buf and self._keep_alive():
            self.client._idle.append(conn)
        else:
            conn.close()


def _head_end(buf: bytes) -> int:
    """The offset just past the blank line that ends a response head, or -1."""
    pos = buf.find(b"\n") + 1
    while pos:
        end = buf.find(b"\n", pos)
        if end < 0:
            return -1
        if end == pos or (end == pos + 1 and buf[pos] == 13):  # "\n" or "\r\n"
            return end + 1
        pos = end + 1
    return -1


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
        self._draining: set[_Conn] = set()  # streams ended early, read on to their body's end

    async def _connect(self) -> _Conn:
        try:
            _, conn = await asyncio.get_running_loop().create_connection(_Conn, self.host, self.port, ssl=self.ssl)
        except OSError as e:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {e}") from None
        return conn

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
            except (HTTPError, OSError):
                conn.close()
            except BaseException:
                conn.close()
                raise
        conn = await self._connect()
        try:
            return await self._exchange(conn, data)
        except OSError as e:
            conn.close()
            raise HTTPError(f"{type(e).__name__}: {e}") from None
        except BaseException:
            conn.close()
            raise

    async def _exchange(self, conn: _Conn, data: bytes) -> Response:
        if conn.closed:  # while idle in the pool
            raise HTTPError("the server closed the connection before answering")
        if conn.buf:
            raise HTTPError(f"the server sent bytes no request asked for: {conn.buf[:80]!r}")
        await conn.send(data)
        while (end := _head_end(conn.buf)) < 0:
            buf = conn.buf
            if b"\n" in buf:
                _status(buf)
            if conn.closed:
                raise HTTPError("the server closed the connection mid-headers" if buf else "the server closed the connection before answering")
            if len(buf) > READ_LIMIT:
                raise HTTPError(f"a response head longer than {READ_LIMIT} bytes")
            await conn.wait()
        head = conn.buf[:end]
        conn.keep(conn.buf[end:])
        _, *lines = head.decode("latin-1").split("\n")  # after the status line
        headers: dict[str, str] = {}
        for line in lines:
            key, _, value = line.partition(":")
            if value or key.strip():
                headers[key.strip().lower()] = value.strip()
        return Response(self, conn, _status(head), headers)

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()
        while self._draining:
            self._draining.pop().close()


def _status(head: bytes) -> int:
    """The status code in a response's first line; HTTPError if that is not an HTTP/1.x status line."""
    status_line = head[: head.find(b"\n") + 1]
    parts = status_line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HTTPError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    return int(parts[1])
