"""cbjax-serve in-process on the paced simulator: the openai client, bad requests, auth, a full
queue, disconnects, and /metrics (the SIGTERM test runs a subprocess: test_serve_sigterm.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO
from cbjax.serve.cli import refused_override  # also registers ServeConfig and serve.yaml's resolver
from cbjax.app.config_merge import check_known_keys
from cbjax.serve.config import ServeConfig
from cbjax.serve.server import Server
from cbjax.serve.text import ByteTokenizer

# The tiny model on the roofline simulator, paced to the wall clock at 2 ms an iteration: a
# request of n tokens takes about 2n ms, long enough to leave midway, short enough for a test.
FAST = ["server.port=0", "model=tiny", "hardware=a100_80gb", "overhead.step_s=0.002"]


def serve_config(*overrides: str) -> ServeConfig:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="serve", overrides=[*FAST, *overrides])
    check_known_keys(cfg, ServeConfig)
    return OmegaConf.to_object(cfg)


@contextmanager
def running(out_dir: Path | None, *overrides: str):
    """A server on a free port in a thread; yields (base URL of /v1, Server). On exit it drains
    as on SIGTERM and writes its outputs to `out_dir`."""
    srv = Server(serve_config(*overrides), out_dir)
    srv.warmup()
    sock = srv.bind()
    thread = threading.Thread(target=srv.run, args=(sock,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", srv
    finally:
        srv.shutdown()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the server did not stop"


def metric(base: str, name: str) -> float:
    text = httpx.get(base.removesuffix("/v1") + "/metrics").text
    line = next(line for line in text.splitlines() if line.startswith(f"cbjax:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines()]


def test_config_composes_with_every_cbjax_group_and_checks_the_server_keys():
    cfg = serve_config()
    assert cfg.executor.name == "sim" and cfg.executor.pace == "realtime" and cfg.server.host == "127.0.0.1"
    assert serve_config("executor=jax").executor.pace == "none"  # the engine's clock is the wall clock
    assert serve_config("executor.pace=none").executor.pace == "none"
    assert serve_config("scheduler=vtc", "cache.num_pages=64").scheduler.name == "vtc"
    with pytest.raises(ValueError, match=r"server.port must be in \[0, 65535\]"):
        serve_config("server.port=70000")
    with pytest.raises(ValueError, match=r"server.drain_s must be >= 0"):
        serve_config("server.drain_s=-1")
    with pytest.raises(Exception, match="server.nope|nope"):
        serve_config("+server.nope=1")


def test_engine_process_is_refused_without_the_real_engine():
    # the simulator, paced or not, always runs on a thread of the server
    for pace in ("none", "realtime"):
        with pytest.raises(ValueError, match=r"server.engine_process=true needs executor=jax, got executor=sim"):
            serve_config("executor=sim", f"executor.pace={pace}", "server.engine_process=true")
    assert serve_config("executor=jax", "server.engine_process=true").server.engine_process


def test_cli_refuses_an_experiment_or_a_sweep_in_one_line(env_cpu):
    proc = subprocess.run([sys.executable, "-m", "cbjax.serve", "experiment=distserve_goodput"], env=env_cpu,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "cbjax-serve: error: experiment=distserve_goodput: a server runs one configuration; "
        "an experiment (arms compared) is for `cbjax`"
    ]
    assert "hparams_search=mlfq_goodput" in refused_override(["server.port=0", "+hparams_search=mlfq_goodput"])
    assert refused_override(["experiment=null", "experiment.name=x", "server.port=0"]) is None


def test_cli_refuses_a_cluster_in_one_line_naming_the_key(env_cpu, tmp_path):
    # one replica would be served while config.yaml recorded the cluster
    cases = [
        (["cluster.replicas=4", "cluster.router=least_loaded"], "cluster.replicas=4"),
        (["cluster.prefill_replicas=1", "cluster.decode_replicas=2"], "cluster.prefill_replicas=1"),
    ]
    for overrides, key in cases:
        proc = subprocess.run([sys.executable, "-m", "cbjax.serve", *overrides, f"hydra.run.dir={tmp_path}"], cwd=REPO,
                              env=env_cpu, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 2
        assert proc.stderr.splitlines() == [f"cbjax-serve: error: {key}: cbjax-serve runs one replica; run a cluster "
                                            "with `cbjax`, or serve each replica with a cbjax-serve of its own behind "
                                            "your router"]  # fmt: skip
    assert serve_config("cluster.router=least_loaded").cluster.replicas == 1  # a router alone is harmless


def test_openai_client_completions_and_chat_streaming_and_not(tmp_path):
    byte = ByteTokenizer(512)
    with running(tmp_path) as (base, srv):
        client = openai.OpenAI(base_url=base, api_key="unused")
        assert [m.id for m in client.models.list().data] == ["tiny"]

        r = client.completions.create(model="tiny", prompt="hello world", max_tokens=7)
        # the simulator's tokens are shown as 'x', one per token
        assert r.choices[0].text == "x" * 7 and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (11, 7, 18)

        r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3)
        assert r.usage.prompt_tokens == 3 and r.choices[0].text == "xxx"

        chunks = list(client.completions.create(model="tiny", prompt="hi", max_tokens=9, stream=True,
                                                stream_options={"include_usage": True}))  # fmt: skip
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
        assert texts == ["x"] * 9  # one chunk per token
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9

        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        prompt_len = len(byte.encode(byte.chat_prompt(messages)))
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        assert r.choices[0].message.content == "xxxx" and r.choices[0].message.role == "assistant"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, 4)

        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5,
                                                     stream=True, stream_options={"include_usage": True}))  # fmt: skip
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "xxxxx"
        assert chunks[-1].usage.prompt_tokens == prompt_len and chunks[-1].usage.completion_tokens == 5

        # a stop string ends the request where it first appears; its text is not output
        r = client.completions.create(model="tiny", prompt="a", max_tokens=50, stop=["xxx"])
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 3)

        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="gpt-4", prompt="a", max_tokens=1)

        # without a max_tokens, chat generates up to the model's length
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a" * 1000}])
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 1024 and r.choices[0].finish_reason == "length"
    served = rows(tmp_path)  # in arrival order; the 404 never reached the engine
    assert [r["output_len"] for r in served[:5]] == [7, 3, 9, 4, 5]
    assert all(r["finish_reason"] == "length" for r in served[:5])
    stopped, long = served[5], served[6]
    # the server's row reads as the client's answer: stopped, no error
    assert stopped["finish_reason"] == "stop" and stopped["error"] is None and stopped["output_len"] >= 3
    assert long["output_len"] == 1024 - long["prompt_len"] and len(served) == 7
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_requests"] == 7 and summary["executor"] == "sim" and summary["num_aborted"] == 0
    assert summary["num_finished"] == 7


MALFORMED = [
    # (path, body, expected param)
    ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": "many"}, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": 5000}, "max_tokens"),  # beyond the model's length
    ("completions", {"prompt": "a", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "a", "temperature": 9}, "temperature"),
    ("completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "a", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "a", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "a", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "a", "top_k": "x"}, "top_k"),
    ("completions", {"prompt": "a", "n": 2}, "n"),
    ("completions", {"prompt": "a", "stream": [1]}, "stream"),
    ("completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"prompt": "a", "stop": [""]}, "stop"),
    ("completions", {"prompt": "a", "stop": 3}, "stop"),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": [10**6]}, "prompt"),
    ("completions", {"prompt": [[1], [2]]}, "prompt"),
    ("completions", {"prompt": {"text": "a"}}, "prompt"),
    ("completions", {"prompt": "a" * 2000}, "prompt"),  # beyond max_model_len
    ("completions", {"prompt": "a", "seed": "s"}, "seed"),
    ("completions", {"prompt": "a", "logprobs": 5}, "logprobs"),
    ("completions", {"prompt": "a", "echo": True}, "echo"),
    ("completions", {"prompt": "a", "best_of": 3}, "best_of"),
    ("completions", {"prompt": "a", "suffix": "z"}, "suffix"),
    ("completions", {"prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"prompt": "a", "frequency_penalty": 1}, "frequency_penalty"),
    ("completions", {"prompt": "a", "logit_bias": {"1": 5}}, "logit_bias.1"),
    ("completions", {"prompt": "a", "max_tokenz": 5}, "max_tokenz"),
    ("completions", {"prompt": "a", "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ("completions", {"prompt": "a", "stream_options": {"bogus": 1}}, "stream_options.bogus"),
    ("completions", {"prompt": "a", "model": "nope"}, "model"),
    ("completions", {"prompt": "a", "user": 5}, "user"),
    ("completions", {"prompt": "a", "priority": "high"}, "priority"),
    ("completions", {"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"prompt": "a", "ignore_eos": "maybe"}, "ignore_eos"),
    ("chat/completions", {}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}}, "response_format.type"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True}, "logprobs"),
]  # fmt: skip
NOT_JSON = [b"{bad", b"", b"[1, 2]", b'"text"']


def test_the_socket_listens_once_bound_before_the_server_runs():
    """cbjax-serve says it is listening right after `bind`; a client that connects then waits in
    the backlog rather than being refused while uvicorn starts."""
    import socket

    srv = Server(serve_config(), None)
    sock = srv.bind()
    try:
        conn = socket.create_connection(sock.getsockname()[:2], timeout=10)  # refused unless listening
        conn.close()
    finally:
        sock.close()


def test_malformed_requests_get_4xx_naming_the_field_and_the_server_keeps_serving(tmp_path):
    assert len(MALFORMED) == 50
    with running(tmp_path) as (base, srv):
        with httpx.Client(base_url=base, timeout=30) as http:
            for path, body, param in MALFORMED:
                resp = http.post(f"/{path}", json=body)
                assert 400 <= resp.status_code < 500, (path, body, resp.status_code, resp.text)
                error = resp.json()["error"]
                assert error["param"] == param, (path, body, error)
                assert error["message"].startswith(param.split(".")[0].split("[")[0]), error
                assert error["type"] in ("invalid_request_error", "not_found_error")
            for raw in NOT_JSON:
                resp = http.post("/completions", content=raw, headers={"Content-Type": "application/json"})
                assert resp.status_code == 400 and resp.json()["error"]["param"] == "body", (raw, resp.text)
            ok = http.post("/completions", json={"prompt": "still here", "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "xxxx"
            assert http.get("/nowhere").status_code == 404
    # only the good request reached the engine
    assert [r["output_len"] for r in rows(tmp_path)] == [4]


def test_a_request_the_cache_cannot_hold_is_rejected_naming_its_prompt_field(tmp_path):
    # 8 pages of 16 tokens: a prompt and max_tokens that need more are the engine's to reject
    with running(tmp_path, "cache.num_pages=8") as (base, srv):
        with httpx.Client(base_url=base, timeout=30) as http:
            for path, body, key in (
                ("completions", {"prompt": [1, 2, 3], "max_tokens": 200}, "prompt"),
                ("completions", {"prompt": [1, 2, 3], "max_tokens": 200, "stream": True}, "prompt"),
                ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}, "messages"),
            ):
                resp = http.post(f"/{path}", json=body)
                error = resp.json()["error"]
                assert resp.status_code == 400 and error["param"] == key, (path, body, resp.text)
                assert error["message"].startswith(f"{key}: needs ") and "output tokens" in error["message"], error
            ok = http.post("/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
            assert ok.status_code == 200
    assert sorted(r["finish_reason"] for r in rows(tmp_path)) == ["length"] + ["rejected"] * 4


def test_api_key_is_required_when_set(tmp_path):
    with running(None, "server.api_key=sesame") as (base, srv):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            resp = httpx.post(f"{base}/completions", json={"prompt": "a", "max_tokens": 1}, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{base}/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong").completions.create(model="tiny", prompt="a", max_tokens=1)
        r = openai.OpenAI(base_url=base, api_key="sesame").completions.create(model="tiny", prompt="a", max_tokens=2)
        assert r.choices[0].text == "xx"
        assert httpx.get(base.removesuffix("/v1") + "/health").status_code == 200  # probes need no key


def wait_for(cond, what: str, timeout_s: float = 30.0) -> None:
    """Poll `cond` (a bound on the wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_full_queue_answers_429_with_retry_after(tmp_path):
    # one slot, 50 ms an iteration (the first request would run for 50 s; it is left midway);
    # the queue holds one waiting request
    with running(tmp_path, "scheduler.max_num_seqs=1", "scheduler.max_num_batched_tokens=64", "server.max_queue=1",
                 "server.retry_after_s=3", "overhead.step_s=0.05") as (base, srv):  # fmt: skip
        with httpx.Client(base_url=base, timeout=60) as http:
            body = {"prompt": "a", "max_tokens": 1000, "stream": True}
            with http.stream("POST", "/completions", json=body) as first:
                lines = first.iter_lines()  # (kept: a dropped iterator closes the stream)
                next(lines)  # running: its first token came
                second = threading.Thread(target=lambda: http.post("/completions", json={"prompt": "b", "max_tokens": 2}))
                second.start()
                wait_for(lambda: metric(base, "num_requests_waiting") == 1, "the second request to wait")
                resp = http.post("/completions", json={"prompt": "c", "max_tokens": 2})
                assert resp.status_code == 429 and resp.headers["Retry-After"] == "3"
                assert resp.json()["error"]["type"] == "rate_limit_error"
            second.join(timeout=60)  # the first stream closed (aborted): the second runs
            assert metric(base, "http_rejected_total") == 1
    fates = {r["finish_reason"]: r for r in rows(tmp_path)}
    assert sorted(fates) == ["aborted", "length", "rejected"]  # the 429 has a row too, with why
    assert "server.max_queue" in fates["rejected"]["reject_reason"]


def test_disconnects_abort_their_requests_and_free_slots_and_pages(tmp_path):
    # every fifth stream asks for 1000 tokens (2 s) and leaves after 5; the others read 150
    num, leave_every = 50, 5
    results: dict[int, str] = {}

    def client(i: int, base: str) -> None:
        body = {"prompt": f"request {i}", "max_tokens": 1000 if i % leave_every == 0 else 150, "stream": True}
        with httpx.stream("POST", f"{base}/completions", json=body, timeout=120) as resp:
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"] == "x":
                    seen += 1
                    if i % leave_every == 0 and seen == 5:
                        results[i] = "left"
                        return  # closes the connection midway
                if line == "data: [DONE]":
                    results[i] = f"done {seen}"

    with running(tmp_path, "scheduler.max_num_seqs=16", "cache.num_pages=512") as (base, srv):
        threads = [threading.Thread(target=client, args=(i, base)) for i in range(num)]
        for t in threads:
            t.start()
        # a non-streaming client that gives up waiting
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/completions", json={"prompt": "impatient", "max_tokens": 900}, timeout=0.3)
        for t in threads:
            t.join(timeout=120)
        wait_for(lambda: metric(base, "num_requests_running") == 0, "no request running")
        assert metric(base, "num_requests_waiting") == 0
        assert metric(base, "kv_cache_pages_used") == 0
    assert sum(v == "left" for v in results.values()) == num // leave_every
    assert all(v == "done 150" for i, v in results.items() if i % leave_every)
    table = rows(tmp_path)
    assert len(table) == num + 1  # every request has a row with its fate
    aborted = [r for r in table if r["finish_reason"] == "aborted"]
    assert len(aborted) == num // leave_every + 1
    assert all(r["error"] == "client disconnected" for r in aborted)
    assert all(5 <= r["output_len"] < 1000 for r in aborted if r["max_tokens"] == 1000)
    assert sorted(r["output_len"] for r in table if r["finish_reason"] == "length") == [150] * (num - num // leave_every)
