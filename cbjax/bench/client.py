"""Send a workload to an OpenAI-compatible server (open or closed loop) over one aiohttp
session, and turn what the client saw of each request into the workload's request fields.

A signal (SIGINT, SIGTERM) during the load stops it: nothing more is sent, the requests in
flight are cancelled and recorded as `aborted`, and every request sent keeps its Timing."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Iterator, Optional

import aiohttp
import numpy as np

from cbjax.bench.config import BenchClientConfig
from cbjax.bench.stream import Timing, describe, error_message, send_one
from cbjax.core.stop import StopFlag
from cbjax.core.request import FinishReason, Request

FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED}


def apply(req: Request, timing: Timing) -> None:
    """Record what the client saw on the workload's request, in the fields request_row reads."""
    req.arrival_s = timing.send_s
    if timing.error is not None:
        if timing.aborted:
            req.finish_reason = FinishReason.ABORTED
        else:
            req.finish_reason = FinishReason.REJECTED if timing.status in (429, 503) else FinishReason.ERROR
        req.reject_reason = timing.error if req.finish_reason is FinishReason.REJECTED else None
        req.error = timing.error if req.finish_reason is not FinishReason.REJECTED else None
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


def open_session(cfg: BenchClientConfig) -> aiohttp.ClientSession:
    """The load's one session: no cap on connections (the workload sets how many requests are in
    flight), no timeout of its own (bench.timeout_s bounds each request), no compression (a
    compressed stream's tokens would come when the compressor lets them go), and no cookies:
    the client's own work per request and per chunk is part of every latency it measures."""
    headers = {"user-agent": "cbjax-bench", "accept-encoding": "identity"}
    if cfg.api_key:
        headers["authorization"] = f"Bearer {cfg.api_key}"
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers, auto_decompress=False,
                                 cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(total=None))  # fmt: skip


async def check_server(session: aiohttp.ClientSession, cfg: BenchClientConfig) -> str:
    """GET /models before the load: a server that cannot be reached fails the run here, naming
    bench.url and the cause, rather than every request. Returns the model to ask for
    (bench.model, else the first one listed)."""
    url = cfg.url.rstrip("/") + "/models"
    try:
        async with asyncio.timeout(cfg.timeout_s):
            async with session.get(url) as resp:
                status, text = resp.status, (await resp.read()).decode(errors="replace")
    except TimeoutError:  # before OSError, its base class
        raise ValueError(f"bench.url={cfg.url}: no answer to GET /models within bench.timeout_s={cfg.timeout_s}") from None
    except (aiohttp.ClientError, OSError) as e:
        raise ValueError(f"bench.url={cfg.url}: {describe(e)}") from None
    if cfg.model:
        return cfg.model
    where = f"GET {url}"
    if status != 200:
        hint = "; an OpenAI base URL usually ends in /v1" if status == 404 and not cfg.url.rstrip("/").endswith("/v1") else ""
        raise ValueError(f"bench.model: unset, and {where} answered {status}: {error_message(text)}{hint}")
    no_list = f"bench.model: unset, and {where} answered no model list: {text[:200]!r}"
    try:
        data = json.loads(text).get("data") or []
        model = data[0]["id"] if data else None
    except (ValueError, AttributeError, LookupError, TypeError):  # not JSON, or not a list of models
        raise ValueError(no_list) from None
    if not data:
        raise ValueError(f"bench.model: unset, and {where} lists no model")
    if not isinstance(model, str):
        raise ValueError(no_list)
    return model


@contextmanager
def _signals_to(stop: StopFlag, stopping: asyncio.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set `stop` and `stopping` while the load runs (from the main thread
    only); the handlers that were there before come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.getsignal(sig)
        loop.add_signal_handler(sig, lambda sig=sig: (stop.set(sig), stopping.set()))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


async def run_load(cfg: BenchClientConfig, requests: list[Request], progress=None,
                   stop: Optional[StopFlag] = None) -> tuple[dict[Request, Timing], float, Optional[str]]:  # fmt: skip
    """Send `requests` open loop (at their arrival times) or closed loop (cfg.concurrency in
    flight). Returns the Timing of each request sent, the wall time of the load, and the model
    the requests asked for (None if the load stopped before choosing it). A signal (or `stop`
    already set) ends the load early: see the module's docstring."""
    stop = stop if stop is not None else StopFlag()
    stopping = asyncio.Event()
    tasks: dict[Request, asyncio.Task[Timing]] = {}
    chosen: Optional[str] = None
    t0 = time.perf_counter()
    async with open_session(cfg) as session:
        run_id = uuid.uuid4().hex[:8]  # a prefix that keeps ids unique across runs

        async def one(req: Request, model: str) -> Timing:
            timing = await send_one(session, cfg, model, req, t0, run_id)
            if progress is not None:
                progress()
            return timing

        async def drive() -> None:
            nonlocal t0, chosen
            model = chosen = await check_server(session, cfg)
            t0 = time.perf_counter()
            deadline = cfg.duration_s
            if cfg.concurrency is None:
                for req in sorted(requests, key=lambda r: r.arrival_s):
                    if deadline is not None and req.arrival_s > deadline:
                        break
                    delay = req.arrival_s - (time.perf_counter() - t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks[req] = asyncio.create_task(one(req, model))
                return
            todo = iter(requests)

            async def worker() -> None:
                for req in todo:
                    if stopping.is_set() or (deadline is not None and time.perf_counter() - t0 > deadline):
                        return
                    tasks[req] = asyncio.create_task(one(req, model))
                    await tasks[req]

            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))

        with _signals_to(stop, stopping):
            if stop.is_set():  # a signal before the load began
                stopping.set()
            driver = asyncio.create_task(drive())
            halt = asyncio.create_task(stopping.wait())
            try:
                await asyncio.wait({driver, halt}, return_when=asyncio.FIRST_COMPLETED)
                if not stopping.is_set() and driver.exception() is None and tasks:
                    # all sent (an open loop's driver ends at its last send): a signal still
                    # cuts short the requests in flight rather than waiting for their end
                    in_flight = asyncio.create_task(asyncio.wait(tasks.values()))
                    await asyncio.wait({in_flight, halt}, return_when=asyncio.FIRST_COMPLETED)
                    in_flight.cancel()
            finally:
                halt.cancel()
            if stopping.is_set():
                for task in tasks.values():
                    task.cancel()
                driver.cancel()
                await asyncio.gather(driver, return_exceptions=True)
            else:
                driver.result()  # check_server's error
            await asyncio.gather(*tasks.values())
        wall = time.perf_counter() - t0
    timings = {req: task.result() for req, task in tasks.items()}
    for timing in timings.values():
        if timing.aborted:
            timing.error = f"cbjax-bench was interrupted ({stop.name or 'cancelled'})"
    return timings, wall, chosen
