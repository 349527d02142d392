"""cbjax-serve as a process: SIGTERM mid-load drains, aborts the rest, writes its files, exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import REPO
from cbjax.serve import process as serve_process
from cbjax.serve.server import Server
from test_serve import rows, serve_config

SHORT, LONG = 20, 3000  # tokens: at 2 ms an iteration, done well within the 3 s drain / running after it


def start_server(tmp_path, env, *overrides: str) -> tuple[subprocess.Popen, str]:
    """Start `python -m cbjax.serve` on a free port; return it and its /v1 URL once it listens."""
    return serve_process.start([f"hydra.run.dir={tmp_path / 'run'}", *overrides], REPO, env)


def num_received(base: str) -> float:
    """Requests the server has taken in: running, waiting, or ended (from /metrics)."""
    text = httpx.get(base.removesuffix("/v1") + "/metrics").text
    names = ("cbjax:num_requests_running{", "cbjax:num_requests_waiting{", "cbjax:request_success_total{")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names))


def test_sigterm_mid_load_drains_writes_every_request_and_exits_0(tmp_path, env_cpu):
    proc, base = start_server(
        tmp_path, env_cpu, "overhead.step_s=0.002", "server.drain_s=3", "scheduler.max_num_seqs=8",
        "model.max_model_len=4096", "cache.num_pages=2048",
    )  # fmt: skip
    statuses: list[int] = []
    errors: list[str] = []
    first_tokens = threading.Semaphore(0)

    def client(i: int) -> None:
        body = {"prompt": f"client {i}", "max_tokens": LONG if i % 2 else SHORT, "stream": True}
        try:
            with httpx.stream("POST", f"{base}/completions", json=body, timeout=60) as resp:
                statuses.append(resp.status_code)
                for n, _line in enumerate(resp.iter_lines()):
                    if n == 0:
                        first_tokens.release()
        except httpx.HTTPError as e:
            statuses.append(-1)  # refused after the listener closed: never received
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for _ in range(8):  # the first batch is running
        assert first_tokens.acquire(timeout=60)
    # and the other four have reached the server (else a late one would come after the signal: a 503)
    deadline = time.monotonic() + 60
    while num_received(base) != 12:
        assert time.monotonic() < deadline, "the last four requests never reached the queue"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    assert proc.wait(timeout=60) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
    received = sum(1 for s in statuses if s == 200)
    assert len(rows) == received == 12, errors  # every request sent before the signal was received
    fates = sorted(r["finish_reason"] for r in rows)
    # the short ones finished (some still queued when the signal came), the long ones were
    # aborted once server.drain_s had passed
    assert fates == ["aborted"] * 6 + ["length"] * 6
    assert all(r["output_len"] == SHORT for r in rows if r["finish_reason"] == "length")
    assert all(r["error"].startswith("server shutting down") for r in rows if r["finish_reason"] == "aborted")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_requests"] == 12 and summary["num_aborted"] == 6 and summary["num_finished"] == 6
    assert (run / "config.yaml").is_file() and not (run / "requests.jsonl.partial").exists()


def test_a_bad_config_exits_2_naming_the_key(tmp_path, env_cpu):
    cmd = [sys.executable, "-m", "cbjax.serve", "server.drain_s=-1", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env_cpu, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "server.drain_s must be >= 0" in proc.stderr


def test_a_second_ctrl_c_aborts_what_is_left_and_every_stream_ends_cleanly(tmp_path, env_cpu):
    proc, base = start_server(
        tmp_path, env_cpu, "overhead.step_s=0.002", "server.drain_s=120", "scheduler.max_num_seqs=8",
        "model.max_model_len=4096", "cache.num_pages=2048",
    )  # fmt: skip
    ends: list[tuple[int, str]] = []  # (status, the response's last data line)

    def client(i: int) -> None:
        body = {"prompt": f"client {i}", "max_tokens": LONG, "stream": i % 2 == 0}
        with httpx.stream("POST", f"{base}/completions", json=body, timeout=60) as resp:
            lines = [line for line in resp.iter_lines() if line]
            ends.append((resp.status_code, lines[-1] if lines else ""))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while num_received(base) != 4:
        assert time.monotonic() < deadline, "the requests never reached the server"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)  # drains: the long requests would run on for server.drain_s
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # aborts them now
    for t in threads:
        t.join(timeout=60)
    assert proc.wait(timeout=60) == 0
    assert sorted(s for s, _ in ends) == [200] * 4
    streamed = [last for s, last in ends if last.startswith("data:")]
    assert streamed == ["data: [DONE]"] * 2
    bodies = [json.loads(last) for s, last in ends if not last.startswith("data:")]
    assert [b["choices"][0]["finish_reason"] for b in bodies] == ["abort"] * 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    assert all(r["finish_reason"] == "aborted" and r["error"] == "server shutting down (a second Ctrl-C)" for r in rows)


def test_a_ctrl_c_while_the_outputs_are_written_loses_no_row(tmp_path):
    # the server on this (the main) thread, as cbjax-serve runs it: its signal handlers are live
    srv = Server(serve_config(), tmp_path)
    srv.warmup()
    sock = srv.bind()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finish = srv.engine.finish

    def interrupted_finish():
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again, as the files are being written
        return finish()

    srv.engine.finish = interrupted_finish

    def client() -> None:
        httpx.post(f"{base}/completions", json={"prompt": "a", "max_tokens": 3}, timeout=60)
        srv.shutdown()

    thread = threading.Thread(target=client)
    thread.start()
    try:
        summary = srv.run(sock)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C cut the writing of the outputs short")
    finally:
        thread.join(timeout=60)
    assert summary is not None and summary["num_requests"] == 1
    assert [r["finish_reason"] for r in rows(tmp_path)] == ["length"]
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "config.yaml").is_file()
