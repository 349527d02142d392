"""cbjax-bench against cbjax-serve (in-process, paced simulator): open and closed loop, cbjax's
run files, and collect_sweep reading them; the command against scripted servers: a bench.url
it cannot reach, and an interrupted load."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO
from test_bench_client import MODELS, USAGE, chunked, scripted_server, server_thread, sse, text
from test_serve import rows, running
import cbjax.bench.cli  # noqa: F401  registers BenchConfig
from cbjax.bench.config import BenchConfig
from cbjax.bench.run import run_bench
from cbjax.app.config_merge import check_known_keys

WORKLOAD = ["workload.num_requests=24", "workload.arrival=poisson", "workload.rate=40",
            "workload.prompt_len.low=8", "workload.prompt_len.high=64",
            "workload.output_len.dist=uniform", "workload.output_len.low=4", "workload.output_len.high=40"]  # fmt: skip


def bench_config(*overrides: str) -> BenchConfig:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="bench", overrides=["progress=false", *overrides])
    check_known_keys(cfg, BenchConfig)
    return OmegaConf.to_object(cfg)


def test_bench_config_checks_its_keys():
    assert bench_config().bench.concurrency is None
    with pytest.raises(ValueError, match="bench.concurrency must be >= 1"):
        bench_config("bench.concurrency=0")
    with pytest.raises(ValueError, match="bench.prompt must be text with bench.endpoint=chat"):
        bench_config("bench.endpoint=chat")
    with pytest.raises(ValueError, match=r"^seed must be >= 0, got -1$"):  # the key, as cbjax names it
        bench_config("seed=-1")
    with pytest.raises(ValueError, match="bench.url must be an http"):
        bench_config("bench.url=localhost:8000")
    for url in ("http://127.0.0.1:99999/v1", "http:///v1", "http://127.0.0.1:0/v1", "http://h:x/v1"):
        with pytest.raises(ValueError, match="bench.url needs a host, and a port from 1 to 65535"):
            bench_config(f"bench.url={url}")


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_bench_replays_a_workload_and_writes_cbjax_run_files(tmp_path, mode):
    server_dir, bench_dir = tmp_path / "server", tmp_path / "bench"
    loop = ["bench.concurrency=3"] if mode == "closed" else []
    with running(server_dir, "scheduler.max_num_seqs=8") as (base, srv):
        cfg = bench_config(f"bench.url={base}", "slo.ttft_s=10", "slo.tpot_s=10", *WORKLOAD, *loop)
        summary = run_bench(cfg, bench_dir, verbose=False)
    client = rows(bench_dir)
    server = rows(server_dir)
    assert summary["num_requests"] == summary["num_finished"] == 24 and summary["num_http_errors"] == 0
    # every request came back with the workload's output length, and the server saw the same
    # requests (matched by their lengths: the ids differ)
    assert all(r["output_len"] == r["target_output_len"] for r in client)
    assert sorted((r["prompt_len"], r["output_len"]) for r in client) == sorted((r["prompt_len"], r["output_len"]) for r in server)
    assert all(r["ttft_s"] is not None and r["e2e_s"] >= r["ttft_s"] for r in client)
    assert all(len(r["itl_s"]) == r["output_len"] - 1 for r in client)  # one chunk per token
    assert summary["output_tokens"] == sum(r["output_len"] for r in client)
    assert summary["goodput_req_s"] > 0 and summary["slo_attainment"] == 1.0 and summary["mode"] == mode
    assert summary["itl_s_p50"] == summary["tbt_s_p50"] is not None
    assert "iterations" not in summary  # the server's own counters are not the client's to report
    server_summary = json.loads((server_dir / "summary.json").read_text())
    if mode == "closed":  # at most 3 in flight: the server never ran a larger batch
        assert server_summary["peak_batch_size"] <= 3
    assert (bench_dir / "config.yaml").is_file()


def test_cbjax_bench_command_and_collect_sweep(tmp_path, env_cpu):
    out = tmp_path / "bench"
    with running(None) as (base, srv):
        cmd = [sys.executable, "-m", "cbjax.bench", f"bench.url={base}", "bench.endpoint=chat", "bench.prompt=text",
               "progress=false", f"hydra.run.dir={out}", "workload.num_requests=6", "workload.output_len.dist=fixed",
               "workload.output_len.value=5", "workload.prompt_len.dist=fixed", "workload.prompt_len.value=10"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO, env=env_cpu, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "TTFT p50" in proc.stdout and f"outputs: {out}" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_finished"] == 6 and summary["output_tokens"] == 30
    col = subprocess.run([sys.executable, "experiments/collect_sweep.py", str(out), "--metrics", "ttft_s_p50,itl_s_p50,goodput_req_s"],
                         cwd=REPO, env=env_cpu, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert col.returncode == 0, col.stderr
    assert "ttft_s_p50" in col.stdout


BENCH = [sys.executable, "-m", "cbjax.bench", "progress=false", "workload.num_requests=8", "workload.output_len.dist=fixed",
         "workload.output_len.value=4", "workload.prompt_len.dist=fixed", "workload.prompt_len.value=4"]  # fmt: skip


def bench_cmd(tmp_path, env, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*BENCH, f"hydra.run.dir={tmp_path / 'bench'}", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


async def plain_http_server():
    """Answers whatever comes, a TLS hello included, with a plain-HTTP 400, as uvicorn does."""

    async def handle(reader, writer):
        await reader.read(1024)
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


def test_a_url_nobody_listens_at_is_one_line_naming_bench_url(tmp_path, env_cpu):
    with socket.socket() as sock:  # a port nothing listens at once it is closed
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    proc = bench_cmd(tmp_path, env_cpu, f"bench.url={url}", "bench.model=m")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and err.splitlines() == [f"cbjax-bench: error: bench.url={url}: connection refused"]


def test_an_error_before_the_load_clears_the_progress_bar_first(capsys):
    with socket.socket() as sock:  # a port nothing listens at once it is closed
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    with pytest.raises(ValueError, match="connection refused"):
        run_bench(bench_config(f"bench.url={url}", "bench.model=m", "progress=true"), None, verbose=False)
    err = capsys.readouterr().err
    assert "bench" in err and err.split("\r")[-1].strip() == ""  # the bar drew, then left its line blank


def test_https_to_a_plain_http_server_is_one_line_naming_bench_url(tmp_path, env_cpu):
    with server_thread(plain_http_server) as url:
        proc = bench_cmd(tmp_path, env_cpu, f"bench.url={url}")
        _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and err.splitlines() == [
        f"cbjax-bench: error: bench.url={url}: TLS handshake failed (WRONG_VERSION_NUMBER): the server seems to speak plain HTTP; try http://"]


def stall_then_interrupt(count: int, procs: list):
    """A streamed answer that sends one token and keeps the stream open; the `count`-th such
    answer sends SIGINT to the benchmark, `procs[0]` (appended once started)."""
    stalled = 0

    async def stall(writer):
        nonlocal stalled
        writer.write(chunked(sse(text("a")))[: -len(b"0\r\n\r\n")])  # one token, and the stream stays open
        await writer.drain()
        stalled += 1
        if stalled == count:
            procs[0].send_signal(signal.SIGINT)
        await asyncio.sleep(60)

    return stall


def test_an_interrupted_bench_keeps_a_row_with_its_fate_for_every_request_sent(tmp_path, env_cpu):
    """Closed loop, 3 in flight: the first request finishes, the next three stall after one
    token, and SIGINT comes while they do. The four sent get rows (one `length`, three
    `aborted`); the four never sent get none."""
    procs: list = []
    stall = stall_then_interrupt(3, procs)

    def answer(n: int, head: bytes):
        if head.startswith(b"GET"):
            return MODELS
        return chunked(sse(*(text(t) for t in "abc"), text("d", "length"), b"[DONE]")) if n == 1 else stall

    out = tmp_path / "bench"
    with server_thread(lambda: scripted_server(answer)) as url:
        proc = bench_cmd(tmp_path, env_cpu, f"bench.url={url}", "bench.concurrency=3")
        procs.append(proc)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == f"cbjax-bench: interrupted by SIGINT; the requests sent are saved in {out}"
    fates = sorted((r["finish_reason"], r["output_len"], r["error"]) for r in rows(out))
    assert fates[0] == ("aborted", fates[0][1], "cbjax-bench was interrupted (SIGINT)") and fates[-1] == ("length", 4, None)
    assert [f[0] for f in fates] == ["aborted"] * 3 + ["length"] and all(f[2] == fates[0][2] for f in fates[:3])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["num_requests"] == 4 and summary["num_aborted"] == 3
    assert summary["num_finished"] == 1 and summary["num_http_errors"] == 0


def test_a_chunk_is_a_token_even_with_empty_text_but_not_a_role_or_finish_only_chunk():
    from cbjax.bench.stream import is_token

    # completions
    assert is_token({"index": 0, "text": "a", "finish_reason": None})
    assert is_token({"index": 0, "text": "", "finish_reason": None})  # a token with no text of its own
    assert is_token({"index": 0, "text": "z", "finish_reason": "length"})  # the last token, with the reason
    assert not is_token({"index": 0, "text": "", "finish_reason": "length"})  # only the finish reason
    # chat
    assert not is_token({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
    assert is_token({"index": 0, "delta": {"content": ""}, "finish_reason": None})
    assert is_token({"index": 0, "delta": {"content": "hi"}, "finish_reason": None})
    assert not is_token({"index": 0, "delta": {}, "finish_reason": "stop"})


def test_an_interrupt_after_the_last_send_of_an_open_loop_aborts_the_requests_in_flight(tmp_path, env_cpu):
    """Open loop, both requests sent at once: once both have been sent, the load only waits for
    them. They stall after one token and SIGINT comes: both are cut short as `aborted` at once,
    not left running until bench.timeout_s ends them as errors."""
    procs: list = []
    stall = stall_then_interrupt(2, procs)
    out = tmp_path / "bench"
    answer = lambda n, head: MODELS if head.startswith(b"GET") else stall  # noqa: E731
    with server_thread(lambda: scripted_server(answer)) as url:
        proc = bench_cmd(tmp_path, env_cpu, f"bench.url={url}", "workload.num_requests=2", "bench.timeout_s=15")
        procs.append(proc)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert [(r["finish_reason"], r["output_len"], r["error"]) for r in rows(out)] == [
        ("aborted", 1, "cbjax-bench was interrupted (SIGINT)")] * 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["num_aborted"] == 2 and summary["num_http_errors"] == 0


def test_a_bad_trace_line_late_in_a_closed_loop_does_not_stretch_the_makespan(tmp_path):
    """A closed loop ignores arrival times: its two requests are answered at once, long before
    the trace's malformed third line's time (1000 s). That line is a rejected row, and the
    makespan is the load's own (throughput over it), not the line's timestamp."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_len,output_len\n0.0,4,3\n0.0,4,3\n1000.0,4,-1\n")
    three = chunked(sse(text("a"), text("b"), text("c", "length"), USAGE, b"[DONE]"))
    answer = lambda n, head: MODELS if head.startswith(b"GET") else three  # noqa: E731
    with server_thread(lambda: scripted_server(answer)) as url:
        cfg = bench_config(f"bench.url={url}", "bench.concurrency=1", "workload=trace", f"workload.path={trace}")
        summary = run_bench(cfg, tmp_path / "bench", verbose=False)
    assert [r["finish_reason"] for r in rows(tmp_path / "bench")] == ["length", "length", "rejected"]
    assert summary["num_finished"] == 2 and summary["output_tokens"] == 6 and summary["num_rejected"] == 1
    assert 0 < summary["makespan_s"] < 60
    assert summary["throughput_req_s"] == 2 / summary["makespan_s"]


def test_the_summary_names_the_model_the_requests_asked_for(tmp_path):
    """bench.model unset: the requests ask for the first model GET /models lists, and
    summary.json names that model, not the unset key."""
    log: list = []

    async def start():
        server, url, got = await scripted_server(answer)
        log.append(got)
        return server, url

    one = chunked(sse(text("a", "length"), b"[DONE]"))
    answer = lambda n, head: MODELS if head.startswith(b"GET") else one  # noqa: E731
    with server_thread(start) as url:
        summary = run_bench(bench_config(f"bench.url={url}", "workload.num_requests=2"), tmp_path / "bench", verbose=False)
    posted = [json.loads(body)["model"] for _, head, body in log[0] if head.startswith(b"POST")]
    assert posted == ["tiny", "tiny"] and summary["num_finished"] == 2
    assert summary["model"] == "tiny"
