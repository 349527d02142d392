"""Engine-cluster replicas in Ray actors (`cluster.backend=ray`) on the stand-in executor
(tests/fake_replica.py) and a local Ray (2 CPUs, no dashboard): a failure names the replica
where it happened, as under `cluster.backend=processes` (tests/test_replica_processes.py).
The real engine's Ray runs are in tests/test_cluster_engine.py.

The run is a subprocess of its own: Ray forks its workers, which is unsafe in a process whose
JAX threads are running (the test process imports JAX for other tests)."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PD = dict(prefill_replicas=1, decode_replicas=1, prefill_tensor=2)


def _scenario() -> dict:
    """A P/D cluster whose prefill actor fails to export K/V: the failure and each fate."""
    import fake_replica
    from cbjax.cluster import ray_actors
    from cbjax.cluster.engine import ClusterEngine

    cfg = fake_replica.config("ray", **PD)
    replicas = ray_actors.RayReplicas(functools.partial(fake_replica.build, how="export"), num_cpus=2)
    try:
        engine = ClusterEngine(cfg, replicas)
        result = engine.serve(fake_replica.workload(late=30.0))
    finally:
        replicas.shutdown()
    fates = {r.request_id: [r.finish_reason.value, r.error] for r in result.requests}
    return {"error": str(engine.failure), "fates": fates, "interrupted": result.interrupted}


@pytest.mark.slow
def test_a_prefill_actor_failing_to_copy_kv_out_is_the_replica_that_failed(env_cpu):
    """Its K/V goes to the decode actor through Ray's object store, so the decode actor's
    import is what meets the error first; the failure is still the prefill replica's."""
    pytest.importorskip("ray")
    from cbjax.core.request import FinishReason

    # the actors unpickle fake_replica.build by reference: Ray's workers inherit this path
    env = {**env_cpu, "PYTHONPATH": os.pathsep.join([str(HERE), env_cpu["PYTHONPATH"]])}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    error = out["error"]
    assert error.startswith("replica 0 failed while copying K/V out: RuntimeError: no K/V (tests/fake_replica.py:")
    fates = {rid: tuple(fate) for rid, fate in out["fates"].items()}
    failed, not_arrived = (FinishReason.ERROR.value, error), (FinishReason.NOT_ARRIVED.value, None)
    assert fates["5"] == not_arrived
    assert set(fates.values()) <= {failed, not_arrived}, fates
    assert failed in fates.values() and out["interrupted"]


if __name__ == "__main__":
    print(json.dumps(_scenario()))
