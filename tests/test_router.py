"""Routers by hand: each built-in's choice on snapshots worked out on paper, their config
errors, and a user's router loaded from its own directory."""

import textwrap

import pytest

from cbjax.cluster import PrefixIndex, ReplicaSnapshot, RouteRequest, Router, make_router
from cbjax.cluster.router import RoundRobin
from cbjax.app.choices import check_choices
from cbjax.config import ClusterConfig, RunConfig

REQ = RouteRequest("r", prompt_len=64, page_hashes=(11, 12, 13, 14))


def snaps(*loads, free=None, cached=None):
    free = free or [100] * len(loads)
    cached = cached or [()] * len(loads)
    return [
        ReplicaSnapshot(num_waiting=w, num_running=r, num_free_pages=f, num_usable_pages=100, cached=frozenset(c))
        for (w, r), f, c in zip(loads, free, cached)
    ]


def test_round_robin_cycles_whatever_the_load():
    router = make_router("round_robin")
    replicas = snaps((9, 9), (0, 0), (5, 5))
    assert [router.route(REQ, replicas) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_counts_waiting_plus_running_and_breaks_ties_low():
    router = make_router("least_loaded")
    assert router.route(REQ, snaps((3, 1), (0, 3), (2, 2))) == 1  # 4, 3, 4
    assert router.route(REQ, snaps((1, 1), (2, 0), (0, 2))) == 0  # all 2: the first


def test_least_kv_takes_the_most_free_pages_then_the_least_loaded():
    router = make_router("least_kv")
    assert router.route(REQ, snaps((0, 0), (5, 5), (0, 0), free=[10, 50, 40])) == 1
    assert router.route(REQ, snaps((3, 0), (1, 0), free=[50, 50])) == 1


def test_power_of_two_picks_the_less_loaded_of_two_seeded_draws():
    import random

    replicas = snaps((4, 0), (1, 0), (7, 0), (2, 0))
    router = make_router("power_of_two", {"seed": 3})
    rng = random.Random(3)
    for _ in range(20):
        a, b = rng.sample(range(4), 2)
        want = b if replicas[b].num_waiting < replicas[a].num_waiting else a
        assert router.route(REQ, replicas) == want
    assert make_router("power_of_two").route(REQ, snaps((1, 0))) == 0


def test_prefix_affinity_follows_the_longest_prefix_within_the_load_bound():
    router = make_router("prefix_affinity", {"max_imbalance": 2})
    assert router.uses_prefix
    cached = [(11,), (11, 12, 13), (11, 12)]
    # loads 1, 3, 0: replica 1 holds 3 pages and is 3 - 0 = 3 > 2 ahead: out; replica 2 (2 pages) wins
    assert router.route(REQ, snaps((1, 0), (3, 0), (0, 0), cached=cached)) == 2
    # loads 1, 2, 0: replica 1 is within the bound and holds the most
    assert router.route(REQ, snaps((1, 0), (2, 0), (0, 0), cached=cached)) == 1
    # only a chain's leading pages count: 12 and 13 without 11 match nothing
    assert router.route(REQ, snaps((1, 0), (0, 0), cached=[(12, 13), ()])) == 1
    # no match anywhere: the least loaded (1 and 2), then the smaller index (2 pages, not 3)
    assert router.route(RouteRequest("x", 16, (99,)), snaps((2, 0), (1, 0), (1, 0), cached=cached)) == 2
    # idle replicas and no match: the empty index takes the new prefix
    assert router.route(RouteRequest("y", 16, (98,)), snaps((0, 0), (0, 0), cached=[(5, 6), ()])) == 1


def test_route_decode_defaults_to_the_most_free_pages():
    assert RoundRobin().route_decode(REQ, snaps((0, 0), (0, 0), free=[3, 8])) == 1


def test_prefix_index_matches_leading_pages_and_evicts_the_least_recent():
    index = PrefixIndex(capacity_pages=3)
    index.insert((1, 2))
    index.insert((5,))
    assert index.match((1, 2, 3)) == 2 and index.match((3, 1)) == 0
    index.insert((1, 7))  # 1 becomes most recent, 7 pushes out 2 (the least recent)
    assert len(index) == 3 and index.match((1, 2)) == 1 and index.match((5,)) == 1


def test_bad_router_config_names_the_key():
    with pytest.raises(ValueError, match=r"cluster\.router: unknown value 'fastest'"):
        check_choices(RunConfig(cluster=ClusterConfig(router="fastest")))
    with pytest.raises(ValueError, match=r"cluster\.router must be a built-in router or look like"):
        ClusterConfig(router="not a module:Cls")
    with pytest.raises(ValueError, match=r"cluster\.router_args: PrefixAffinity does not accept"):
        make_router("prefix_affinity", {"max_imbalanse": 1})
    with pytest.raises(ValueError, match=r"cluster\.router: cannot import module 'no_such_mod'"):
        make_router("no_such_mod:Router")
    with pytest.raises(ValueError, match=r"is not a subclass of cbjax.cluster.Router"):
        make_router("cbjax.cluster.router:RouteRequest")


USER_ROUTER = textwrap.dedent(
    """
    from cbjax.cluster import Router


    class MyRoundRobin(Router):
        name = "mine"

        def __init__(self, start=0):
            self._next = start

        def route(self, req, replicas):
            i = self._next % len(replicas)
            self._next = i + 1
            return i
    """
)


def test_a_users_router_from_its_own_directory_gives_round_robins_assignments(tmp_path, monkeypatch):
    from cbjax.cluster import ClusterSim
    from cbjax.config import RunConfig, SchedulerConfig, WorkloadConfig
    from cbjax.app.run import build_executor
    from cbjax.workload import build_workload

    (tmp_path / "my_routers.py").write_text(USER_ROUTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(make_router("my_routers:MyRoundRobin"), Router)

    def assignments(router, router_args=None):
        cfg = RunConfig(
            cluster=ClusterConfig(replicas=3, router=router, router_args=router_args or {}),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512),
            workload=WorkloadConfig(num_requests=40, arrival="poisson", rate=200.0),
            progress=False,
        )
        cluster = ClusterSim(cfg, build_executor)
        requests = build_workload(cfg.workload, cfg.seed)
        cluster.serve(requests)
        return [cluster.row_extras(r)["replica"] for r in requests], [r.finish_s for r in requests]

    mine, theirs = assignments("my_routers:MyRoundRobin"), assignments("round_robin")
    assert mine == theirs
    assert mine[0][:6] == [0, 1, 2, 0, 1, 2]
    # cluster.router_args reach the user's class: starting at replica 1 shifts every assignment
    shifted = assignments("my_routers:MyRoundRobin", {"start": 1})[0]
    assert shifted == [(i + 1) % 3 for i in range(40)]


def test_a_router_returning_no_replica_fails_naming_it(tmp_path, monkeypatch):
    from cbjax.cluster import ClusterSim
    from cbjax.config import RunConfig
    from cbjax.app.run import build_executor
    from cbjax.workload import build_workload

    (tmp_path / "bad_routers.py").write_text(
        "from cbjax.cluster import Router\n\nclass Off(Router):\n    def route(self, req, replicas):\n        return len(replicas)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RunConfig(cluster=ClusterConfig(replicas=2, router="bad_routers:Off"), progress=False)
    cluster = ClusterSim(cfg, build_executor)
    with pytest.raises(ValueError, match=r"cluster\.router: Off\.route returned 2, not a replica in \[0, 2\)"):
        cluster.serve(build_workload(cfg.workload, cfg.seed)[:3])


def test_a_seeded_router_takes_the_runs_seed_unless_its_args_give_one():
    """Seeds 0, 1, 2 of a reproduction draw different replicas, as every other random draw of
    the run does; `router_args.seed` still wins."""
    import random

    from cbjax.cluster import ClusterSim

    replicas = snaps((4, 0), (1, 0), (7, 0), (2, 0))

    def draws(seed):
        rng = random.Random(seed)
        out = []
        for _ in range(20):
            a, b = rng.sample(range(4), 2)
            out.append(b if replicas[b].num_waiting < replicas[a].num_waiting else a)
        return out

    assert draws(5) != draws(0)
    router = make_router("power_of_two", seed=5)
    assert [router.route(REQ, replicas) for _ in range(20)] == draws(5)
    router = make_router("power_of_two", {"seed": 3}, seed=5)
    assert [router.route(REQ, replicas) for _ in range(20)] == draws(3)
    cfg = RunConfig(seed=5, cluster=ClusterConfig(replicas=4, router="power_of_two"))
    from cbjax.sim import SimExecutor
    from cbjax.sim.cost import UnitCost

    router = ClusterSim(cfg, lambda c: SimExecutor(UnitCost())).router
    assert [router.route(REQ, replicas) for _ in range(20)] == draws(5)
