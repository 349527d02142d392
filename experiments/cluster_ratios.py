"""The simulator against the engine cluster, by ratios of interleaved pairs of engine runs.

    python experiments/cluster_ratios.py --profile outputs/fidelity/profile_tiny_16/profile.json [--pairs 5]

Two comparisons a policy study reports as ratios, each an A/B pair of 2-replica engine runs
on the same requests, the pairs interleaved (A B, B A, A B, ...) so that a state of the
machine both arms meet cancels out of each pair's ratio:

- routing: `prefix_affinity` against `round_robin`, 2 colocated replicas, `workload=shared_prefix`
  with the prefix cache on;
- disaggregation: 1 prefill + 1 decode replica against 2 colocated replicas.

Each engine replica runs in a process of its own pinned to a core of its own
(`cluster.pin_replicas`), as the lone replica the profile describes (pinned to one core). Per
figure (TTFT p50, throughput) the engine's pairs give a median ratio A / B; the simulator, with
the profile's `profiled` cost model, gives its ratio on the same requests. A comparison passes
when the simulator's ratio lies within 10% of the engine's median for both figures.

Before the comparisons it checks that the machine keeps the two replicas apart: in turns, the
colocated pair serves the requests split over both replicas, and every request on one of them
(`FirstReplica`). Replicas that run as the simulator models them (each on its own hardware)
finish split in about half the time; on a machine where the replicas and the driver share too
few cores the split run is no faster, and then no ratio whose arms load the two replicas
differently (disaggregation) can be measured here.

Prints one table, and writes the runs and the table as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibrate import base_config, read_profile_arg, sim_config  # noqa: E402
from cbjax.app.run import run_single  # noqa: E402
from cbjax.cluster.router import Router  # noqa: E402
from cbjax.config import CacheConfig, ClusterConfig, LengthConfig, RunConfig  # noqa: E402
from cbjax.config.workload import SharedPrefixConfig  # noqa: E402
from cbjax.report.files import unwritable, write_json  # noqa: E402
from cbjax.report.tables import markdown_table  # noqa: E402

FIGURES = (("ttft_s_p50", "TTFT p50"), ("throughput_tok_s", "throughput"))


class FirstReplica(Router):
    """Every request to the first replica: the separation check's lone busy replica."""

    name = "first_replica"

    def route(self, req, replicas) -> int:
        return 0


def separation(colocated: RunConfig, runs: int) -> dict:
    """`runs` interleaved pairs: the colocated pair's makespan with the requests split over both
    replicas, over its makespan with every request on the first (apart: about 0.5)."""
    one = dataclasses.replace(colocated, cluster=dataclasses.replace(colocated.cluster, router="cluster_ratios:FirstReplica"))
    ratios = []
    for i in range(runs):
        order = ((True, colocated), (False, one)) if i % 2 == 0 else ((False, one), (True, colocated))
        spans = {split: run_single(cfg, verbose=False)["makespan_s"] for split, cfg in order}
        ratios.append(spans[True] / spans[False])
    return {"split_over_one_makespan": ratios, "median": statistics.median(ratios) if ratios else None}
TOLERANCE = 0.10  # the simulator's ratio against the engine's median paired ratio


def arms(base: RunConfig) -> dict[str, tuple[RunConfig, RunConfig]]:
    """comparison -> (A, B) engine configs over the same requests."""
    pinned = dict(backend="processes", pin_replicas=True)
    colocated = dataclasses.replace(base, cluster=ClusterConfig(replicas=2, router="round_robin", **pinned))
    shared = dataclasses.replace(
        colocated,
        cache=dataclasses.replace(base.cache, prefix_caching=True),
        workload=dataclasses.replace(
            base.workload, name="shared_prefix",
            shared_prefix=SharedPrefixConfig(num_groups=4, prefix_len=min(128, base.model.max_model_len // 4)),
            prompt_len=LengthConfig(dist="uniform", low=8, high=64),
        ),
    )  # fmt: skip
    affinity = dataclasses.replace(shared, cluster=dataclasses.replace(shared.cluster, router="prefix_affinity"))
    pd = dataclasses.replace(colocated, cluster=ClusterConfig(prefill_replicas=1, decode_replicas=1, **pinned))
    return {"prefix_affinity / round_robin": (affinity, shared), "1 prefill + 1 decode / 2 colocated": (pd, colocated)}


def figures(summary: dict) -> dict[str, float]:
    return {key: summary[key] for key, _ in FIGURES}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="profile.json of a lone replica (python -m cbjax.profile cores=1)")
    ap.add_argument("--pairs", type=int, default=5, help="interleaved A/B pairs per comparison (at least 5)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--separation-runs", type=int, default=3, help="pairs of the separation check (0: skip it)")
    ap.add_argument("--out", default=str(REPO / "outputs" / "cluster_ratios.json"))
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error(f"--pairs must be >= 1, got {args.pairs}")
    if problem := unwritable(Path(args.out).parent):  # found now, not after the runs
        ap.error(f"--out: {problem}")
    profile = read_profile_arg(ap, args.profile)
    base = base_config(profile, args.requests)
    base = dataclasses.replace(base, cache=CacheConfig(page_size=base.cache.page_size, num_pages=base.cache.num_pages))
    report = {"profile": args.profile, "pairs": args.pairs, "comparisons": {}}
    rows = []
    comparisons = arms(base)
    colocated = comparisons["1 prefill + 1 decode / 2 colocated"][1]
    report["separation"] = sep = separation(colocated, args.separation_runs)
    if sep["median"] is not None:
        print(f"separation: the requests split over 2 replicas take {sep['median']:.2f}x the time of all on one "
              f"(median of {args.separation_runs}; replicas kept apart: about 0.5)", flush=True)  # fmt: skip
    for name, (a, b) in comparisons.items():
        sim_a = figures(run_single(sim_config(a, args.profile), verbose=False))
        sim_b = figures(run_single(sim_config(b, args.profile), verbose=False))
        runs = []
        for i in range(args.pairs):
            t0 = time.perf_counter()
            order = (("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))
            pair = {label: figures(run_single(cfg, verbose=False)) for label, cfg in order}
            runs.append(pair)
            print(f"{name}: pair {i + 1}/{args.pairs} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        entry = {"simulator": {"a": sim_a, "b": sim_b}, "engine": runs, "figures": {}}
        for key, label in FIGURES:
            ratios = [r["a"][key] / r["b"][key] for r in runs if r["b"][key]]
            engine = statistics.median(ratios)
            sim = sim_a[key] / sim_b[key]
            error = sim / engine - 1
            entry["figures"][key] = {"engine_median": engine, "engine_range": [min(ratios), max(ratios)],
                                     "simulator": sim, "error": error, "pass": abs(error) <= TOLERANCE}  # fmt: skip
            rows.append([name, label, f"{engine:.3f} [{min(ratios):.3f}, {max(ratios):.3f}]", f"{sim:.3f}",
                         f"{100 * error:+.1f}%", "pass" if abs(error) <= TOLERANCE else "FAIL"])  # fmt: skip
        report["comparisons"][name] = entry
    print(markdown_table(["comparison (A / B)", "figure", f"engine, median of {args.pairs} pairs [range]",
                          "simulator", "error", f"within {100 * TOLERANCE:.0f}%"], rows))  # fmt: skip
    out = Path(args.out)
    write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
