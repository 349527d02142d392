"""What others see of the host KV tier: the router's two-tier prefix index and prefix_affinity's
lower weight for host pages, /metrics, summary.json's bytes, and the profiled model's copies."""

from __future__ import annotations

import pytest

from cbjax.cluster import PrefixIndex, ReplicaSnapshot, RouteRequest, make_router
from cbjax.config import CacheConfig, ExecutorConfig, RunConfig, SchedulerConfig, WorkloadConfig
from cbjax.core.plan import HostCopies, Schedule
from cbjax.core.results import LoadCounts

def test_the_prefix_index_moves_what_the_device_pushes_out_to_the_host_tier():
    index = PrefixIndex(capacity_pages=2, host_capacity_pages=2)
    index.insert((1, 2, 3))  # 1 is pushed out to the host tier
    assert index.match_tiers((1, 2, 3, 4)) == (2, 1) and index.match((1, 2, 3)) == 3 and len(index) == 3
    index.insert((7, 8))  # 2 and 3 go to the host, which drops 1, its least recent
    assert index.match_tiers((2, 3)) == (0, 2) and index.match((1,)) == 0 and len(index) == 4
    index.insert((2,))  # back on the device; 7 takes its place in the host tier
    assert index.match_tiers((2, 7)) == (1, 1)
    flat = PrefixIndex(capacity_pages=2)  # without a host tier, pushed-out pages are forgotten
    flat.insert((1, 2, 3))
    assert flat.match_tiers((1, 2, 3)) == (0, 0) and flat.match((2, 3)) == 2

def test_prefix_affinity_counts_a_host_page_at_its_weight():
    req = RouteRequest("r", prompt_len=64, page_hashes=(11, 12, 13, 14))
    device = ReplicaSnapshot(cached=frozenset({11, 12}))  # 2 device pages
    host = ReplicaSnapshot(host_cached=frozenset({11, 12, 13}))  # 3 host pages: 1.5 at the default weight
    assert make_router("prefix_affinity").route(req, [host, device]) == 1
    assert make_router("prefix_affinity", {"host_weight": 1.0}).route(req, [host, device]) == 0
    assert make_router("prefix_affinity", {"host_weight": 0.75}).route(req, [host, device]) == 0  # 2.25 > 2
    with pytest.raises(ValueError, match=r"cluster\.router_args\.host_weight"):
        make_router("prefix_affinity", {"host_weight": 2.0})

class Counts:
    def __init__(self, counts):
        self._counts = counts

    def counts(self):
        return self._counts

def test_metrics_show_the_host_tier_only_where_there_is_one():
    from cbjax.serve.metrics import ServerMetrics

    with_tier = LoadCounts(1, 2, 3, 10, 0, host_pages_used=5, host_pages_total=8, host_hit_tokens=40,
                           host_pages_stored=7, host_pages_loaded=3)  # fmt: skip
    text = ServerMetrics(Counts(with_tier), "m", page_bytes=2048).render().decode()
    assert 'cbjax:kv_host_pages_used{model_name="m"} 5.0' in text
    assert 'cbjax:kv_host_hits_total{model_name="m"} 40.0' in text
    assert 'cbjax:kv_host_bytes_total{direction="stored",model_name="m"} 14336.0' in text
    assert 'cbjax:kv_host_bytes_total{direction="loaded",model_name="m"} 6144.0' in text
    plain = ServerMetrics(Counts(LoadCounts(1, 2, 3, 10, 0)), "m").render().decode()
    assert "kv_host" not in plain and "cbjax:kv_cache_pages_used" in plain

def test_summary_json_gives_the_bytes_moved_each_way(tmp_path):
    from cbjax.app.run import run_single

    from cbjax.config import LengthConfig
    from cbjax.config.workload import SharedPrefixConfig

    # 8 system prompts of 32 tokens, each request its own 4 to 12 more, over 31 device pages:
    # the prefixes outgrow the device pool and come back from the host tier
    workload = WorkloadConfig(
        name="shared_prefix", num_requests=60, arrival="poisson", rate=20.0,
        prompt_len=LengthConfig(dist="uniform", low=4, high=12), output_len=LengthConfig(dist="uniform", low=1, high=8),
        shared_prefix=SharedPrefixConfig(num_groups=8, prefix_len=32, zipf_s=0.0),
    )  # fmt: skip
    cfg = RunConfig(
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256),
        cache=CacheConfig(num_pages=32, page_size=4, host_pages=64),
        executor=ExecutorConfig(name="sim", cost_model="roofline"),
        workload=workload,
        progress=False,
    )  # fmt: skip
    summary = run_single(cfg, tmp_path, verbose=False)
    page_bytes = 4 * cfg.model.kv_bytes_per_token
    assert summary["kv_host_pages_stored"] > 0 and summary["prefix_hit_tokens_host"] > 0
    assert summary["kv_host_bytes_stored"] == summary["kv_host_pages_stored"] * page_bytes
    assert summary["kv_host_bytes_loaded"] == summary["kv_host_pages_loaded"] * page_bytes > 0
    rows = (tmp_path / "requests.jsonl").read_text()
    assert '"prefix_hit_tokens_host"' in rows and '"kv_load_s"' in rows

def profiled(**terms):
    from cbjax.layout.shapes import plan_shapes
    from cbjax.sim.profiled import STEP_TERMS, ProfiledCost

    coef = {**dict.fromkeys(STEP_TERMS + ("loop_s", "loop_seq_s"), 0.0), "bucket_s": {4: 0.0}, "bucket_scale": 1.0,
            "swap_iter_s": 1.0, "swap_page_s": 10.0, **terms}  # fmt: skip
    return ProfiledCost(coef, plan_shapes(4, 128, 4, 64, [4, 16, 64]))

def tier_plan():
    plan = Schedule(4, page_size=4)
    plan.host_copies = HostCopies(((1, 0), (2, 1)), (("r", (3,), (4,)),), (("w", (5, 6), (7, 8)),))
    return plan

def test_the_profiled_model_prices_tier_copies_with_each_directions_fit():
    cost = profiled(swap_out_iter_s=2.0, swap_out_page_s=20.0, swap_in_iter_s=3.0, swap_in_page_s=30.0)
    t = cost(tier_plan())
    assert (t.copy_s, t.load_s, t.prefetch_s) == (42.0 + 33.0, 33.0, 63.0)
    assert t.total_s == t.device_s + t.host_s + 75.0

def test_the_profiled_model_falls_back_to_the_swap_terms():
    t = profiled()(tier_plan())  # a profile made before the direction terms
    assert (t.copy_s, t.load_s, t.prefetch_s) == (21.0 + 11.0, 11.0, 21.0)

def test_the_profile_fits_each_copy_direction_on_its_own():
    from cbjax.profile.measure import fit_swaps

    swaps = [{"direction": d, "pages": n, "measured_s": fixed + per * n}
             for d, fixed, per in (("out", 1e-3, 2e-4), ("in", 3e-3, 1e-4)) for n in (1, 8, 64)]  # fmt: skip
    fitted = fit_swaps(swaps)
    assert fitted["swap_out_iter_s"] == pytest.approx(1e-3) and fitted["swap_out_page_s"] == pytest.approx(2e-4)
    assert fitted["swap_in_iter_s"] == pytest.approx(3e-3) and fitted["swap_in_page_s"] == pytest.approx(1e-4)
    assert 1e-3 < fitted["swap_iter_s"] < 3e-3  # the shared fit lies between the two
    assert fit_swaps([]) == dict.fromkeys(fitted, 0.0)
