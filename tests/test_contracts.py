"""The contracts are typed protocols, and the engine runs through them alone: the serving loop
and the scheduler reach the executor, the policy and the scheduler's view only by the
members their protocols declare."""

from __future__ import annotations

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
