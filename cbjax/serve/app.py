"""The FastAPI app: OpenAI's completions, chat, models, health and metrics over one engine."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from cbjax.serve.generate import ARRIVAL, RECEIPT, ServeState, generate
from cbjax.serve.metrics import CONTENT_TYPE
from cbjax.serve.protocol import APIError, ChatRequest, CompletionRequest, SamplingFields, error_param

__all__ = ["ServeState", "create_app"]


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="cbjax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, err: APIError) -> JSONResponse:
        state.metrics.http_error(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, err: RequestValidationError) -> JSONResponse:
        return await _api_error(request, body_error(request) or validation_error(err))

    @app.exception_handler(HTTPException)
    async def _http(request: HTTPRequest, err: HTTPException) -> JSONResponse:
        if err.status_code == 400 and isinstance(err.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
            bad = err.__cause__
            return await _api_error(request, APIError(400, f"body: not UTF-8 ({bad.reason} at byte {bad.start})", "body"))
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return await _api_error(request, APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", None, kind))

    app.add_middleware(Intake, state=state)

    @app.get("/health")
    async def health() -> Response:
        """200 while the server admits requests and its engine can serve; 503 with why not."""
        if state.draining:
            why = "the server is shutting down"
        else:
            engine = state.engine.health()
            if engine.alive:
                return Response(status_code=200)
            why = engine.reason
        return JSONResponse(APIError(503, why, None, "service_unavailable").body(), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "cbjax",
                "max_model_len": state.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: HTTPRequest) -> Response:
        check_model(state, body)
        if isinstance(body.prompt, str):
            ids = state.tokenizer.encode(body.prompt)
        else:
            ids = list(body.prompt)
            bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"prompt: token id {bad} is outside the vocabulary [0, {state.vocab_size})", "prompt")
        max_tokens = body.max_tokens
        if "max_tokens" not in body.model_fields_set:  # the default 16, cut to the context left (the prompt is checked apart)
            max_tokens = max(1, min(max_tokens, state.max_model_len - len(ids)))
        return await generate(state, body, ids, "prompt", max_tokens, chat=False, raw=raw)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, raw: HTTPRequest) -> Response:
        check_model(state, body)
        messages = [m.template_dict(f"messages[{i}]") for i, m in enumerate(body.messages)]
        try:
            text = state.tokenizer.chat_prompt(messages)
        except Exception as e:  # the checkpoint's template refused the conversation
            raise APIError(400, f"messages: {e}", "messages") from None
        ids = state.tokenizer.encode(text, special=False)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await generate(state, body, ids, "messages", max_tokens, chat=True, raw=raw)

    return app


class Intake:
    """Every HTTP request's first stop (plain ASGI: a streamed response passes straight
    through, with no extra task per chunk). It stamps the request's arrival on the engine's
    clock as the request reaches the app, before its body is read and parsed: a request's
    TTFT in requests.jsonl counts from there (`ARRIVAL`). A POST to /v1/ is announced to the
    engine (`EngineClient.receive`) until it is submitted or answered. With `server.api_key` set, a /v1/
    request without `Authorization: Bearer <key>` answers 401. A body over `server.max_body_bytes`
    answers 413 before it is read whole: by its Content-Length, or, for a chunked upload, as
    its running count passes the bound (such a body is read here, then handed on)."""

    def __init__(self, app, state: ServeState):
        self.app, self.state = app, state
        key = state.server.api_key
        self.expected = None if key is None else f"Bearer {key}".encode()
        self.max_body = state.server.max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        engine = self.state.engine
        state = scope.setdefault("state", {})
        generation = scope["method"] == "POST" and scope["path"].startswith("/v1/")
        if generation:  # the engine expects its submission (`EngineClient.receive`)
            state[RECEIPT] = receipt = object()
            state[ARRIVAL] = engine.receive(receipt)
        else:
            state[ARRIVAL] = engine.stamp()
        try:
            if self.expected is not None and scope["path"].startswith("/v1/"):
                got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
                if got != self.expected:
                    self.state.metrics.http_error(401)
                    err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", "authorization", "authentication_error")
                    await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                    return
            bounded = await self._bounded(scope, receive)
            if bounded is None:
                self.state.metrics.http_error(413)
                limit = self.max_body
                err = APIError(413, f"body: larger than the server's limit of {limit} bytes (server.max_body_bytes)", "body")
                # the rest of the body is not read: the HTTP server discards it as it arrives
                await JSONResponse(err.body(), status_code=413)(scope, receive, send)
                return
            await self.app(scope, bounded, send)
        finally:
            if generation:
                engine.received(receipt)  # refused, failed, or done: nothing more to wait for

    async def _bounded(self, scope, receive):
        """`receive` for a body within `server.max_body_bytes`; None for one over it. A body
        with a Content-Length is judged by it, unread; a chunked one is read here, counting,
        and replayed."""
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit():  # (the HTTP server refuses any other)
            return receive if int(length) <= self.max_body else None
        if b"transfer-encoding" not in headers:
            return receive  # no body
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone: the app hears it on its first read
                return _replay([message], receive)
            size += len(message.get("body", b""))
            if size > self.max_body:
                return None
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return _replay([{"type": "http.request", "body": b"".join(parts), "more_body": False}], receive)


def _replay(messages: list[dict], receive):
    """A `receive` that gives `messages` first, then what `receive` gives."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed


def body_error(request: HTTPRequest):
    """A 400 naming the Content-Type of a body sent as other than JSON (FastAPI then reads it
    as no object at all, and pydantic's complaint would be about its type), or None."""
    kind = request.headers.get("content-type", "")
    media = kind.split(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):  # FastAPI reads these as JSON
        return None
    sent = f"Content-Type is {kind!r}" if kind else "no Content-Type"
    return APIError(400, f"body: {sent}; send the JSON body as application/json", "body")


def validation_error(err: RequestValidationError) -> APIError:
    """The first of pydantic's complaints as a 400 naming the field."""
    first = err.errors()[0] if err.errors() else {"loc": ("body",), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(400, f"body: invalid JSON: {first.get('ctx', {}).get('error', first['msg'])}", "body")
    param = error_param(tuple(first.get("loc", ()))) or "body"
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"{param}: unknown field", param)
    msg = first.get("msg", "invalid")
    if first.get("type") == "missing":
        msg = "is required"
    return APIError(400, f"{param}: {msg}", param)


def check_model(state: ServeState, body: SamplingFields) -> None:
    if body.model is not None and body.model != state.model_name:
        raise APIError(404, f"model: {body.model!r} does not exist; this server serves {state.model_name!r}", "model", "not_found_error")
