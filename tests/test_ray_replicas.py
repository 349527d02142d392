"""Engine-cluster replicas in Ray actors (`cluster.backend=ray`) on the stand-in executor
(tests/fake_replica.py) and a local Ray (2 CPUs, no dashboard): a failure names the replica
where it happened, as under `cluster.backend=processes` (tests/test_replica_processes.py).
The real engine's Ray runs are in tests/test_cluster_engine.py."""

import functools
import os
from pathlib import Path

import pytest

import fake_replica
from cbjax.cluster.engine import ClusterEngine
from cbjax.core.request import FinishReason

HERE = Path(__file__).resolve().parent
PD = dict(prefill_replicas=1, decode_replicas=1, prefill_tensor=2)


@pytest.mark.slow
def test_a_prefill_actor_failing_to_copy_kv_out_is_the_replica_that_failed(monkeypatch):
    """Its K/V goes to the decode actor through Ray's object store, so the decode actor's
    import is what meets the error first; the failure is still the prefill replica's."""
    ray_actors = pytest.importorskip("cbjax.cluster.ray_actors")
    # the actors unpickle fake_replica.build by reference: Ray's workers inherit this path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    cfg = fake_replica.config("ray", **PD)
    replicas = ray_actors.RayReplicas(functools.partial(fake_replica.build, how="export"), num_cpus=2)
    try:
        engine = ClusterEngine(cfg, replicas)
        result = engine.serve(fake_replica.workload(late=30.0))
    finally:
        replicas.shutdown()
    error = str(engine.failure)
    assert error.startswith("replica 0 failed while copying K/V out: RuntimeError: no K/V (tests/fake_replica.py:")
    fates = {r.request_id: (r.finish_reason, r.error) for r in result.requests}
    assert fates["5"] == (FinishReason.NOT_ARRIVED, None)
    assert set(fates.values()) <= {(FinishReason.ERROR, error), (FinishReason.NOT_ARRIVED, None)}, fates
    assert (FinishReason.ERROR, error) in fates.values() and result.interrupted
