"""EngineBridge: the engine thread's events reach the handlers on the event loop, in order."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cbjax.core.request import Request, SamplingParams
from cbjax.serve.bridge import EngineBridge, Finished, Token


class _Engine:
    def __init__(self):
        self.submitted = []

    def submit(self, req, arrival_s=None):
        self.submitted.append(req)


def _request(rid):
    return Request(rid, 0.0, 4, sampling=SamplingParams(max_tokens=2, ignore_eos=True), target_output_len=2)


@pytest.fixture
def loop():
    """An event loop running on its own thread, as uvicorn's runs beside the engine's."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture
def bridge():
    bridge = EngineBridge()
    bridge.engine = _Engine()
    return bridge


def test_a_waiting_tick_returns_once_the_woken_handler_has_run(loop, bridge):
    req = _request("a")
    ready = threading.Event()
    handled = []

    async def handler():
        queue = bridge.submit(req)
        ready.set()
        while True:
            event = await queue.get()
            time.sleep(0.05)  # a handler slow to write its chunk: the tick must not return before it
            handled.append(event)
            if isinstance(event, Finished):
                return

    done = asyncio.run_coroutine_threadsafe(handler(), loop)
    assert ready.wait(10)
    bridge.on_token(req, 7, 0.5)
    bridge.tick(wait_s=10.0)
    assert [(type(e), e.token_id) for e in handled] == [(Token, 7)]
    bridge.on_token(req, 9, 0.6)
    bridge.on_finish(req)
    bridge.tick(wait_s=10.0)
    assert [type(e) for e in handled] == [Token, Token, Finished]
    assert handled[1].token_id == 9 and handled[2].req is req
    assert bridge.num_in_flight == 0 and not bridge.is_live("a")
    done.result(10)


def test_a_first_token_is_handed_off_ahead_of_running_streams_tokens(loop, bridge):
    a, b, c = _request("a"), _request("b"), _request("c")
    handled = []  # (request id, token id) in the order the handlers ran

    async def handler(req, ready):
        queue = bridge.submit(req)
        ready.set()
        while True:
            event = await queue.get()
            if isinstance(event, Finished):
                return
            handled.append((req.request_id, event.token_id))

    readies = [threading.Event() for _ in range(3)]
    tasks = [asyncio.run_coroutine_threadsafe(handler(r, e), loop) for r, e in zip((a, b, c), readies)]
    assert all(e.wait(10) for e in readies)
    bridge.on_token(a, 1, 0.1)
    bridge.tick(wait_s=10.0)
    assert handled == [("a", 1)]
    # one step: a's second token, then b's first, c's first, a's third (two steps' worth)
    bridge.on_token(a, 2, 0.2)
    bridge.on_token(b, 10, 0.2)
    bridge.on_token(a, 3, 0.3)
    bridge.on_token(c, 20, 0.3)
    bridge.tick(wait_s=10.0)
    assert handled[1:] == [("b", 10), ("c", 20), ("a", 2), ("a", 3)]
    bridge.on_token(b, 11, 0.4)  # no longer a first token: in order behind c's
    bridge.on_token(c, 21, 0.4)
    bridge.tick(wait_s=10.0)
    assert handled[5:] == [("b", 11), ("c", 21)]
    for r in (a, b, c):
        bridge.on_finish(r)
    bridge.tick(wait_s=10.0)
    for t in tasks:
        t.result(10)
    assert bridge.num_in_flight == 0


def test_a_later_ticks_events_never_overtake_an_earlier_ticks(loop, bridge):
    # The engine's tick waits only briefly for the loop; a loop slow to run (a loaded machine)
    # gets a second tick's delivery queued before the first has run. The first tick holds a's
    # first token, handed ahead of b's events; the second tick's events still come after them.
    a, b = _request("a"), _request("b")
    handled = []  # b's events in the order its handler got them

    async def handler(req, ready):
        queue = bridge.submit(req)
        ready.set()
        while True:
            event = await queue.get()
            if req is b:
                handled.append("end" if isinstance(event, Finished) else event.token_id)
            if isinstance(event, Finished):
                return

    readies = [threading.Event(), threading.Event()]
    tasks = [asyncio.run_coroutine_threadsafe(handler(r, e), loop) for r, e in zip((a, b), readies)]
    assert all(e.wait(10) for e in readies)
    bridge.on_token(b, 10, 0.1)
    bridge.tick(wait_s=10.0)
    stalled, release = threading.Event(), threading.Event()
    loop.call_soon_threadsafe(lambda: (stalled.set(), release.wait(10)))  # the loop busy elsewhere
    assert stalled.wait(10)
    bridge.on_token(a, 1, 0.2)  # a's first token
    bridge.on_token(b, 11, 0.2)
    bridge.tick()
    bridge.on_token(b, 12, 0.3)
    bridge.on_finish(b)
    bridge.on_finish(a)
    bridge.tick()
    release.set()
    for t in tasks:
        t.result(10)
    assert handled == [10, 11, 12, "end"]
