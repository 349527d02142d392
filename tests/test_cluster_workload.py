"""workload=shared_prefix by hand, and what prefix-aware routing does with it."""

import dataclasses

import numpy as np
import pytest

from cbjax.cluster import ClusterSim
from cbjax.config import CacheConfig, ClusterConfig, RunConfig, SchedulerConfig, WorkloadConfig
from cbjax.config.workload import LengthConfig, SharedPrefixConfig
from cbjax.app.run import build_executor
from cbjax.workload import build_workload
from cbjax.workload.shared_prefix import zipf_weights


def workload(num=400, groups=4, prefix=48, s=1.0, **kw):
    return WorkloadConfig(
        name="shared_prefix", num_requests=num, arrival="poisson", rate=50.0,
        prompt_len=LengthConfig(dist="uniform", low=3, high=9), output_len=LengthConfig(dist="fixed", value=4),
        shared_prefix=SharedPrefixConfig(num_groups=groups, prefix_len=prefix, zipf_s=s), **kw,
    )  # fmt: skip


def test_every_prompt_is_its_groups_prefix_then_its_own_suffix():
    reqs = build_workload(workload(), seed=1)
    heads = {tuple(r.prompt_token_ids[:48]) for r in reqs}
    assert len(heads) == 4  # four groups, each prefix shared verbatim
    for r in reqs:
        assert r.prompt_len == len(r.prompt_token_ids) and 48 + 3 <= r.prompt_len <= 48 + 9
        assert r.target_output_len == 4 and all(0 <= t < 512 for t in r.prompt_token_ids)
    suffixes = [tuple(r.prompt_token_ids[48:]) for r in reqs]
    assert len(set(suffixes)) > 390  # suffixes are the requests' own
    again = build_workload(workload(), seed=1)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    assert [r.prompt_token_ids for r in build_workload(workload(), seed=2)] != [r.prompt_token_ids for r in reqs]


def test_group_popularity_follows_zipf():
    assert np.allclose(zipf_weights(4, 1.0), np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12))
    assert np.allclose(zipf_weights(3, 0.0), [1 / 3] * 3)
    reqs = build_workload(workload(num=12000, groups=4, prefix=2, s=1.0), seed=0)
    # group identity from the prefix; order groups by popularity
    counts = sorted(np.unique([tuple(r.prompt_token_ids[:2]) for r in reqs], axis=0, return_counts=True)[1])[::-1]
    assert np.allclose(np.array(counts) / 12000, [0.48, 0.24, 0.16, 0.12], atol=0.015)


def test_shared_prefix_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"workload\.shared_prefix\.num_groups must be >= 1"):
        SharedPrefixConfig(num_groups=0)
    with pytest.raises(ValueError, match=r"workload\.shared_prefix\.zipf_s must be >= 0"):
        SharedPrefixConfig(zipf_s=-1.0)
    with pytest.raises(ValueError, match=r"workload\.name: unknown value 'shared'"):
        WorkloadConfig(name="shared")


def run(router, wl):
    cfg = RunConfig(
        cluster=ClusterConfig(replicas=4, router=router),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048),
        cache=CacheConfig(num_pages=120, prefix_caching=True),  # room for 1/2 the prefixes
        workload=wl,
        progress=False,
    )
    cluster = ClusterSim(cfg, build_executor)
    result = cluster.serve(build_workload(cfg.workload, cfg.seed))
    homes = {}  # prefix -> the replicas its requests went to
    for req in result.requests:
        homes.setdefault(tuple(req.prompt_token_ids[:160]), set()).add(cluster.row_extras(req)["replica"])
    return result.extra["prefix_cache_hit_rate"], sorted(len(h) for h in homes.values())


def test_prefix_affinity_keeps_groups_together_and_hits_more_than_round_robin():
    # 16 prefixes of 10 pages; each replica's 119 pages hold at most 11 of them
    wl = dataclasses.replace(workload(num=300, groups=16, prefix=160, s=0.0), rate=20.0)
    rr_hit, rr_homes = run("round_robin", wl)
    pa_hit, pa_homes = run("prefix_affinity", wl)
    assert rr_homes == [4] * 16  # round robin spreads every prefix over every replica
    assert np.mean(pa_homes) <= 1.5 and max(pa_homes) <= 2
    assert pa_hit > rr_hit + 0.2
