"""Tensor parallelism and multi-host: sharded runs give the single-device tokens, nothing
compiles after warmup, each layer all-reduces twice, and bad meshes fail naming the fields.

Forced CPU devices need XLA_FLAGS before jax starts, so the engine runs in subprocesses.
"""

import dataclasses
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from conftest import cbjax_cmd
from cbjax.config import DistributedConfig, ExecutorConfig, ExperimentConfig, MeshConfig, ModelConfig, RunConfig, SchedulerConfig
from cbjax.runtime.batch import BatchPacker
from cbjax.app.multihost import start
from cbjax.runtime.distributed import PlanLink, check_same_config, shared_fields
from cbjax.runtime.hlo import all_reduce_traffic
from cbjax.runtime.mesh import check_tensor_parallel
from cbjax.layout.shapes import plan_shapes
from cbjax.sim.tp import allreduce_bytes_per_token, allreduces_per_step
from tp_engine import BUCKETS, MODEL, workload

HERE = Path(__file__).resolve().parent


def _env(env_cpu, devices=None):
    env = dict(env_cpu)
    env.pop("XLA_FLAGS", None)
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def test_tensor_2_4_8_give_the_single_device_tokens_with_two_all_reduces_per_layer(env_cpu):
    """Also under swap preemption at tensor 4, the sharded cache's pages round-tripping the host."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "tp_engine.py"), "1", "2", "4", "8", "4:swap"],
        env=_env(env_cpu, 8), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    single = runs["1"]
    assert single["mixed_iterations"] > 0, "the workload should mix prefills and decodes"
    assert all(len(t) >= 4 for t in single["tokens"].values())
    for tensor in ("1", "2", "4", "8"):
        run = runs[tensor]
        assert run["tokens"] == single["tokens"], f"tensor={tensor}"
        assert run["compiles_after_warmup"] == 0 and run["mesh_tensor"] == int(tensor)
        assert run["cache_shards"] == int(tensor)  # the KV cache is split over kv heads
        for bucket, (ops, nbytes) in run["all_reduce"].items():
            if tensor == "1":
                assert (ops, nbytes) == (0, 0)
            else:  # 2 layers x (attention, MLP), each [bucket, 64] f32
                assert ops == 2 * 2 == allreduces_per_step(MODEL), (tensor, bucket)
                assert nbytes == 4 * int(bucket) * 64 * 4 == int(bucket) * allreduce_bytes_per_token(MODEL)
    assert sorted(map(int, single["all_reduce"])) == BUCKETS
    swapped = runs["4:swap"]  # sharded pages copied to the host and back
    assert swapped["pages_swapped_out"] > 0 and swapped["tokens"] == single["tokens"]
    assert swapped["compiles_after_warmup"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(cmds: list[list[str]], env: dict, timeout: float, stdout: bool = True) -> tuple[list[int], list[str]]:
    """Run the commands side by side (the processes of one run); their exit codes and their
    output (stdout and stderr together), or stderr alone without `stdout`. Any still running
    at the end is killed."""
    out = subprocess.STDOUT if stdout else subprocess.PIPE
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=out, text=True) for cmd in cmds]
    try:
        texts = [p.communicate(timeout=timeout)[0 if stdout else 1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], texts


def test_two_processes_of_4_devices_give_the_one_process_tokens(tmp_path, env_cpu):
    trace = tmp_path / "w.jsonl"
    rows = [
        {"arrival_s": r.arrival_s, "prompt_token_ids": r.prompt_token_ids, "max_tokens": r.sampling.max_tokens}
        for r in workload()
    ]
    for i, row in enumerate(rows[::2]):  # sampled rows: the sampler compiles and runs on every process
        row.update(temperature=0.8, top_p=0.9, seed=i)
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = cbjax_cmd() + [
        "executor=jax", "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=32", "scheduler.chunked_prefill=true",
        "model.num_heads=16", "model.num_kv_heads=8", "model.head_dim=4", "model.max_model_len=64",
        "cache.num_pages=64", "cache.page_size=4", "executor.token_buckets=[32]", "executor.compilation_cache_dir=null",
        "workload=trace", f"workload.path={trace}", "progress=false",
    ]  # fmt: skip
    one = subprocess.run(common + [f"hydra.run.dir={tmp_path / 'one'}"], env=_env(env_cpu), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    dist = [
        f"distributed.coordinator_address=127.0.0.1:{_free_port()}", "distributed.num_processes=2", "executor.mesh.tensor=8"
    ]
    codes, logs = _run_processes([common + dist + [f"distributed.process_id={i}", f"hydra.run.dir={tmp_path / f'p{i}'}"]
                                  for i in (1, 0)], _env(env_cpu, 4), timeout=300)  # fmt: skip
    assert codes == [0, 0], "\n----\n".join(log[-3000:] for log in logs)

    def tokens(run_dir):
        return {r["request_id"]: r["output_token_ids"] for r in map(json.loads, (run_dir / "requests.jsonl").read_text().splitlines())}

    assert tokens(tmp_path / "p0") == tokens(tmp_path / "one")
    summary = json.loads((tmp_path / "p0" / "summary.json").read_text())
    assert summary["compiles_after_warmup"] == 0 and summary["mesh_tensor"] == 8 and summary["num_finished"] == 6
    assert summary["sampler_calls"] > 0
    # only process 0 writes outputs; process 1 ran every one of its steps
    assert not any((tmp_path / "p1" / name).exists() for name in ("summary.json", "requests.jsonl", "config.yaml"))
    assert f"distributed: process 1 ran {summary['iterations']} steps, 0 compiles after warmup" in logs[0]


def test_heads_or_devices_that_do_not_divide_fail_in_one_line_naming_the_fields():
    gqa = ModelConfig(num_heads=8, num_kv_heads=2, ffn_dim=128)
    with pytest.raises(ValueError) as err:
        check_tensor_parallel(gqa, 4, 8)
    assert str(err.value) == "model.num_kv_heads=2 is not divisible by executor.mesh.tensor=4"
    with pytest.raises(ValueError, match=r"^model.ffn_dim=100 is not divisible by executor.mesh.tensor=8$"):
        check_tensor_parallel(ModelConfig(num_heads=8, num_kv_heads=8, ffn_dim=100), 8, 8)
    with pytest.raises(ValueError) as err:
        check_tensor_parallel(gqa, 2, 1)
    assert str(err.value) == "executor.mesh.tensor=2 needs 2 devices, but only 1 are visible"
    check_tensor_parallel(gqa, 2, 8)  # 2 kv heads, 8 heads, 128 hidden units split in 2
    with pytest.raises(ValueError, match="executor.mesh.tensor must be >= 1"):
        MeshConfig(tensor=0)


@pytest.mark.parametrize(
    "devices, message",
    [
        (2, "executor.mesh.tensor=4 needs 4 devices, but only 2 are visible"),
        (8, "model.num_kv_heads=2 is not divisible by executor.mesh.tensor=4"),  # the tiny model: 4 heads, 2 kv heads
    ],
)
def test_cli_bad_mesh_fails_at_startup_in_one_line(tmp_path, env_cpu, devices, message):
    cmd = cbjax_cmd() + ["executor=jax", "executor.mesh.tensor=4", "workload.num_requests=1", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, env=_env(env_cpu, devices), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    # the one line, beside at most the notice of a missing optional kernel package
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("cbjax: the optional kernel package")]
    assert lines == [f"cbjax: error: {message}"]


def test_multi_host_config_without_process_id_fails_naming_the_key(tmp_path, env_cpu):
    with pytest.raises(ValueError, match=r"^distributed.process_id is required"):
        DistributedConfig(coordinator_address="10.0.0.1:1234", num_processes=2)
    with pytest.raises(ValueError, match=r"^distributed.coordinator_address is required"):
        DistributedConfig(num_processes=2, process_id=0)
    with pytest.raises(ValueError, match=r"^distributed.process_id must be in \[0, 2\)"):
        DistributedConfig(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=2)
    DistributedConfig()  # off: nothing required
    cmd = cbjax_cmd() + [
        "executor=jax", "distributed.coordinator_address=127.0.0.1:1234", "distributed.num_processes=2",
        f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(env_cpu), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("cbjax: error: distributed.process_id is required"), proc.stderr
    dist = DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="^executor.name must be jax"):
        RunConfig(distributed=dist)
    with pytest.raises(ValueError, match="^scheduler.preemption swap is not supported"):
        RunConfig(distributed=dist, executor=ExecutorConfig(name="jax"), scheduler=SchedulerConfig(preemption="swap"))
    arms = ExperimentConfig(name="x", arms={"a": {}, "b": {}})
    with pytest.raises(ValueError, match=r"^experiment.arms are not supported with distributed.num_processes=2"):
        RunConfig(distributed=dist, executor=ExecutorConfig(name="jax"), experiment=arms)
    with pytest.raises(ValueError, match="^distributed.num_processes: a multi-host run serves one config, not a multirun"):
        start(RunConfig(distributed=dist, executor=ExecutorConfig(name="jax")), multirun=True)


def test_processes_with_different_engine_settings_fail_naming_the_first_key():
    """Each process all-gathers a CRC32 per setting; here the gather is faked with rows of
    hand-made configs, so a mismatch is found without starting jax.distributed."""
    def cfg(pid, **kw):
        dist = DistributedConfig(coordinator_address="h:1", num_processes=3, process_id=pid)
        return RunConfig(**{"distributed": dist, "executor": ExecutorConfig(name="jax"), **kw})

    def digests(c):
        return np.array([zlib.crc32(v.encode()) for v in shared_fields(c).values()], np.uint32).view(np.int32)

    same = [cfg(0), cfg(1), cfg(2, progress=False)]  # progress, the workload: not shared
    same[2].workload.num_requests = 7
    check_same_config(same[1], gather=lambda mine: np.stack([digests(c) for c in same]))
    local = cfg(1, executor=ExecutorConfig(name="jax", compilation_cache_dir="/elsewhere"))
    check_same_config(local, gather=lambda mine: np.stack([digests(same[0]), mine, digests(same[2])]))
    # process 2 has another seed: its weights would differ, and the tokens with them
    rows = [cfg(0), cfg(1), cfg(2, seed=5)]
    gathered = np.stack([digests(c) for c in rows])
    with pytest.raises(ValueError) as err:
        check_same_config(rows[1], gather=lambda mine: gathered)
    assert str(err.value) == "distributed: seed=0 on process 1 differs on process(es) 2; give every process the same overrides"
    with pytest.raises(ValueError) as err:
        check_same_config(rows[2], gather=lambda mine: gathered)
    assert str(err.value) == "distributed: seed=5 on process 2 differs on process(es) 0, 1; give every process the same overrides"
    layers = [cfg(0, model=ModelConfig(num_layers=3)), cfg(1)]
    layers = [dataclasses.replace(c, distributed=DistributedConfig("h:1", 2, i)) for i, c in enumerate(layers)]
    with pytest.raises(ValueError, match=r"^distributed: model.num_layers=3 on process 0 differs on process\(es\) 1;"):
        check_same_config(layers[0], gather=lambda mine: np.stack([digests(c) for c in layers]))


def test_two_processes_with_different_seeds_both_fail_at_startup(tmp_path, env_cpu):
    cmd = cbjax_cmd() + [
        "executor=jax", "model.num_heads=8", "model.num_kv_heads=4", "executor.mesh.tensor=2", "workload.num_requests=1",
        f"distributed.coordinator_address=127.0.0.1:{_free_port()}", "distributed.num_processes=2",
    ]  # fmt: skip
    codes, errs = _run_processes([cmd + [f"distributed.process_id={i}", f"seed={i}", f"hydra.run.dir={tmp_path / f'p{i}'}"]
                                  for i in (1, 0)], _env(env_cpu, 1), timeout=120, stdout=False)  # fmt: skip
    assert codes == [2, 2], errs
    for i, err in zip((1, 0), errs):
        want = f"cbjax: error: distributed: seed={i} on process {i} differs on process(es) {1 - i}; give every process the same overrides"
        assert want in err.splitlines(), err
    assert not (tmp_path / "p0" / "requests.jsonl").exists()


def test_joining_says_what_it_waits_for_and_ctrl_c_ends_the_wait(tmp_path, env_cpu):
    """A process whose peers never come: the join is one C++ wait that the run's stop flag
    cannot interrupt, so it says what it waits for and SIGINT ends it at once."""
    address = f"127.0.0.1:{_free_port()}"
    cmd = cbjax_cmd() + [
        "executor=jax", "executor.mesh.tensor=2", "workload.num_requests=1", f"hydra.run.dir={tmp_path}",
        f"distributed.coordinator_address={address}", "distributed.num_processes=2",
        "distributed.process_id=1",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=_env(env_cpu), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    guard = threading.Timer(120, proc.kill)  # never hang the suite
    guard.start()
    try:
        line = proc.stdout.readline()
        want = f"distributed: process 1 joining distributed.num_processes=2 at distributed.coordinator_address={address} (up to 300 s)"
        assert line.strip() == want, line
        time.sleep(0.5)  # inside the wait
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGINT and time.monotonic() - t0 < 10
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()


def test_plan_link_carries_every_array_of_a_batch_bit_for_bit():
    """One process: the broadcast is the identity, so this checks the packing into one i32 buffer."""
    shapes = plan_shapes(4, 64, 4, 32, [4, 32])
    packer = BatchPacker(shapes, tiles=True)
    batch = packer.empty(32)
    rng = np.random.default_rng(0)
    batch.tokens[:] = rng.integers(0, 512, 32)
    batch.sampling[0][:] = [0.5, 0.0, 1.25, -0.0]  # f32 bits through an i32 buffer
    batch.sampling[3][:] = [0, 1, 2**32 - 1, 2**31]  # u32 seeds
    batch.num_rows_used, batch.num_tokens_used = 3, 17
    got, _ = PlanLink(packer, is_source=True)._exchange(batch)
    assert (got.num_rows_used, got.num_tokens_used) == (3, 17)
    for name in ("tokens", "positions", "write_idx", "page_table", "query_start", "kv_lens", "token_row", "token_pos", "logits_idx"):
        np.testing.assert_array_equal(getattr(got, name), getattr(batch, name))
    for a, b in zip(got.sampling, batch.sampling):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    for tiles_a, tiles_b in zip(got.tiles, batch.tiles):
        for a, b in zip(tiles_a, tiles_b):
            np.testing.assert_array_equal(a, b)


HLO = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %ar = f32[8,64]{1,0} all-reduce(%d), channel_id=1, to_apply=%add
  %ar2 = bf16[8,64]{1,0} all-reduce(%e), channel_id=2, to_apply=%add
}

%cond (p: (s32[], f32[8,64])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,64]) -> f32[8,64] {
  %w = (s32[], f32[8,64]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ar3 = (f32[4], s32[2]) all-reduce(%u, %v), channel_id=3, to_apply=%add
}
"""


def test_all_reduce_traffic_counts_loop_bodies_by_their_trip_count():
    # body: 3 x (8*64*4 + 8*64*2) bytes, 2 ops each; entry: one tuple all-reduce of 16 + 8 bytes
    assert all_reduce_traffic(HLO) == (3 * 2 + 1, 3 * (2048 + 1024) + 24)
    unknown = HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    with pytest.raises(ValueError, match="data-dependent"):
        all_reduce_traffic(unknown)

