"""The server reaches its engine only through the `EngineClient` protocol, and the engine its
server only through `EngineEvents`, whichever side of a process boundary the engine is on; an
engine thread that fails shows in /health and in its requests' errors."""

from __future__ import annotations

import json

import httpx
import pytest

from test_contracts import Strict, members
from test_serve import metric, rows, running, wait_for
from test_serve_process import SMALL
from cbjax.engine.loop import EngineLoop
from cbjax.serve import server as serve_server
from cbjax.serve.client import EngineClient, EngineEvents


class Recorded(Strict):
    """Strict, and a name outside the contract is also recorded: a probe that swallows the
    AttributeError (getattr with a default, hasattr) still fails the test."""

    def __getattr__(self, name):
        if name not in self._allowed:
            self._seen.add(f"outside the contract: {name}")
        return super().__getattr__(name)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_the_server_and_its_engine_talk_only_through_the_client_contract(tmp_path, monkeypatch, where):
    used: set = set()  # the client's members the server side used
    called: set = set()  # the events' members the client used
    real = serve_server.connect

    def connect(cfg, out_dir, events):
        client = real(cfg, out_dir, Recorded(events, EngineEvents, called))
        assert isinstance(client, EngineClient)
        return Recorded(client, EngineClient, used)

    monkeypatch.setattr(serve_server, "connect", connect)
    engine = SMALL + ["server.engine_process=true"] if where == "process" else []
    with running(tmp_path, *engine, "server.max_queue=8") as (base, srv):
        root = base.removesuffix("/v1")
        body = {"prompt": "hi", "max_tokens": 5, "ignore_eos": True}
        r = httpx.post(f"{base}/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        with httpx.stream("POST", f"{base}/completions", json={**body, "stream": True}, timeout=60) as resp:
            assert sum(line.startswith("data: {") for line in resp.iter_lines()) >= 5
        long = {"prompt": "leave", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/completions", json=long, timeout=60) as resp:
            for n, _ in enumerate(resp.iter_lines()):
                if n == 3:
                    break  # leaves midway: the server cancels it
        wait_for(lambda: metric(base, "num_requests_running") == 0, "the cancelled request to end")
        assert httpx.get(f"{root}/health").status_code == 200
    assert [m for m in used | called if m.startswith("outside")] == []
    assert used == members(EngineClient)  # every verb served a purpose, and no other member was touched
    assert called == members(EngineEvents)
    assert [(r["finish_reason"], r["output_len"]) for r in rows(tmp_path)][:2] == [("length", 5), ("length", 5)]
    assert rows(tmp_path)[2]["finish_reason"] == "aborted"
    assert json.loads((tmp_path / "summary.json").read_text())["num_requests"] == 3


def test_a_failed_engine_thread_fails_its_requests_and_health_says_why(tmp_path, monkeypatch):
    step = EngineLoop.step

    def failing(self):
        if self.scheduler.has_work():
            raise RuntimeError("boom")
        return step(self)

    with running(tmp_path) as (base, srv):
        root = base.removesuffix("/v1")
        monkeypatch.setattr(EngineLoop, "step", failing)
        why = "the engine thread failed: RuntimeError: boom"
        for _ in range(2):  # in flight as the thread fails, then submitted after
            r = httpx.post(f"{base}/completions", json={"prompt": "a", "max_tokens": 3}, timeout=60)
            assert r.status_code == 500 and why in r.json()["error"]["message"]
        health = httpx.get(f"{root}/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == why
    assert srv.summary is None
    assert [(r["finish_reason"], r["error"]) for r in rows(tmp_path)] == [("error", why)] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl"]
