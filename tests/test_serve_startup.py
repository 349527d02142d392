"""cbjax-serve's startup: an address it cannot take and a queue bound that would refuse every
request fail in one line naming the keys."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from conftest import REPO
from test_serve import serve_config
from cbjax.serve import process as serve_process
from cbjax.serve.server import Server


def test_a_port_in_use_is_an_error_naming_the_keys():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        srv = Server(serve_config(f"server.port={port}"))
        with pytest.raises(OSError, match=rf"^server.host=127.0.0.1 server.port={port}: cannot listen there: "):
            srv.bind()
    finally:
        taken.close()


def test_a_host_that_is_no_address_here_is_an_error_naming_the_keys():
    srv = Server(serve_config("server.host=192.0.2.1"))  # TEST-NET-1: no interface of this machine has it
    with pytest.raises(OSError, match=r"^server.host=192.0.2.1 server.port=0: cannot listen there: "):
        srv.bind()


def test_bound_before_listening_refuses_connections_until_listen():
    srv = Server(serve_config())
    sock = srv.bind(listen=False)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(sock.getsockname()[:2], timeout=5).close()
        srv.listen(sock)
        socket.create_connection(sock.getsockname()[:2], timeout=5).close()
    finally:
        sock.close()


def test_a_queue_bound_of_0_is_refused():
    with pytest.raises(ValueError, match=r"server.max_queue must be >= 1 \(null: no bound\), got 0"):
        serve_config("server.max_queue=0")
    assert serve_config("server.max_queue=1").server.max_queue == 1


def test_the_command_names_the_keys_in_one_line_when_the_port_is_taken(env_cpu, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    cmd = [sys.executable, "-m", "cbjax.serve", "model=tiny", "hardware=a100_80gb", f"server.port={port}",
           f"hydra.run.dir={tmp_path}"]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env_cpu, capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"cbjax-serve: error: server.host=127.0.0.1 server.port={port}: cannot listen there: Address already in use"
    ]


def test_a_server_started_for_a_script_that_fails_to_start_says_why(env_cpu, tmp_path):
    with pytest.raises(RuntimeError) as err:
        serve_process.start(["server.drain_s=-1", f"hydra.run.dir={tmp_path}"], REPO, env_cpu)
    assert str(err.value).startswith("cbjax-serve exited 2 before listening: ")
    assert "cbjax-serve: error: server.drain_s must be >= 0" in str(err.value)
