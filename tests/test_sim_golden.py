"""Pinned simulator outputs: small single-replica and cluster runs over the scheduler's paths
(preemption by recompute and swap, chunked prefill, prefix caching, reservations, static
padding, policies, a host-overhead group, routers, prefill/decode pools) must give the
requests.jsonl rows and summary.json fields recorded in tests/golden/sim_runs.json.

The file is written by `python tests/test_sim_golden.py --write`, last for the roofline that
charges a step's matmuls and attention each at its own bound. Tuning the simulator for speed
must change no output, to the last bit of every float. Regenerate it only for a change meant
to alter results, and say so.
"""

import hashlib
import json
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from cbjax.app.cli import CONFIG_DIR, to_run_config
from cbjax.app.run import run_single

GOLDEN = Path(__file__).parent / "golden" / "sim_runs.json"

# Llama-3-8B roofline: iterations in milliseconds, so 200 req/s bursts queue and batch.
BASE = [
    "progress=false",
    "model=llama3_8b",
    "hardware=a100_80gb",
    "cache.prefix_caching=false",  # the cases that share prefixes turn it on
    "executor=sim",
    "executor.cost_model=roofline",
    "workload.num_requests=80",
    "workload.arrival=poisson",
    "workload.rate=200",
    "scheduler.max_num_seqs=16",
    "scheduler.max_num_batched_tokens=1024",
    "cache.num_pages=160",
]
CASES = {
    "fcfs_recompute": [],
    "swap_chunked": ["scheduler.preemption=swap", "scheduler.chunked_prefill=true", "cache.num_swap_pages=64"],
    "prefix_caching": ["workload=shared_prefix", "cache.prefix_caching=true", "cache.num_pages=400"],
    "reserve_pow2": ["cache.allocation=reserve_pow2", "cache.num_pages=400"],
    "static_padding": ["scheduler=static", "scheduler.static_padding=true", "cache.num_pages=800"],
    "priority_vllm_overhead": ["scheduler=priority", "overhead=vllm_0_1"],
    "no_hybrid_sjf": ["scheduler=sjf", "scheduler.hybrid_batching=false"],
    "cluster_least_loaded": ["cluster.replicas=3", "cluster.router=least_loaded"],
    "cluster_prefix_affinity": [
        "cluster.replicas=3",
        "cluster.router=prefix_affinity",
        "workload=shared_prefix",
        "cache.prefix_caching=true",
        "cache.num_pages=400",
    ],
    "cluster_pd": [
        "cluster.prefill_replicas=1",
        "cluster.decode_replicas=2",
        "cluster.kv_link_gbps=10",
        "cluster.kv_link_latency_s=0.001",
    ],
}
# Host wall time: differs run to run.
UNPINNED = {"wall_s", "scheduler_host_s"}
# Left out of the rows to keep the file small: a row's inputs (the workload's, pinned by its
# own tests) and the latencies derived from its pinned times (their percentiles are pinned).
INPUTS = {"arrival_s", "prompt_len", "output_len", "target_output_len", "max_tokens", "priority", "client_id",
          "ttft_s", "tpot_s", "e2e_s", "queue_s"}  # fmt: skip


def outputs(name: str, out_dir: Path) -> dict:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=BASE + CASES[name]))
    summary = run_single(cfg, out_dir, verbose=False)
    rows = [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines()]
    rows.sort(key=lambda r: int(r["request_id"]))
    csv = (out_dir / "client_service.csv").read_bytes()
    return {
        "summary": {k: v for k, v in summary.items() if k not in UNPINNED},
        "requests": [{k: v for k, v in row.items() if k not in INPUTS} for row in rows],
        "client_service_csv_sha256": hashlib.sha256(csv).hexdigest(),
    }


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_simulator_outputs_equal_the_pinned_ones(name, golden, tmp_path):
    got = json.loads(json.dumps(outputs(name, tmp_path)))  # as stored: tuples become lists
    want = golden[name]
    assert got["requests"] == want["requests"]
    assert got["summary"] == want["summary"]
    assert got["client_service_csv_sha256"] == want["client_service_csv_sha256"]


def test_the_cases_exercise_what_they_name(golden):
    # guards against a case that silently stops reaching its path (then it pins nothing)
    s = {name: golden[name]["summary"] for name in CASES}
    assert s["fcfs_recompute"]["preemptions"] > 0
    assert s["swap_chunked"]["swap_preemptions"] > 0
    assert s["prefix_caching"]["prefix_cache_hit_rate"] > 0.3
    assert s["cluster_prefix_affinity"]["prefix_cache_hit_rate"] > 0.3
    assert s["cluster_pd"]["kv_transfers"] > 0 and s["cluster_pd"]["disaggregated"]
    assert [r["requests"] for r in s["cluster_least_loaded"]["replicas"]] != [80, 0, 0]
    for name in CASES:
        assert s[name]["num_finished"] + s[name]["num_rejected"] == 80
        assert s[name]["mean_batch_size"] > 1.5, name  # batches form: the load is real


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        data = {name: outputs(name, Path(tmp) / name) for name in sorted(CASES)}
    GOLDEN.write_text(json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN}")
