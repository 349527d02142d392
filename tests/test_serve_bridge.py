"""EngineBridge: the engine thread's events reach the handlers on the event loop, in order."""

from __future__ import annotations

import asyncio
import threading
import time

from cbjax.request import Request, SamplingParams
from cbjax.serve.bridge import EngineBridge, Finished, Token


class _Engine:
    def __init__(self):
        self.submitted = []

    def submit(self, req, arrival_s=None):
        self.submitted.append(req)


def _request(rid):
    return Request(rid, 0.0, 4, sampling=SamplingParams(max_tokens=2, ignore_eos=True), target_output_len=2)


def test_a_waiting_tick_returns_once_the_woken_handler_has_run():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    bridge = EngineBridge()
    bridge.engine = _Engine()
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
    try:
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
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

