"""Send a workload to an OpenAI-compatible server and time every streamed token (asyncio, over
the lean HTTP client of `cbjax.bench.http`).

Times are seconds since the benchmark's start on the client's monotonic clock. A request's
`arrival_s` is when it was sent; its first token is the first chunk that carries a token
(`is_token`: its text may be empty), timed at the socket read that brought the chunk's line,
before it is parsed; its inter-token latencies are the gaps between such chunks (a server that
sends several tokens in one chunk shows one gap for them, as vLLM's and SGLang's clients count)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from cbjax.bench.config import BenchClientConfig
from cbjax.bench.http import Client, HTTPError
from cbjax.core.request import FinishReason, Request

FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED}
WORDS = ("the", "of", "and", "to", "in", "is", "for", "on", "that", "with", "as", "it", "by", "at", "from",
         "this", "be", "are", "or", "an", "was", "not", "but", "all", "can", "one", "has", "more", "time", "new")  # fmt: skip


@dataclass
class Timing:
    """What the client saw of one request."""

    send_s: float
    token_s: list[float] = field(default_factory=list)
    end_s: Optional[float] = None
    completion_tokens: Optional[int] = None  # the server's usage, when it sent one
    finish_reason: Optional[str] = None
    status: Optional[int] = None
    error: Optional[str] = None


def output_len(req: Request) -> int:
    """The number of tokens to ask for: the workload's output length, capped by its max_tokens."""
    return req.stop_length()


def filler_text(req: Request) -> str:
    """A text prompt of about `prompt_len` tokens: the request's own text, else seeded words."""
    if req.prompt_text is not None:
        return req.prompt_text
    rng = np.random.default_rng(zlib.crc32(req.request_id.encode()))
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=req.prompt_len))


def payload(cfg: BenchClientConfig, model: str, req: Request) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": output_len(req),
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": filler_text(req)}]
    else:
        body["prompt"] = req.prompt_ids() if cfg.prompt == "ids" else filler_text(req)
    return body


async def send_one(client: Client, cfg: BenchClientConfig, model: str, req: Request, t0: float, run_id: str) -> Timing:
    """Stream one request; never raises (a failure is recorded in the Timing). The request
    counts as sent when its bytes go to the socket, after the client has built them."""
    path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"
    # X-Request-ID: a server that keeps it (cbjax-serve, vLLM) can join its rows to ours
    headers = {"content-type": "application/json", "accept": "text/event-stream", "x-request-id": f"{run_id}-{req.request_id}"}
    body = json.dumps(payload(cfg, model, req)).encode()
    timing = Timing(send_s=time.perf_counter() - t0)
    resp = None
    try:
        async with asyncio.timeout(cfg.timeout_s):
            resp = await client.request("POST", path, body, headers)
            timing.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.read()).decode(errors="replace")
                timing.error = f"HTTP {resp.status_code}: {_error_message(text)}"
                return timing

            def on_data(stamp: float, data: bytes) -> bool:  # inside the socket read that brought it
                if data == b"[DONE]":
                    return True
                _read_chunk(loads(data), timing, stamp - t0)
                return False

            if not await resp.sse_data(on_data):
                timing.error = "the stream ended without data: [DONE]"
    except (HTTPError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        timing.error = f"{type(e).__name__}: {e}"
    except TimeoutError:
        timing.error = f"no answer within bench.timeout_s={cfg.timeout_s}"
    finally:
        timing.end_s = time.perf_counter() - t0
        if resp is not None:
            resp.release()
    return timing


_raw_decode = json.JSONDecoder().raw_decode


def loads(data: bytes) -> Any:
    """json.loads of a UTF-8 `data:` value stripped of white space at its ends: the same value or
    the same error, less the encoding sniffing and white-space scans a token's chunk needs not."""
    text = data.decode("utf-8", "surrogatepass")
    value, end = _raw_decode(text)
    if end != len(text):  # where json.loads reports it: past the white space
        rest = text[end:]
        raise json.JSONDecodeError("Extra data", text, end + len(rest) - len(rest.lstrip(" \t\n\r")))
    return value


def _read_chunk(chunk: dict[str, Any], timing: Timing, now: float) -> None:
    if "error" in chunk:
        timing.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
        return
    if chunk.get("usage"):
        timing.completion_tokens = chunk["usage"].get("completion_tokens")
    for choice in chunk.get("choices") or ():
        if choice.get("finish_reason"):
            timing.finish_reason = choice["finish_reason"]
        if is_token(choice):
            timing.token_s.append(now)


def is_token(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice carries a token. Its text may be empty (a token with no text
    of its own, such as half of a multi-byte character, or a random model's id beyond the byte
    range): it still counts, as the time a token came. A chat stream's opening role chunk and
    a closing chunk with only the finish reason carry none."""
    delta = choice.get("delta")
    if delta is not None and "role" in delta:
        return False
    text = choice.get("text") if delta is None else delta.get("content")
    if text is None:
        return False
    return bool(text) or not choice.get("finish_reason")


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]


def apply(req: Request, timing: Timing) -> None:
    """Record what the client saw on the workload's request, in the fields request_row reads."""
    req.arrival_s = timing.send_s
    if timing.error is not None:
        req.finish_reason = FinishReason.REJECTED if timing.status in (429, 503) else FinishReason.ERROR
        req.reject_reason = timing.error if req.finish_reason is FinishReason.REJECTED else None
        req.error = timing.error if req.finish_reason is FinishReason.ERROR else None
        req.finish_s = timing.end_s
        req.num_generated = len(timing.token_s)
        return
    n = timing.completion_tokens if timing.completion_tokens is not None else len(timing.token_s)
    req.num_generated = n
    req.first_token_s = timing.token_s[0] if timing.token_s else None
    req.last_token_s = timing.token_s[-1] if timing.token_s else None
    req.finish_s = timing.token_s[-1] if timing.token_s else timing.end_s
    req.finish_reason = FINISH.get(timing.finish_reason or "", FinishReason.ERROR)
    if req.finish_reason is FinishReason.ERROR:
        req.error = f"finish_reason {timing.finish_reason!r}"
    if req.first_token_s is None and n:
        req.finish_reason, req.error = FinishReason.ERROR, "usage counts tokens but no token text came"


def itls(timing: Timing) -> list[float]:
    return list(np.diff(timing.token_s)) if len(timing.token_s) > 1 else []


async def first_model(client: Client) -> str:
    resp = await client.request("GET", "/models")
    try:
        text = (await resp.read()).decode(errors="replace")
    finally:
        resp.release()
    where = f"GET {client.prefix}/models"
    if resp.status_code != 200:
        raise ValueError(f"bench.model: unset, and {where} answered {resp.status_code}: {_error_message(text)}")
    data = json.loads(text).get("data") or []
    if not data:
        raise ValueError(f"bench.model: unset, and {where} lists no model")
    return data[0]["id"]


async def run_load(cfg: BenchClientConfig, requests: list[Request], progress=None) -> tuple[dict[Request, Timing], float]:
    """Send `requests` open loop (at their arrival times) or closed loop (cfg.concurrency in
    flight). Returns each sent request's timing and the wall time of the whole load."""
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timings: dict[Request, Timing] = {}
    client = Client(cfg.url, headers)
    try:
        model = cfg.model or await first_model(client)
        run_id = uuid.uuid4().hex[:8]  # a prefix that keeps ids unique across runs
        t0 = time.perf_counter()
        deadline = None if cfg.duration_s is None else cfg.duration_s

        async def one(req: Request) -> None:
            timings[req] = await send_one(client, cfg, model, req, t0, run_id)
            if progress is not None:
                progress()

        if cfg.concurrency is None:
            tasks = []
            for req in sorted(requests, key=lambda r: r.arrival_s):
                if deadline is not None and req.arrival_s > deadline:
                    break
                delay = req.arrival_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req)))
            await asyncio.gather(*tasks)
        else:
            todo = iter(requests)

            async def worker() -> None:
                for req in todo:
                    if deadline is not None and time.perf_counter() - t0 > deadline:
                        return
                    await one(req)

            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        wall = time.perf_counter() - t0
    finally:
        await client.aclose()
    return timings, wall
