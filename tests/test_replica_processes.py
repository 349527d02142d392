"""Engine-cluster replicas in child processes (`cluster.backend=processes`), on a stand-in
executor (tests/fake_replica.py: no jax, each child starts in about a second): the proxies
carry the whole executor contract and nothing else, K/V crosses between processes, each child
starts with its own devices in its environment, and a child that fails ends the run with one
line naming the replica and a fate for every request. The real engine's runs are in
tests/test_cluster_engine.py."""

import dataclasses
import functools
import json
import os
import signal
import time

import pytest

import fake_replica
from test_contracts import Strict
from cbjax.app import run as app_run
from cbjax.cluster.devices import replica_environments, visible_gpus
from cbjax.cluster.engine import ClusterEngine
from cbjax.cluster.processes import ProcessReplicas
from cbjax.cluster.remote import ReplicaFailed
from cbjax.config import LengthConfig, WorkloadConfig
from cbjax.core.executor import Executor
from cbjax.core.request import FinishReason

PD = dict(prefill_replicas=1, decode_replicas=1, prefill_tensor=2)  # prefill: not pipelined (execute)


def serve(cfg, make_executor, requests):
    engine = ClusterEngine(cfg, make_executor)
    return engine, engine.serve(requests)


def outcome(result):
    return {r.request_id: (r.finish_reason.value, r.output_token_ids) for r in result.requests}


@pytest.mark.parametrize("cluster", [dict(replicas=2), PD], ids=["2_replicas", "pd"])
def test_replica_processes_serve_as_inline_replicas_through_the_executor_contract_alone(cluster):
    _, inline = serve(fake_replica.config("inline", **cluster), fake_replica.build, fake_replica.workload())
    cfg = fake_replica.config("processes", **cluster)
    replicas = ProcessReplicas(fake_replica.build, cfg)
    seen: set = set()
    proxies = []

    def strict(rcfg):
        proxies.append(replicas(rcfg))
        assert isinstance(proxies[-1], Executor)
        return Strict(proxies[-1], Executor, seen)

    try:
        engine, result = serve(cfg, strict, fake_replica.workload())
        summary = engine.summary_fields(result)
    finally:
        replicas.shutdown()
    expected = outcome(inline)
    assert {fate for fate, _ in expected.values()} == {"length"} and all(len(t) == 5 for _, t in expected.values())
    assert outcome(result) == expected  # under P/D, the decode tokens read the K/V that crossed
    assert not [name for name in seen if isinstance(name, tuple)], seen  # nothing outside the protocol asked for
    assert {"warmup", "restart_compile_count", "metrics", "close", "pipelined", "validate"} <= seen
    pids = [p.pid for p in proxies]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    metrics = [p.metrics() for p in proxies]  # kept after close
    assert [m["pid"] for m in metrics] == pids and summary["compiles_after_warmup"] == 0
    tensors = [2, 1] if cluster is PD else [1, 1]  # each child forced as many CPU devices as its mesh
    forced = [[f for f in m["xla_flags"].split() if f.startswith("--xla_force_host")] for m in metrics]
    assert forced == [[f"--xla_force_host_platform_device_count={n}"] for n in tensors]
    assert all(m["jax_platforms"] == "cpu" for m in metrics)
    if cluster is PD:
        assert {"execute", "launch", "collect", "export_kv", "import_kv"} <= seen and summary["kv_transfers"] == 6
    else:
        assert {"launch", "collect"} <= seen and [r.num_routed for r in engine.replicas] == [3, 3]


def test_replica_processes_leave_sigterm_to_the_driver():
    """A SIGTERM to the run's whole process group (`timeout`, systemd, Slurm) reaches the
    children too; the driver stops the run, so they serve on (and are still closed by it)."""
    cfg = fake_replica.config("processes", replicas=2)
    replicas = ProcessReplicas(fake_replica.build, cfg)
    try:
        engine = ClusterEngine(cfg, replicas)  # children started and warmed up
        for transport in replicas.transports:
            os.kill(transport.process.pid, signal.SIGTERM)
        time.sleep(0.5)  # what a delivered SIGTERM would have done by now
        assert all(t.process.is_alive() for t in replicas.transports)
        result = engine.serve(fake_replica.workload())
    finally:
        replicas.shutdown()
    assert {r.finish_reason for r in result.requests} == {FinishReason.LENGTH}
    assert not any(t.process.is_alive() for t in replicas.transports)

def _failing_run(monkeypatch, tmp_path, how):
    """`run_cluster` on 2 fake replicas in processes, replica 1 failing at request 3's step."""
    workload = WorkloadConfig(num_requests=6, prompt_len=LengthConfig(value=8), output_len=LengthConfig(value=5), vocab_size=50)
    cfg = dataclasses.replace(fake_replica.config("processes", replicas=2), workload=workload)

    def build_cluster(cfg):
        replicas = ProcessReplicas(functools.partial(fake_replica.build, fail_on="3", how=how), cfg)
        return ClusterEngine(cfg, replicas), replicas.shutdown

    monkeypatch.setattr(app_run, "build_cluster", build_cluster)
    with pytest.raises(ReplicaFailed) as failed:
        app_run.run_cluster(cfg, tmp_path, verbose=False)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "summary.json").read_text())
    return str(failed.value), rows, summary


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_replica_failing_while_stepping_ends_the_run_in_one_line_with_every_requests_fate(monkeypatch, tmp_path, how):
    error, rows, summary = _failing_run(monkeypatch, tmp_path, how)
    cause = "ValueError: injected failure on request 3 (tests/fake_replica.py:" if how == "raise" else "its process (pid "
    assert error.startswith(f"replica 1 failed while stepping: {cause}") and "\n" not in error, error
    if how == "exit":
        assert error.endswith("exited with code 3")
    assert sorted(r["request_id"] for r in rows) == [str(i) for i in range(6)]  # a row per request
    for row in rows:  # round robin: 1, 3, 5 on replica 1, which failed at its first step
        if row["replica"] == 1:
            assert (row["finish_reason"], row["error"]) == ("error", error), row
        else:
            assert row["finish_reason"] in ("aborted", "length"), row
            assert row["finish_reason"] == "length" or row["error"] == f"run stopped: {error}", row
    assert {r["request_id"] for r in rows if r["replica"] == 1} == {"1", "3", "5"}
    assert summary["interrupted"] and summary["replica_failure"] == error
    assert summary["compiles_after_warmup"] is None  # the failed replica's count is gone with it


def test_a_replica_failing_to_copy_kv_out_ends_its_request_and_the_run():
    cfg = fake_replica.config("processes", **PD)
    replicas = ProcessReplicas(functools.partial(fake_replica.build, how="export"), cfg)
    try:
        engine, result = serve(cfg, replicas, fake_replica.workload(late=30.0))
    finally:
        replicas.shutdown()
    error = str(engine.failure)
    assert error.startswith("replica 0 failed while copying K/V out: RuntimeError: no K/V (tests/fake_replica.py:")
    fates = {r.request_id: (r.finish_reason, r.error) for r in result.requests}
    assert fates["5"] == (FinishReason.NOT_ARRIVED, None)  # never arrived: the run ended first
    assert (FinishReason.ERROR, error) in fates.values() and result.interrupted
    assert all(r.is_finished for r in result.requests)


def test_a_replica_failing_to_build_fails_the_cluster_naming_it():
    cfg = fake_replica.config("processes", **PD)
    replicas = ProcessReplicas(functools.partial(fake_replica.build, how="build"), cfg)
    try:
        with pytest.raises(ReplicaFailed, match=r"^replica 0 failed while starting: ValueError: no executor "):
            ClusterEngine(cfg, replicas)
    finally:
        replicas.shutdown()


def test_each_replica_process_gets_its_own_devices():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_foo=1"}
    cpu = replica_environments([2, 1], env, None)
    assert cpu == [
        {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2"},
        {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=1"},
    ]
    gpus = replica_environments([2, 1, 1], {}, ["4", "5", "6", "7"])
    assert gpus == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6"}, {"CUDA_VISIBLE_DEVICES": "7"}]
    with pytest.raises(ValueError, match=r"cluster.replicas: 2 replicas of executor.mesh.tensor \[2, 2\] need 4 GPUs"):
        replica_environments([2, 2], {}, ["0", "1", "2"])
    assert visible_gpus({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0,1"}) is None
    assert visible_gpus({"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) is None
    with pytest.raises(ValueError, match=r"cluster.backend=processes: TPU chips are not split"):
        visible_gpus({"JAX_PLATFORMS": "tpu"})


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_a_pool_tensor_size_that_cannot_split_the_model_fails_before_any_replica_starts(monkeypatch, pool):
    """The pool's own key is named (its replicas' executor.mesh.tensor is set from it), and
    no replica process is started for a run that cannot run."""
    cfg = fake_replica.config("processes", prefill_replicas=1, decode_replicas=1, **{f"{pool}_tensor": 3})
    assert cfg.model.num_kv_heads % 3  # the engine splits kv heads over the mesh

    def start(*args, **kwargs):
        raise AssertionError("a replica process was started")

    monkeypatch.setattr(ProcessReplicas, "__init__", start)
    with pytest.raises(ValueError, match=rf"^cluster.{pool}_tensor=3: model.num_kv_heads=\d+ is not divisible by it"):
        app_run.build_cluster(cfg)


def test_bad_router_args_fail_before_any_replica_starts(monkeypatch):
    cfg = fake_replica.config("processes", replicas=2, router="power_of_two", router_args={"seed": "abc"})

    def start(*args, **kwargs):
        raise AssertionError("a replica process was started")

    monkeypatch.setattr(ProcessReplicas, "__init__", start)
    with pytest.raises(ValueError, match=r"^cluster.router_args.seed: PowerOfTwo expects int, got 'abc'"):
        app_run.build_cluster(cfg)
