"""One streamed request to an OpenAI-compatible server over aiohttp: send it, time each token
as its chunk arrives, and record how it ended (a failure is recorded, never raised).

Times are seconds since the benchmark's start on the client's monotonic clock
(time.perf_counter). A request's `send_s` is taken once its body is built, just before it
goes to aiohttp. Its first token is the first chunk that carries a token (`is_token`: its text
may be empty), timed when the bytes that completed the chunk's `data:` line reach the client's
task, before they are parsed: events that came together share one time. A closing chunk (a
finish reason, no text) is a token only when the server's usage counts one more token than
the other chunks carried: vLLM sends an EOS token so. Its inter-token
latencies are the gaps between such chunks (a server that sends several tokens in one chunk
shows one gap for them, as vLLM's and SGLang's clients count)."""

from __future__ import annotations

import asyncio
import errno
import json
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp
import numpy as np

from cbjax.bench.config import BenchClientConfig
from cbjax.core.request import Request

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
    aborted: bool = False  # cut short by the client (cbjax-bench interrupted), not by the server
    closing_s: Optional[float] = None  # when a chunk with a finish reason and no text came


class DataLines:
    """The values of an event stream's `data:` lines (what follows `data:`, stripped of white
    space), from its bytes however they were split: `feed` takes the next bytes and returns
    the values of the lines they complete; `end` returns a last line that had no line end."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[bytes]:
        if self._rest:
            data = self._rest + data
        out, start = [], 0
        while (end := data.find(b"\n", start)) >= 0:
            if data.startswith(b"data:", start):
                out.append(data[start + 5 : end].strip())
            start = end + 1
        self._rest = data[start:]
        return out

    def end(self) -> list[bytes]:
        rest, self._rest = self._rest, b""
        return [rest[5:].strip()] if rest.startswith(b"data:") else []


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


async def send_one(session: aiohttp.ClientSession, cfg: BenchClientConfig, model: str, req: Request, t0: float,
                   run_id: str) -> Timing:  # fmt: skip
    """POST one streaming request to `cfg.url` + its endpoint and read the stream to the body's
    end (data after `[DONE]` is ignored; a body read whole lets aiohttp reuse its connection).
    Never raises: a failure is the Timing's `error`; a cancelled request (cbjax-bench stopped)
    is `aborted`, with what came before, and the task returns rather than raising."""
    url = cfg.url.rstrip("/") + ("/chat/completions" if cfg.endpoint == "chat" else "/completions")
    # X-Request-ID: a server that keeps it (cbjax-serve, vLLM) can join its rows to ours
    headers = {"content-type": "application/json", "accept": "text/event-stream", "x-request-id": f"{run_id}-{req.request_id}"}
    data = json.dumps(payload(cfg, model, req)).encode()
    timing = Timing(send_s=time.perf_counter() - t0)
    done = False
    try:
        async with asyncio.timeout(cfg.timeout_s):
            async with session.post(url, data=data, headers=headers) as resp:
                timing.status = resp.status
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    timing.error = f"HTTP {resp.status}: {error_message(text)}"
                    return timing
                lines = DataLines()
                async for piece in resp.content.iter_any():
                    stamp = time.perf_counter() - t0
                    if not done:
                        done = _read_values(lines.feed(piece), timing, stamp)
                if not done and not _read_values(lines.end(), timing, time.perf_counter() - t0):
                    timing.error = "the stream ended without data: [DONE]"
                _count_closing_token(timing)
    except TimeoutError:  # before OSError, its base class
        if not done:  # a server that keeps the body open after [DONE] has still answered
            timing.error = f"no answer within bench.timeout_s={cfg.timeout_s}"
    except (aiohttp.ClientError, OSError) as e:
        if not done:
            timing.error = describe(e)
    except ValueError as e:  # a data: line that is not JSON (json.JSONDecodeError)
        timing.error = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        if not done:  # cut short; after [DONE] it had come whole
            timing.aborted, timing.error = True, "cancelled"
    finally:
        timing.end_s = time.perf_counter() - t0
    return timing


def _read_values(values: list[bytes], timing: Timing, stamp: float) -> bool:
    """Record the chunks of `values` (data: values that came at `stamp`); whether [DONE] came."""
    for value in values:
        if value == b"[DONE]":
            return True
        _read_chunk(loads(value), timing, stamp)
    return False


def _read_chunk(chunk: Any, timing: Timing, now: float) -> None:
    if not isinstance(chunk, dict):
        raise ValueError(f"a data: line that is not a JSON object: {json.dumps(chunk)[:80]}")
    if "error" in chunk:
        error = chunk["error"]
        timing.error = f"stream error: {error.get('message', error) if isinstance(error, dict) else error}"
        return
    if chunk.get("usage"):
        timing.completion_tokens = chunk["usage"].get("completion_tokens")
    for choice in chunk.get("choices") or ():
        if choice.get("finish_reason"):
            timing.finish_reason = choice["finish_reason"]
        if is_token(choice):
            timing.token_s.append(now)
        elif choice.get("finish_reason"):
            timing.closing_s = now


def _count_closing_token(timing: Timing) -> None:
    """The closing chunk carried the last token (one with no text, such as vLLM's EOS) when the
    server's usage counts exactly one token more than the chunks `is_token` counted."""
    if timing.closing_s is not None and timing.completion_tokens == len(timing.token_s) + 1:
        timing.token_s.append(timing.closing_s)


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


def is_token(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice carries a token. Its text may be empty (a token with no text
    of its own, such as half of a multi-byte character, or a random model's id beyond the byte
    range): it still counts, as the time a token came. A chat stream's opening role chunk and
    a closing chunk with only the finish reason carry none (unless the usage says the closing
    one did: `_count_closing_token`)."""
    delta = choice.get("delta")
    if delta is not None and "role" in delta:
        return False
    text = choice.get("text") if delta is None else delta.get("content")
    if text is None:
        return False
    return bool(text) or not choice.get("finish_reason")


def error_message(text: str) -> str:
    """The message of an OpenAI error body, else the body's start."""
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return " ".join(text[:200].split())  # on one line


def describe(e: BaseException) -> str:
    """What went wrong with a connection or a response, in words (aiohttp's own messages name
    its internals)."""
    if isinstance(e, aiohttp.ClientConnectorCertificateError):
        return f"the server's TLS certificate was refused: {e.certificate_error}"
    if isinstance(e, aiohttp.ClientConnectorSSLError):
        reason = getattr(e.os_error, "reason", None) or str(e.os_error)
        if reason == "WRONG_VERSION_NUMBER":  # what OpenSSL reads in a plain-HTTP answer
            return "TLS handshake failed (WRONG_VERSION_NUMBER): the server seems to speak plain HTTP; try http://"
        return f"TLS handshake failed ({reason})"
    if isinstance(e, aiohttp.ClientConnectorDNSError):
        return f"cannot resolve host {e.host!r}: {e.os_error.strerror or e.os_error}"
    if isinstance(e, aiohttp.ClientConnectorError):
        if e.os_error.errno == errno.ECONNREFUSED:
            return "connection refused"
        return f"cannot connect to {e.host}:{e.port}: {e.os_error.strerror or e.os_error}"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the server closed the connection before answering"
    if isinstance(e, aiohttp.ClientPayloadError):
        cause = getattr(e.__cause__, "message", None) or str(e)
        if "Not enough data" in cause:
            return "the server closed the connection mid-body"
        return f"malformed body: {cause}"
    if isinstance(e, aiohttp.ClientResponseError):  # the response's framing, not its status
        return f"malformed response: {e.message.splitlines()[0].rstrip(':')}"
    if isinstance(e, OSError):
        return f"connection failed: {e.strerror or e}"
    return f"{type(e).__name__}: {e}"
