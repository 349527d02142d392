"""Engine clusters on forced CPU devices, each replica's executor in a child process of its own
(`cluster.backend=processes`, the default): 2 replicas x TP 1, and P/D (a TP 2 prefill child
feeding a TP 1 decode child, the K/V through the driver) give a single replica's greedy tokens
with 0 compiles after warmup; so does P/D with every replica in one process
(`cluster.backend=inline`, on disjoint devices of that process); the CLI writes each
request's replica. The contract, device and failure checks of replica processes run on a
stand-in executor in tests/test_replica_processes.py.

Forced CPU devices need XLA_FLAGS before jax starts, so the engine runs in subprocesses.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cbjax_cmd
from cbjax.runtime import mesh

HERE = Path(__file__).resolve().parent


def _env(env_cpu, devices):
    env = dict(env_cpu)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = str(HERE) + ":" + env["PYTHONPATH"]
    return env


def _runs(env_cpu, cache_dir, *names) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / "cluster_engine.py"), f"--cache={cache_dir}", *names],
        env=_env(env_cpu, 8), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_engine_clusters_give_the_single_replica_tokens_with_no_compiles_after_warmup(env_cpu, tmp_path):
    layouts = ["2x1", "pd_2_1", "inline_pd_2_1"]
    runs = _runs(env_cpu, tmp_path, "single", *layouts, "stop_pd_2_1")
    single = runs["single"]["tokens"]
    assert len(single) == 6 and all(len(t) >= 4 for t in single.values())
    for name in layouts:
        run = runs[name]
        assert run["tokens"] == single, name
        assert run["fates"] == ["length"] and run["compiles_after_warmup"] == [0, 0], name
        assert run["summary_compiles_after_warmup"] == 0 and not run["interrupted"], name
        assert run["pages_leaked"] == [0, 0], name  # a prefill's held pages were released after the copy
        assert run["replica_failure"] is None, name
    for name in ("2x1", "pd_2_1", "stop_pd_2_1"):  # a process per replica, not the driver's
        pids = runs[name]["pids"]
        assert len(set(pids)) == 2 and runs[name]["driver_pid"] not in pids, name
    assert runs["pd_2_1"]["mesh_tensor"] == runs["inline_pd_2_1"]["mesh_tensor"] == [2, 1]
    assert runs["inline_pd_2_1"]["devices"] == [[0, 1], [2]]  # inline: disjoint devices of one process
    assert runs["2x1"]["requests"] == [3, 3]  # round robin: both replicas served
    assert {row["replica"] for row in runs["2x1"]["rows"].values()} == {0, 1}
    for name in ("pd_2_1", "inline_pd_2_1"):  # every request prefilled on 0, its K/V moved, decoded on 1
        assert runs[name]["kv_transfers"] == 6
        for row in runs[name]["rows"].values():
            assert (row["prefill_replica"], row["decode_replica"]) == (0, 1) and row["kv_transfer_s"] > 0
    stopped = runs["stop_pd_2_1"]  # stopped mid-run: each request ends once, no page stays held
    assert stopped["interrupted"] and set(stopped["fates"]) == {"aborted", "length"}
    assert stopped["pages_leaked"] == [0, 0] and stopped["replica_failure"] is None
    for rid, tokens in stopped["tokens"].items():
        assert tokens == single[rid][: len(tokens)], rid
        assert (tokens == single[rid]) == (stopped["fate"][rid] == "length"), rid


def test_cli_runs_an_engine_cluster_and_writes_each_requests_replica(tmp_path, env_cpu):
    cmd = cbjax_cmd() + [
        "executor=jax", "cluster.replicas=2", "workload.num_requests=6", "model.max_model_len=64",
        "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=32", "cache.num_pages=64", "cache.page_size=4",
        "executor.token_buckets=[32]", "executor.compilation_cache_dir=null", "workload.prompt_len.dist=fixed", "workload.prompt_len.value=8",
        "workload.output_len.dist=fixed", "workload.output_len.value=4", "progress=false", f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(env_cpu, 2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert sorted(r["replica"] for r in rows) == [0, 0, 0, 1, 1, 1]
    assert all(r["finish_reason"] == "length" and len(r["output_token_ids"]) == r["output_len"] == 4 for r in rows)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["replica"] for r in summary["replicas"]] == [0, 1] and summary["num_finished"] == 6
    assert [r["requests"] for r in summary["replicas"]] == [3, 3]
    assert summary["executor"] == "jax" and summary["compiles_after_warmup"] == 0
    assert summary["interrupted"] is False and summary["replica_failure"] is None


def test_too_few_devices_fail_naming_the_keys(monkeypatch):
    monkeypatch.setattr(mesh.jax, "devices", lambda: ["d0", "d1", "d2"])
    assert mesh.replica_devices([1, 2]) == [["d0"], ["d1", "d2"]]
    with pytest.raises(ValueError, match=r"cluster.replicas: 2 replicas of executor.mesh.tensor \[2, 2\] need 4 devices"):
        mesh.replica_devices([2, 2])


@pytest.mark.slow
def test_ray_replica_actors_give_the_replica_processes_tokens(env_cpu, tmp_path):
    """A local Ray cluster (2 CPUs, no dashboard): 2 replica actors, each its own process, and
    P/D with a prefill TP 2 actor whose K/V moves actor to actor into a TP 1 decode actor."""
    runs = _runs(env_cpu, tmp_path, "2x1", "ray_2x1", "ray_pd_2_1")
    local, ray_run, ray_pd = runs["2x1"], runs["ray_2x1"], runs["ray_pd_2_1"]
    assert len(local["tokens"]) == 6
    assert ray_run["tokens"] == local["tokens"] and ray_pd["tokens"] == local["tokens"]
    assert ray_run["rows"] == local["rows"]  # the same routing
    for run in (ray_run, ray_pd):
        assert run["fates"] == ["length"] and run["compiles_after_warmup"] == [0, 0]
        assert len(set(run["pids"])) == 2 and run["driver_pid"] not in run["pids"]  # one process per actor
        assert run["pages_leaked"] == [0, 0] and run["summary_compiles_after_warmup"] == 0
    assert ray_pd["kv_transfers"] == 6


def test_starting_ray_keeps_the_runs_sigterm_handler(monkeypatch):
    # ray.init installs a SIGTERM handler that exits at once; the run's (which saves every
    # request's fate) must stay in place
    import signal

    import ray

    from cbjax.cluster import ray_actors

    def ray_init(**kwargs):
        signal.signal(signal.SIGTERM, lambda *a: None)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", ray_init)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {})
    previous = signal.getsignal(signal.SIGTERM)
    runs = lambda *a: None  # noqa: E731
    signal.signal(signal.SIGTERM, runs)
    try:
        replicas = ray_actors.RayReplicas(lambda cfg: None)
        assert signal.getsignal(signal.SIGTERM) is runs and replicas.started_ray
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_engine_clusters_summary_adds_its_replicas_engine_figures_up():
    from cbjax.cluster.engine import cluster_metrics

    prefill = {"compiles_after_warmup": 0, "warmup_s": 2.0, "compiled_programs": 3, "sampler_calls": 0, "swap_s": 0.0,
               "bucket_calls": {"1024": 1}, "device_calls_per_iteration": 1.0, "mixed_iterations": 1}
    decode = {"compiles_after_warmup": 1, "warmup_s": 3.0, "compiled_programs": 4, "sampler_calls": 2, "swap_s": 0.5,
              "bucket_calls": {"16": 5, "1024": 2}, "device_calls_per_iteration": 2.0, "mixed_iterations": 0}
    both = [prefill, decode]
    apart = cluster_metrics(both, [1, 5], inline=False)
    assert (apart["compiles_after_warmup"], apart["warmup_s"]) == (1, 3.0)  # own processes, warmed side by side
    assert (apart["compiled_programs"], apart["sampler_calls"], apart["swap_s"], apart["mixed_iterations"]) == (7, 2, 0.5, 1)
    assert apart["bucket_calls"] == {"16": 5, "1024": 3}
    assert apart["device_calls_per_iteration"] == (1.0 * 1 + 2.0 * 5) / 6
    assert apart["host_pack_s"] is None  # a figure the replicas do not report
    shared = cluster_metrics(both, [1, 5], inline=True)
    assert (shared["compiles_after_warmup"], shared["warmup_s"]) == (1, 5.0)  # one process's count, one after another
    failed = cluster_metrics([prefill, {**decode, "compiles_after_warmup": None}], [1, 5], inline=False)
    assert failed["compiles_after_warmup"] is None
