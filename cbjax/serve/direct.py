"""Writing a stream's chunks straight to the connection, past the ASGI stack.

A streamed token would otherwise take a handler's wakeup, its generator's turn and the
framework's send wrappers before uvicorn frames it: several times the cost of the write itself,
paid per token per stream on the thread (and the GIL) the engine needs. Once a stream's status
and first chunk have gone out through ASGI, its later chunks can be framed here and written to
uvicorn's transport by the event-loop callback that delivers the engine's tokens.

This leans on uvicorn's httptools protocol: its per-request cycle (the ASGI `send`'s owner)
holds the transport and the response state. `RawSend` keeps the server's own `send` in the
scope, as the application's middleware wraps the one it passes on. `writer` checks that the
cycle is one it knows, with a chunked response started and not complete; anything else (h11, a
test transport, a response in another state) gets None and the stream uses ASGI sends.

Flow control is not applied to direct writes: a client that stops reading makes the
transport buffer a stream's remaining chunks, bounded by its max_tokens."""

from __future__ import annotations

from typing import Callable, Optional

RAW_SEND = "cbjax_raw_send"  # the server's own ASGI send, in the scope's state
_CYCLE = "uvicorn.protocols.http.httptools_impl"


class RawSend:
    """The outermost ASGI layer: records the server's `send` before any middleware wraps it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[RAW_SEND] = send
        await self.app(scope, receive, send)


def writer(scope) -> Optional[Callable[[bytes], bool]]:
    """A function writing one chunk of the started, chunked response of this scope's request
    straight to its connection (False once the client is gone or the response is complete);
    None where that is not known to be safe."""
    send = scope.get("state", {}).get(RAW_SEND)
    cycle = getattr(send, "__self__", None)
    if cycle is None or type(cycle).__module__ != _CYCLE:
        return None
    try:
        if not (cycle.response_started and cycle.chunked_encoding is True and not cycle.response_complete):
            return None
        transport = cycle.transport
    except AttributeError:  # a uvicorn whose cycle keeps other state
        return None

    def write(body: bytes) -> bool:
        if cycle.disconnected or cycle.response_complete or transport.is_closing():
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    return write
