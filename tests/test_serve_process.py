"""The real engine in a process of its own (`server.engine_process=true`) against the same engine on
a thread of the server's process: the same requests get the same tokens and the same fates, a
client that leaves frees its slot and pages across the pipe, and the engine process writes the
run's outputs; a killed engine process shows in /health and in its requests' errors."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from test_serve import metric, rows, running, serve_config, wait_for
from cbjax.serve import remote
from cbjax.serve.bridge import EngineBridge

SMALL = ["executor=jax", "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=32", "model.max_model_len=512",
         "cache.num_pages=64", "executor.token_buckets=[4,32]"]  # fmt: skip


def _serve(out_dir, process: bool) -> dict:
    """Three requests (greedy streamed, sampled with a seed, one that leaves after 3 chunks);
    returns what the client saw, the gauges afterwards, and whether an engine process ran."""
    seen = {}
    with running(out_dir, *SMALL, f"server.engine_process={str(process).lower()}") as (base, srv):
        seen["children"] = len(multiprocessing.active_children())
        client = openai.OpenAI(base_url=base, api_key="unused")
        seen["greedy"] = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="hello", max_tokens=12, temperature=0, stream=True) if c.choices)  # fmt: skip
        sampled = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=5, temperature=1.0, seed=7)
        seen["sampled"] = (sampled.choices[0].text, sampled.usage.completion_tokens)
        body = {"prompt": "leave", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/completions", json=body, timeout=60) as resp:
            chunks = 0
            for line in resp.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 3:
                    break  # closes the connection midway
        wait_for(lambda: metric(base, "num_requests_running") == 0, "no request running")
        seen["gauges"] = [metric(base, name) for name in ("num_requests_waiting", "kv_cache_pages_used", "kv_cache_pages_total")]
    return seen


def test_the_engine_process_serves_as_the_engine_thread_does(tmp_path):
    thread, process = tmp_path / "thread", tmp_path / "process"
    on_thread, in_process = _serve(thread, False), _serve(process, True)
    assert (on_thread["children"], in_process["children"]) == (0, 1)
    assert in_process["greedy"] and in_process["greedy"] == on_thread["greedy"]
    assert in_process["sampled"] == on_thread["sampled"] and in_process["sampled"][1] == 5
    assert in_process["gauges"] == on_thread["gauges"] == [0, 0, 63]
    a, b = rows(thread), rows(process)
    assert [r["output_token_ids"] for r in a[:2]] == [r["output_token_ids"] for r in b[:2]]
    assert [len(r["output_token_ids"]) for r in b[:2]] == [12, 5]
    assert [(r["finish_reason"], r["error"]) for r in a] == [(r["finish_reason"], r["error"]) for r in b]
    assert b[2]["finish_reason"] == "aborted" and b[2]["error"] == "client disconnected" and 3 <= b[2]["output_len"] < 400
    summary = json.loads((process / "summary.json").read_text())  # written by the engine process
    assert summary["executor"] == "jax" and summary["num_requests"] == 3 and summary["compiles_after_warmup"] == 0


def test_a_killed_engine_process_fails_its_requests_and_health_says_how(tmp_path):
    with running(tmp_path, *SMALL, "server.engine_process=true") as (base, srv):
        root = base.removesuffix("/v1")
        body = {"prompt": "a", "max_tokens": 3}
        assert httpx.post(f"{base}/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{root}/health").status_code == 200
        (engine,) = [p.pid for p in multiprocessing.active_children() if p.name == "cbjax-engine"]
        os.kill(engine, signal.SIGKILL)  # (the server is the one to reap it)
        wait_for(lambda: httpx.get(f"{root}/health").status_code == 503, "/health to answer 503")
        health = httpx.get(f"{root}/health")
        assert health.json()["error"]["message"] == "the engine process was killed by SIGKILL"
        r = httpx.post(f"{base}/completions", json=body, timeout=60)
        assert r.status_code == 500 and "the engine process was killed by SIGKILL" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/models").json()["data"][0]["id"] == "tiny"  # the HTTP side still answers
    assert srv.summary is None
    served, lost = rows(tmp_path)  # written by the server: every request has a row with its fate
    assert (served["finish_reason"], served["output_len"], len(served["output_token_ids"])) == ("length", 3, 3)
    assert lost["finish_reason"] == "error" and lost["error"] == "the engine process was killed by SIGKILL"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl"]  # no live log left beside it


def test_a_sigterm_to_the_engine_process_is_left_to_the_server(tmp_path):
    """A SIGTERM to the server's whole process group (`timeout`, systemd, Slurm) reaches the engine
    process too: it serves on, and the server's drain still ends with the engine's summary."""
    with running(tmp_path, *SMALL, "server.engine_process=true") as (base, srv):
        (engine,) = [p for p in multiprocessing.active_children() if p.name == "cbjax-engine"]
        os.kill(engine.pid, signal.SIGTERM)
        time.sleep(0.5)  # what a delivered SIGTERM would have done by now
        assert engine.is_alive()
        body = {"prompt": "a", "max_tokens": 3}
        assert httpx.post(f"{base}/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 3
        assert httpx.get(base.removesuffix("/v1") + "/health").status_code == 200
    assert srv.summary is not None and srv.summary["num_requests"] == 1
    assert json.loads((tmp_path / "summary.json").read_text())["num_finished"] == 1


def starting_forever(cfg, out_dir, conn) -> None:
    """An engine process whose warmup never ends, ignoring SIGINT and SIGTERM as the real one
    does (`cbjax.serve.remote._engine_main`)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    time.sleep(3600)


def ignores_sigint(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGINT - 1)))


def test_a_ctrl_c_while_the_engine_process_starts_stops_it(monkeypatch):
    monkeypatch.setattr(remote, "_engine_main", starting_forever)
    engine = remote.EngineProcess(serve_config(), None, EngineBridge())
    child = engine._proc
    try:
        wait_for(lambda: ignores_sigint(child.pid), "the engine process to start")
        with pytest.raises(KeyboardInterrupt):
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C as it warms up
            engine.warmup()
        # else it outlives the server, and the server's exit waits on it for good
        wait_for(lambda: not child.is_alive(), "the engine process to stop", timeout_s=30)
    finally:
        if child.is_alive():
            child.kill()
        child.join()
