"""The contracts are typed protocols, and the engine runs through them alone: the serving loop
and the scheduler reach the executor, the policy and the scheduler's view only by the
members their protocols declare."""

from __future__ import annotations

import dataclasses
import typing

from test_engine import BUDGET, MODEL, fresh, make_executor, workload
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.engine.offline import serve
from cbjax.core.executor import Executor
from cbjax.scheduler import Scheduler
from cbjax.scheduler.policy import FCFSPolicy, PolicyContract, SchedulerView


def members(protocol) -> set[str]:
    names = set(typing.get_type_hints(protocol))
    for klass in protocol.__mro__:
        if klass is typing.Protocol or klass is typing.Generic or klass is object:
            continue
        names |= {n for n in vars(klass) if not n.startswith("_") or n in ("__len__", "__iter__")}
    return names - {"_is_protocol", "_is_runtime_protocol"}


class Strict:
    """Forwards only `protocol`'s members to `inner`; any other attribute fails loudly, and is
    recorded in `seen` as ("refused", name), so a probe that swallows the error (`getattr` with
    a default, `hasattr`) shows too. Calls the view as a policy makes it pass through the same
    check."""

    def __init__(self, inner, protocol, seen: set):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_allowed", members(protocol))
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name):
        if name not in self._allowed:
            self._seen.add(("refused", name))
            raise AttributeError(f"{name!r} is outside the contract")
        self._seen.add(name)
        value = getattr(self._inner, name)
        if callable(value):
            def call(*args, **kwargs):
                args = [Strict(a, SchedulerView, self._seen) if type(a).__name__ == "_View" else a for a in args]
                return value(*args, **kwargs)

            return call
        return value

    def __setattr__(self, name, value):
        if name not in self._allowed:
            raise AttributeError(f"setting {name!r} is outside the contract")
        setattr(self._inner, name, value)

    def __len__(self):
        self._seen.add("__len__")
        return len(self._inner)

    def __iter__(self):
        self._seen.add("__iter__")
        return iter(self._inner)


def test_strict_proxy_refuses_what_the_protocol_does_not_declare():
    import pytest

    seen: set = set()
    ex = Strict(object(), Executor, seen)
    with pytest.raises(AttributeError, match="'packer' is outside the contract"):
        ex.packer  # noqa: B018
    assert getattr(ex, "remote", False) is False and ("refused", "remote") in seen  # a quiet probe shows


def test_the_engine_serves_through_the_executor_and_policy_protocols_alone():
    reqs = workload(6, wseed=11, max_prompt=20, max_out=8)
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=BUDGET)
    cache = CacheConfig(num_pages=64, page_size=4)

    def run(strict: bool):
        ex = make_executor(3, num_pages=64)
        assert isinstance(ex, Executor)
        seen: set = set()
        policy = FCFSPolicy(cfg)
        executor = Strict(ex, Executor, seen) if strict else ex
        sched = Scheduler(cfg, cache, MODEL.max_model_len, policy=Strict(policy, PolicyContract, seen) if strict else policy,
                          validate=executor.validate, vocab_size=MODEL.vocab_size)  # fmt: skip
        executor.warmup()
        result = serve([fresh(r) for r in reqs], sched, executor)
        executor.close()
        return {r.request_id: r.output_token_ids for r in result.requests}, seen

    direct, _ = run(False)
    strict, seen = run(True)
    assert strict == direct and all(len(t) == r.sampling.max_tokens for r, t in zip(reqs, direct.values()))
    # the pipelined path ran, and the policy was consulted through its contract
    assert {"launch", "collect", "push", "pop", "on_step"} <= seen
    assert not [name for name in seen if isinstance(name, tuple)], seen  # nothing outside the contracts asked for


def test_the_simulator_and_its_cluster_run_through_the_executor_protocol_alone(tmp_path):
    from test_purity import small_run

    from cbjax.app.run import run_single
    from cbjax.cluster import ClusterSim
    from cbjax.config import ClusterConfig, ExecutorConfig
    from cbjax.sim import SimExecutor, make_cost_model
    from cbjax.workload import build_workload

    cfg = small_run(executor=ExecutorConfig(name="sim", cost_model="roofline"))
    seen: set = set()
    for pipelined in (False, True):
        def strict_sim(rcfg, pipelined=pipelined):
            cost = make_cost_model("roofline", rcfg.model, rcfg.hardware)
            return Strict(SimExecutor(cost, pipelined=pipelined), Executor, seen)

        direct = run_single(cfg, verbose=False)
        sched = Scheduler(cfg.scheduler, cfg.cache, cfg.model.max_model_len)
        ex = strict_sim(cfg)
        result = serve(build_workload(cfg.workload, cfg.seed), sched, ex)
        assert all(r.is_finished for r in result.requests)
        if not pipelined:
            assert result.makespan_s == direct["makespan_s"]
        for cluster in (ClusterConfig(replicas=2), ClusterConfig(prefill_replicas=1, decode_replicas=1)):
            ccfg = dataclasses.replace(cfg, cluster=cluster)
            out = ClusterSim(ccfg, strict_sim).serve(build_workload(ccfg.workload, ccfg.seed))
            assert all(r.is_finished for r in out.requests)
    assert {"timeline", "execute", "validate", "pipelined"} <= seen


def test_no_code_probes_an_executor_outside_its_own_package():
    # the executor protocol declares every member a caller uses: nothing outside the executors'
    # packages (the engine's runtime/, the simulator's sim/) asks an executor what it has
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "cbjax"
    probe = re.compile(r"\b(getattr|hasattr)\(\s*[\w.]*(executor|inner|ex)\b")
    found = []
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] in ("runtime", "sim"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if probe.search(line):
                found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
