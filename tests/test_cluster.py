"""The simulated cluster: one replica stays off the cluster path, replicas overlap in time
exactly (each equals a lone replica serving what was routed to it), prefill/decode
disaggregation by hand, per-pool hardware, outputs, and config errors naming the key."""

import dataclasses
import gc
import json

import pytest
import yaml

from conftest import REPO, make_requests
from cbjax.cluster import ClusterSim
from cbjax.cluster.engine import ClusterEngine
from cbjax.config import (
    CacheConfig, ClusterConfig, ExecutorConfig, ModelConfig, RunConfig, SchedulerConfig, WorkloadConfig,
)  # fmt: skip
from cbjax.engine.offline import serve
from cbjax.core.stop import StopFlag
from cbjax.core.plan import StepOutput
from cbjax.core.request import FinishReason, Status
from cbjax.app.config_merge import from_dict
from cbjax.app.run import build_executor, run_single
from cbjax.scheduler.core import Scheduler
from cbjax.core.timing import NO_CONTEXT, StepTime
from cbjax.sim import SimExecutor
from cbjax.sim.cost import UnitCost
from cbjax.workload import build_workload


def length_only(*args, **kwargs):
    reqs = make_requests(*args, **kwargs)
    for i, r in enumerate(reqs):
        r.synthetic_prompt = (i, 512)
    return reqs


def config(**cluster):
    return RunConfig(
        cluster=ClusterConfig(**cluster),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024),
        cache=CacheConfig(num_pages=256),
        workload=WorkloadConfig(num_requests=60, arrival="poisson", rate=100.0),
        progress=False,
    )


class Recording(SimExecutor):
    """A unit-cost simulator that keeps every plan it ran."""

    def __init__(self):
        super().__init__(UnitCost())
        self.plans = []

    def execute(self, plan):
        self.plans.append(plan)
        return StepOutput(token_ids=None)


def test_one_replica_never_enters_the_cluster_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("cluster path taken with cluster.replicas=1")

    monkeypatch.setattr(ClusterSim, "__init__", refuse)
    summary = run_single(config(), verbose=False)
    assert "replicas" not in summary and summary["num_finished"] == 60


def test_two_replicas_overlap_in_time_by_hand():
    # unit cost: prefill at [a, a+1) yields token 1, each decode one more, one iteration each
    cluster = ClusterSim(config(replicas=2), lambda c: SimExecutor(UnitCost()))
    reqs = length_only([3, 3, 2], arrivals=[0.0, 0.5, 1.0])
    result = cluster.serve(reqs)
    assert [cluster.row_extras(r)["replica"] for r in reqs] == [0, 1, 0]
    # 0 on replica 0: [0,1) [1,2) [2,3). 1 on idle replica 1 starts at its arrival: ends 3.5.
    # 2 arrives at 1.0, joins replica 0's iteration starting at 1: [1,2) prefill, [2,3) decode
    assert [r.first_token_s for r in reqs] == [1.0, 1.5, 2.0]
    assert [r.finish_s for r in reqs] == [3.0, 3.5, 3.0]
    assert result.makespan_s == 3.5 and result.stats.iterations == 3 + 3
    assert gc.isenabled()  # paused during the loop only


@pytest.mark.parametrize("cost_model", ["unit", "roofline"])
def test_each_replica_equals_a_lone_replica_serving_its_requests(cost_model):
    cfg = dataclasses.replace(config(replicas=3), executor=ExecutorConfig(cost_model=cost_model))
    cluster = ClusterSim(cfg, build_executor)
    reqs = build_workload(cfg.workload, cfg.seed)
    result = cluster.serve(reqs)
    assert result.makespan_s == max(r.finish_s for r in reqs)
    for i in range(3):
        mine = [r.request_id for r in reqs if cluster.row_extras(r)["replica"] == i]
        alone = [r for r in build_workload(cfg.workload, cfg.seed) if r.request_id in mine]
        sched = Scheduler(cfg.scheduler, cfg.cache, cfg.model.max_model_len)
        serve(alone, sched, build_executor(cfg))
        got = {r.request_id: (r.first_token_s, r.finish_s) for r in reqs if r.request_id in mine}
        assert got == {r.request_id: (r.first_token_s, r.finish_s) for r in alone}


def test_disaggregated_request_prefills_transfers_and_decodes_by_hand():
    # tiny model: 2 layers x 2 KV heads x 16 dims x K,V x 4 bytes = 512 bytes per token; a
    # 4-token prompt moves 2048 bytes = 16384 bits: 1 s at 16384 bit/s, plus 0.5 s latency
    cfg = config(prefill_replicas=1, decode_replicas=2, kv_link_gbps=16384e-9, kv_link_latency_s=0.5)
    executors = []
    cluster = ClusterSim(cfg, lambda c: executors.append(Recording()) or executors[-1])
    (req,) = length_only([3], prompt_lens=[4])
    result = cluster.serve([req])
    # prefill [0,1) -> token 1; KV arrives at 2.5; decodes [2.5,3.5) [3.5,4.5) -> tokens 2, 3
    assert (req.first_token_s, req.finish_s, req.finish_reason) == (1.0, 4.5, FinishReason.LENGTH)
    assert req.num_generated == 3 and result.tbt_s == [3.5 - 1.0, 1.0]  # the transfer sits in the first gap
    assert cluster.row_extras(req) == {"prefill_replica": 0, "decode_replica": 1, "kv_transfer_s": 1.5}
    prefill, decode, idle = executors
    assert [p.num_batched_tokens for p in prefill.plans] == [4] and not idle.plans
    first = decode.plans[0]
    assert first.swap_in and first.swap_in[0][0] == "0" and len(first.swap_in[0][1]) == 1  # its one page
    assert first.scheduled[0].num_computed == 4 and first.scheduled[0].num_new_tokens == 1
    fields = cluster.summary_fields(result)
    assert fields["kv_transfers"] == 1 and fields["kv_transferred_bytes"] == 2048
    assert [r["requests"] for r in fields["replicas"]] == [1, 1, 0]


def test_a_one_token_request_ends_at_its_prefill_without_a_transfer():
    cluster = ClusterSim(config(prefill_replicas=1, decode_replicas=1), lambda c: SimExecutor(UnitCost()))
    (req,) = length_only([1], prompt_lens=[4])
    cluster.serve([req])
    assert (req.finish_s, req.finish_reason, req.num_generated) == (1.0, FinishReason.LENGTH, 1)
    assert cluster.row_extras(req) == {"prefill_replica": 0, "decode_replica": None, "kv_transfer_s": None}


def test_a_request_no_decode_replica_can_hold_is_rejected_on_arrival(tmp_path):
    # Llama-3-8B's 16 GB of weights on an H100 that has 18.2 GB: a decode pool of 151 pages
    hw = tmp_path / "small_h100.yaml"
    hw.write_text((REPO / "configs" / "hardware" / "h100_sxm.yaml").read_text().replace("name: h100_sxm", "name: small")
                  + "mem_bytes: 18.2e9\n")  # fmt: skip
    cfg = dataclasses.replace(
        config(prefill_replicas=1, decode_replicas=1, decode_hardware=str(hw)),
        cache=CacheConfig(num_pages="auto"), scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096),
        model=from_dict(ModelConfig, yaml.safe_load((REPO / "configs" / "model" / "llama3_8b.yaml").read_text())),
    )  # fmt: skip
    executors = []
    cluster = ClusterSim(cfg, lambda c: executors.append(Recording()) or executors[-1])
    pre, dec = cluster.replicas
    assert dec.scheduler.allocator.num_usable_pages < 188 < pre.scheduler.allocator.num_usable_pages
    short, long, one = length_only([3, 3, 1], prompt_lens=[4, 3000, 3000])  # 3000 + 3 tokens: 188 pages
    result = cluster.serve([short, long, one])
    assert long.finish_reason is FinishReason.REJECTED and long.first_token_s is None
    assert long.reject_reason.startswith("needs 188 KV pages") and long.finish_s == long.arrival_s
    assert cluster.row_extras(long) == {"prefill_replica": 0, "decode_replica": None, "kv_transfer_s": None}
    # the one-token request never needs the decode pool: it is served at its prefill
    assert (short.finish_reason, one.finish_reason) == (FinishReason.LENGTH, FinishReason.LENGTH)
    assert sorted(e.request_id for p in executors[0].plans for e in p.scheduled) == ["0", "2"]  # "1" never ran
    assert cluster.summary_fields(result)["kv_transfers"] == 1


def test_disaggregation_rejects_the_lengths_a_lone_replica_rejects():
    # the prefill copy's one-token cap must not make a request with no tokens to give valid
    cluster = ClusterSim(config(prefill_replicas=1, decode_replicas=1), lambda c: SimExecutor(UnitCost()))
    no_tokens, no_output, ok = length_only([3, 0, 3], prompt_lens=[4, 4, 4])
    no_tokens.sampling = dataclasses.replace(no_tokens.sampling, max_tokens=0)
    no_output.sampling = dataclasses.replace(no_output.sampling, max_tokens=16)
    cluster.serve([no_tokens, no_output, ok])
    assert (no_tokens.finish_reason, no_tokens.reject_reason) == (FinishReason.REJECTED, "max_tokens must be >= 1, got 0")
    assert (no_output.finish_reason, no_output.reject_reason) == (FinishReason.REJECTED, "output_len must be >= 1, got 0")
    assert no_tokens.num_generated == no_output.num_generated == 0 and no_output.finish_s == no_output.arrival_s
    assert cluster.row_extras(no_output) == {"prefill_replica": 0, "decode_replica": None, "kv_transfer_s": None}
    assert (ok.finish_reason, ok.num_generated) == (FinishReason.LENGTH, 3)


def test_add_transferred_queues_a_swapped_request_holding_its_pages():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), CacheConfig(num_pages=16, page_size=4), 128)
    (req,) = length_only([5], prompt_lens=[9])
    req.num_computed, req.num_generated = 9, 1
    with pytest.raises(ValueError, match="request 0 has 9 computed tokens \\(3 pages\\), got 2 pages"):
        sched.add_transferred(req, 0.0, 2)
    sched.add_transferred(req, 0.0, 3)
    assert req.status is Status.WAITING and sched.swap_used == 3
    plan = sched.schedule(0.0)
    (entry,) = plan.scheduled
    assert (entry.num_computed, entry.num_new_tokens) == (9, 1)
    assert plan.swap_in == [("0", tuple(sched.allocator.page_tables["0"][:3]))] and sched.swap_used == 0


def test_each_pool_takes_its_own_hardware_and_tensor_size():
    cfg = dataclasses.replace(
        config(prefill_replicas=1, decode_replicas=1, prefill_hardware="h100_sxm", decode_hardware="a100_40gb",
               decode_tensor=2),
        cache=CacheConfig(num_pages="auto"),
    )  # fmt: skip
    cluster = ClusterSim(cfg, build_executor)
    pre, dec = cluster.replicas
    assert (pre.cfg.hardware.name, pre.cfg.hardware.num_devices) == ("h100_sxm", 1)
    assert (dec.cfg.hardware.name, dec.cfg.hardware.num_devices, dec.cfg.executor.mesh.tensor) == ("a100_40gb", 2, 2)
    # auto pools: 80 GB x 1 device against 40 GiB x 2 devices, less the same weights
    assert dec.scheduler.allocator.num_usable_pages > pre.scheduler.allocator.num_usable_pages
    assert pre.executor.cost_model.flops_per_s > dec.executor.cost_model.flops_per_s / 2


def test_a_pool_naming_its_hardware_keeps_the_runs_tensor_size_unless_it_sets_its_own():
    cfg = config(prefill_replicas=1, decode_replicas=1, decode_hardware="h100_sxm")
    cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, num_devices=2))
    pre, dec = ClusterSim(cfg, build_executor).replicas
    assert (pre.cfg.hardware.num_devices, dec.cfg.hardware.name, dec.cfg.hardware.num_devices) == (2, "h100_sxm", 2)
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, decode_tensor=4))
    assert ClusterSim(cfg, build_executor).replicas[1].cfg.hardware.num_devices == 4


def test_cluster_run_writes_rows_and_the_replicas_list(tmp_path):
    summary = run_single(config(replicas=2, router="least_loaded"), tmp_path, verbose=False)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 60 and {row["replica"] for row in rows} == {0, 1}
    assert all(row["kv_transfer_s"] == 0.0 for row in rows)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert [r["requests"] for r in on_disk["replicas"]] == [sum(row["replica"] == i for row in rows) for i in (0, 1)]
    assert sum(r["iterations"] for r in summary["replicas"]) == summary["iterations"]
    assert summary["num_finished"] == 60 and 0 < summary["replicas"][0]["utilization"] <= 1


def test_a_cluster_summary_gives_the_pool_size_auto_resolved_to_as_a_lone_run_does():
    cfg = dataclasses.replace(
        config(replicas=2), cache=CacheConfig(num_pages="auto"), workload=WorkloadConfig(num_requests=4),
        model=from_dict(ModelConfig, yaml.safe_load((REPO / "configs" / "model" / "llama3_8b.yaml").read_text())),
    )  # fmt: skip
    lone = run_single(dataclasses.replace(cfg, cluster=ClusterConfig()), verbose=False)
    cluster = run_single(cfg, verbose=False)
    assert isinstance(lone["num_pages"], int) and lone["num_pages"] > 1000
    assert cluster["num_pages"] == lone["num_pages"] == cluster["replicas"][0]["num_pages"]


def test_a_stopped_cluster_gives_every_request_a_fate():
    stop = StopFlag()
    cfg = config(prefill_replicas=1, decode_replicas=1)
    calls = []

    class Stopping(UnitCost):
        """1 ms a step (the 60 arrivals span about 0.6 s); the run is told to stop at the 10th."""

        def __call__(self, plan, ctx=NO_CONTEXT):
            calls.append(1)
            if len(calls) == 10:
                stop.set()
            return StepTime(0.001)

    cluster = ClusterSim(cfg, lambda rcfg: SimExecutor(Stopping()))
    reqs = build_workload(cfg.workload, cfg.seed)
    result = cluster.serve(reqs, stop=stop)
    assert result.interrupted and len(calls) >= 10
    fates = {r.finish_reason for r in reqs}
    assert all(r.is_finished for r in reqs) and FinishReason.NOT_ARRIVED in fates and FinishReason.ABORTED in fates


def test_cluster_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"cluster\.prefill_replicas and cluster\.decode_replicas: set both"):
        ClusterConfig(prefill_replicas=2)
    with pytest.raises(ValueError, match=r"cluster\.replicas must be 1 or prefill_replicas \+ decode_replicas \(3\)"):
        ClusterConfig(replicas=2, prefill_replicas=1, decode_replicas=2)
    with pytest.raises(ValueError, match=r"cluster\.decode_tensor applies only with"):
        ClusterConfig(replicas=2, decode_tensor=2)
    with pytest.raises(ValueError, match=r"cluster\.kv_link_gbps must be > 0"):
        ClusterConfig(kv_link_gbps=0)
    with pytest.raises(ValueError, match=r"cluster\.backend: unknown value 'mpi'; choose one of processes, inline, ray"):
        ClusterConfig(backend="mpi")
    for backend in ("inline", "ray"):  # no replica process of its own to pin
        with pytest.raises(ValueError, match=rf"cluster\.pin_replicas applies only with cluster\.backend=processes.*{backend}"):
            ClusterConfig(replicas=2, backend=backend, pin_replicas=True)
    assert ClusterConfig(replicas=2, pin_replicas=True).pin_replicas
    with pytest.raises(ValueError, match=r"cluster\.backend=ray: Ray actors hold engine replicas \(executor=jax\)"):
        ClusterSim(config(replicas=2, backend="ray"), build_executor)
    assert ClusterConfig().backend == "processes"  # the simulator takes the default, and inline
    for backend in ("processes", "inline"):
        ClusterSim(config(replicas=2, backend=backend), build_executor)
    with pytest.raises(ValueError, match=r"cluster\.decode_hardware: unknown hardware 'b300'"):
        ClusterSim(config(prefill_replicas=1, decode_replicas=1, decode_hardware="b300"), build_executor)
    with pytest.raises(ValueError, match=r"executor\.name=jax: ClusterSim runs the simulator \(executor=sim\)"):
        ClusterSim(dataclasses.replace(config(replicas=2), executor=ExecutorConfig(name="jax")), build_executor)
    with pytest.raises(ValueError, match=r"executor\.name=sim: ClusterEngine runs the engine"):
        ClusterEngine(config(replicas=2), build_executor)


def test_the_cluster_is_host_side_and_below_the_run_layer():
    from test_layering import import_graph

    for mod, deps in import_graph().items():
        if mod.startswith("cbjax.cluster"):
            bad = {d for d in deps if d.startswith(("cbjax.runtime", "cbjax.kernels", "cbjax.model", "cbjax.app.run"))}
            bad |= deps & {"cbjax.app.cli", "cbjax.app.hydra_job", "cbjax.app.sweep"}
            assert not bad, f"{mod} imports {sorted(bad)}"


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_disaggregated_requests_survive_preemption_on_a_crowded_decode_replica(preemption):
    cfg = dataclasses.replace(
        config(prefill_replicas=1, decode_replicas=1),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, preemption=preemption),
        cache=CacheConfig(num_pages=48),
        workload=WorkloadConfig(num_requests=40, arrival="poisson", rate=400.0),
    )
    cluster = ClusterSim(cfg, build_executor)
    reqs = build_workload(cfg.workload, cfg.seed)
    result = cluster.serve(reqs)
    decode = cluster.summary_fields(result)["replicas"][1]
    assert decode["preemptions"] > 0
    assert (result.extra["swap_preemptions"] > 0) == (preemption == "swap")
    served = [r for r in reqs if r.finish_reason is not FinishReason.REJECTED]
    assert served and all(r.num_generated == r.target_output_len for r in served)
    assert all(r.first_token_s <= r.finish_s for r in served)
