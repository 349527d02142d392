"""From a validated OpenAI request to its response: build the engine's request, submit it, and
answer with the whole output or a stream of server-sent events."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from cbjax.core.request import FinishReason, Request, SamplingParams
from cbjax.serve.bridge import EngineBridge, Finished, Mailbox, Token
from cbjax.serve.client import EngineClient
from cbjax.serve.config import ServerConfig
from cbjax.serve.metrics import ServerMetrics
from cbjax.serve.output import STOP_SEQUENCE, Output, usage
from cbjax.serve.protocol import APIError, SamplingFields
from cbjax.serve.text import Tokenizer


# the request's arrival on the engine's clock, stamped by the app's intake (`Intake`) in the
# ASGI scope's state as the request reached the server
ARRIVAL = "cbjax_arrival_s"
RECEIPT = "cbjax_receipt"  # the key under which the engine expects the request's submission


@dataclass
class ServeState:
    """What the handlers share; `draining` is set once SIGTERM closes admission."""

    engine: EngineClient
    bridge: EngineBridge
    tokenizer: Tokenizer
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    vocab_size: int
    server: ServerConfig
    max_num_batched_tokens: int
    chunked_prefill: bool
    created: int = 0
    draining: bool = False
    # every request id given to a request the engine received: a reused one is renamed
    request_ids: set[str] = field(default_factory=set)


class EngineStream(Response):
    """One request's server-sent events, as a plain ASGI response (a Response only for the
    framework's type check: none of its body machinery is used).

    It waits for the request's first event itself: the framework's return path runs while the
    request waits for a slot, and between the first token and the client lies only the send of
    its chunk. An end before any token with an error (a rejection) answers as a plain error
    response instead. After the first chunk, each wakeup of the handler sends every event
    waiting in one ASGI send. A watcher on `receive` aborts the request when the client leaves,
    at any point; the stream then ends with the engine's abort."""

    HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    def __init__(self, state: "ServeState", req: Request, queue: Mailbox, chunks: "SSEChunks"):
        self.state, self.req, self.queue, self.chunks = state, req, queue, chunks
        self.status_code, self.background = 200, None
        self.ended = False  # the stream ran to its end: nothing to abort

    def _left(self, gone: asyncio.Future) -> None:
        if not gone.cancelled() and not self.ended:
            self.state.bridge.cancel(self.req.request_id, "client disconnected")

    async def __call__(self, scope, receive, send) -> None:
        gone = asyncio.ensure_future(_disconnected(receive))
        gone.add_done_callback(self._left)
        chunks = self.chunks
        try:
            first = await self.queue.get()
            if gone.done():  # left while waiting for a slot: the engine's abort was its answer
                await send({"type": "http.response.start", "status": 499, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            if isinstance(first, Finished):
                err = end_error(self.state, first.req, chunks.chat)
                if err is not None:
                    raise err  # answered by the app's error handler, before anything was sent
            await send({"type": "http.response.start", "status": 200, "headers": self.HEADERS})
            await send({"type": "http.response.body", "body": _join(chunks.opening() + chunks.feed(first)), "more_body": True})
            await self._rest(send)
            self.ended = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if self.background is not None:
                await self.background()
        finally:
            gone.cancel()
            if not self.ended:  # a server error mid-stream
                self.state.bridge.cancel(self.req.request_id, "client disconnected")

    async def _rest(self, send) -> None:
        """The rest of the stream: one send per wakeup, with every event waiting."""
        chunks, queue = self.chunks, self.queue
        while not chunks.ended:
            out = chunks.feed(await queue.get())
            while not chunks.ended and not queue.empty():
                out += chunks.feed(queue.get_nowait())
            if out:
                await send({"type": "http.response.body", "body": _join(out), "more_body": True})


def _join(chunks: list[str]) -> bytes:
    return "".join(chunks).encode()


def build_request(state: ServeState, body: SamplingFields, ids: list[int], prompt_field: str,
                  max_tokens: Optional[int], chat: bool, client_id: Optional[str] = None) -> tuple[Request, list[str]]:  # fmt: skip
    """The engine's request and the stop strings the server matches itself. `client_id` is the
    client's X-Request-ID, kept in the request's id so its rows join the client's records. An id
    some earlier request had gets a suffix (`cmpl-ID@2`, `@3`, ...), so that every row has an id
    of its own; the id asked for is kept as the request's `original_request_id`."""
    n = len(ids)
    limit = state.max_model_len
    if n >= limit:
        raise APIError(400, f"{prompt_field}: the prompt has {n} tokens, the model's maximum length is {limit}", prompt_field)
    if n > state.max_num_batched_tokens and not state.chunked_prefill:
        raise APIError(400, f"{prompt_field}: the prompt has {n} tokens, more than the server's step budget "
                            f"(scheduler.max_num_batched_tokens={state.max_num_batched_tokens}, no chunked prefill)", prompt_field)  # fmt: skip
    if max_tokens is None:
        max_tokens = limit - n
    elif n + max_tokens > limit:
        key = "max_completion_tokens" if chat and getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise APIError(400, f"{key}: {n} prompt tokens + {max_tokens} > the model's maximum length {limit}", key)
    stop_ids = set(body.stop_token_ids or ())
    bad = next((t for t in stop_ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"stop_token_ids: {bad} is outside the vocabulary [0, {state.vocab_size})", "stop_token_ids")
    strings = list(body.stop or ())  # matched in the text by the server (`Output`)
    for s in strings:
        one = state.tokenizer.encode(s, special=False)
        if len(one) == 1:  # a one-token stop: the scheduler also stops on its id, one step sooner
            stop_ids.add(one[0])
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_k=max(0, body.top_k),
        top_p=body.top_p,
        seed=random.getrandbits(31) if body.seed is None else body.seed % (1 << 31),
        stop_token_ids=tuple(sorted(stop_ids)),
        ignore_eos=body.ignore_eos,
    )
    prefix = "chatcmpl" if chat else "cmpl"
    request_id = asked = f"{prefix}-{client_id or uuid.uuid4().hex}"
    use = 1
    while request_id in state.request_ids:
        use += 1
        request_id = f"{asked}@{use}"
    req = Request(
        request_id=request_id,
        arrival_s=0.0,  # stamped at receipt (`ARRIVAL`), or by the engine at submit
        prompt_len=n,
        prompt_token_ids=ids,
        sampling=sampling,
        client_id=body.user or "default",
        priority=body.priority,
        original_request_id=asked if request_id != asked else None,
    )
    return req, strings


def end_error(state: ServeState, req: Request, chat: bool) -> Optional[APIError]:
    """The error a request that ended without being served answers with, if it did. A
    rejection names the field the prompt came in (`messages` for chat): the checks left to the
    engine judge the prompt, or the prompt with the tokens it may generate."""
    reason = req.finish_reason
    if reason is FinishReason.REJECTED:
        if state.draining:
            return APIError(503, "the server is shutting down and admits no new requests", None, "service_unavailable")
        key = "messages" if chat else "prompt"
        return APIError(400, f"{key}: {req.reject_reason}", key)
    if reason is FinishReason.ERROR:
        return APIError(500, f"the engine failed on this request: {req.error}", None, "server_error")
    return None


async def generate(state: ServeState, body: SamplingFields, ids: list[int], prompt_field: str,
                   max_tokens: Optional[int], *, chat: bool, raw: HTTPRequest) -> Response:  # fmt: skip
    client_id = raw.headers.get("x-request-id")
    in_use = client_id is not None and any(state.bridge.is_live(f"{p}-{client_id}") for p in ("cmpl", "chatcmpl"))
    if client_id is not None and (len(client_id) > 128 or not client_id.isprintable() or in_use):
        raise APIError(400, "x-request-id: must be printable, at most 128 characters, and not in use by a live request", "x-request-id")
    req, stops = build_request(state, body, ids, prompt_field, max_tokens, chat, client_id)
    state.request_ids.add(req.request_id)  # from here on the engine receives it (a 429 too)
    scope_state = raw.scope.get("state", {})
    arrival, receipt = scope_state.get(ARRIVAL), scope_state.get(RECEIPT)
    bound = state.server.max_queue
    if bound is not None and state.bridge.num_waiting() >= bound:
        after = state.server.retry_after_s
        message = f"the server's queue is full ({bound} requests waiting, server.max_queue); retry later"
        req.input_error = message  # the engine records it as rejected: every request received has a row
        state.engine.submit(req, arrival)
        state.engine.received(receipt)
        raise APIError(429, message, None, "rate_limit_error", headers={"Retry-After": str(after)})
    queue = state.bridge.submit(req, arrival)
    state.engine.received(receipt)
    out = Output(state.tokenizer, req, stops)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream(state, req, out, queue, chat, include_usage, raw)
    return await complete(state, req, out, queue, chat, raw)


def _envelope(req: Request, state: ServeState, chat: bool, created: int) -> dict[str, Any]:
    kind = "chat.completion" if chat else "text_completion"
    return {"id": req.request_id, "object": kind, "created": created, "model": state.model_name}


async def complete(state: ServeState, req: Request, out: Output, queue: asyncio.Queue, chat: bool,
                   raw: HTTPRequest) -> Response:  # fmt: skip
    """Wait for the whole output, aborting the request if the client goes away first."""
    created = int(time.time())
    gone = asyncio.ensure_future(_disconnected(raw.receive))
    try:
        while True:
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                state.bridge.cancel(req.request_id, "client disconnected")
                return Response(status_code=499)
            event = get.result()
            if isinstance(event, Token):
                out.add(event.token_id)
                if out.stopped:
                    state.bridge.cancel(req.request_id, STOP_SEQUENCE, FinishReason.STOP)
                continue
            break
    finally:
        gone.cancel()
    err = end_error(state, event.req, chat)
    if err is not None:
        raise err
    out.close()
    text = out.text
    reason = out.finish_reason(req)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return JSONResponse({**_envelope(req, state, chat, created), "choices": [choice], "usage": usage(req, out)})


async def _disconnected(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _sse(data: Union[dict[str, Any], str]) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class SSEChunks:
    """One streamed request's server-sent events, event by event: a chunk per token, a last
    chunk with the finish reason, the usage chunk when asked for, then `data: [DONE]`. A token's
    chunk differs from the next only in its text: it is formatted from a template built once,
    rather than encoded whole per token."""

    def __init__(self, state: ServeState, req: Request, out: Output, chat: bool, include_usage: bool):
        self.state, self.req, self.out, self.chat, self.include_usage = state, req, out, chat, include_usage
        head = _envelope(req, state, chat, int(time.time()))
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        self.head = head
        self.extra = {"usage": None} if include_usage else {}
        mark = "\u0000TEXT\u0000"
        self.token_head, self.token_tail = self.chunk(mark).split(json.dumps(mark))
        self.ended = False  # the end's chunks went out: nothing follows

    def chunk(self, text: Optional[str], reason: Optional[str] = None) -> str:
        if self.chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return _sse({**self.head, "choices": [choice], **self.extra})

    def opening(self) -> list[str]:
        """What precedes the first token: a chat stream's role chunk."""
        if not self.chat:
            return []
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [_sse({**self.head, "choices": [role], **self.extra})]

    def feed(self, event: object) -> list[str]:
        """The chunks an engine event makes (none once the stream has ended)."""
        if self.ended:
            return []
        out = self.out
        if isinstance(event, Token):
            if out.stopped:
                return []
            text = out.add(event.token_id)
            if out.stopped:
                self.state.bridge.cancel(self.req.request_id, STOP_SEQUENCE, FinishReason.STOP)
            return [self.token_head + json.dumps(text) + self.token_tail]
        self.ended = True
        err = end_error(self.state, event.req, self.chat)
        if err is not None:
            chunks = [_sse(err.body())]
        else:
            tail = out.close()
            chunks = [self.chunk(tail)] if tail else []
            chunks.append(self.chunk(None, out.finish_reason(self.req)))
        if self.include_usage:
            chunks.append(_sse({**self.head, "choices": [], "usage": usage(self.req, out)}))
        chunks.append(_sse("[DONE]"))
        return chunks


async def stream(state: ServeState, req: Request, out: Output, queue: Mailbox, chat: bool,
                 include_usage: bool, raw: HTTPRequest) -> Response:  # fmt: skip
    """Server-sent events (`SSEChunks`), sent by `EngineStream`."""
    return EngineStream(state, req, queue, SSEChunks(state, req, out, chat, include_usage))
