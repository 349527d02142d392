"""Run the simulator's reference configurations in a source tree and compare two trees' results.

    python experiments/sim_identity.py snapshot --tree PATH --out DIR   # run and keep the summaries
    python experiments/sim_identity.py compare DIR_A DIR_B              # every number equal?

The configurations are every paper reproduction (`experiment=NAME`), the shipped Azure sample
trace and `static_vs_continuous`, each through the `cbjax` command line of the tree, so a
refactor's results can be checked against an earlier commit's (a `git worktree` of it).
Fields that measure this machine rather than the simulated system (wall time, host time of
the scheduler) are left out of the comparison, as are fields B added that are empty (null).
`--set KEY=VALUE` pins an override in every run (a default that changed between the trees).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = [
    "static_vs_continuous", "anyscale_output_cap", "distserve_goodput", "ltr_toy", "prefix_routing",
    "sarathi_ablation", "splitwise_hetero", "vllm_batch_size", "vllm_block_size", "vllm_kv_utilization",
    "vllm_recompute_vs_swap", "vtc_overload",
]  # fmt: skip
TRACE = ["workload=trace", "workload.path=pkg://cbjax.data/AzureLLMInferenceTrace_code_sample.csv",
         "model=llama3_8b", "cache.num_pages=28000"]  # fmt: skip
# measurements of the host that ran the simulation, not of the simulated system
HOST_FIELDS = ("wall_s", "schedule_s", "postprocess_s", "warmup_s", "scheduler_host_s", "scheduler_overhead")


def runs() -> dict[str, list[str]]:
    out = {f"experiment={name}": [f"experiment={name}"] for name in EXPERIMENTS}
    out["azure_sample_trace"] = TRACE
    out["default"] = []
    return out


def snapshot(tree: Path, out: Path, pins: list[str], only: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
    for name, overrides in runs().items():
        if only and not any(o in name for o in only):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "cbjax", *overrides, *pins, "progress=false", f"hydra.run.dir={tmp}"]
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            tmp_path = Path(tmp)
            result = tmp_path / "comparison.json"
            if not result.exists():
                result = tmp_path / "summary.json"
            (out / f"{name.replace('=', '_')}.json").write_text(result.read_text())
            print(f"{name}: ok", flush=True)


def _host_field(key: str) -> bool:
    return any(key == f or (f.endswith("_") and key.startswith(f)) for f in HOST_FIELDS)


def diff(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            if _host_field(key):
                continue
            if key not in a and b[key] is None:
                continue  # a field added since A, empty here: no result changed
            if key not in a or key not in b:
                out.append(f"{path}.{key}: only in {'B' if key not in a else 'A'}")
                continue
            out += diff(a[key], b[key], f"{path}.{key}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def compare(dir_a: Path, dir_b: Path) -> int:
    bad = 0
    for file_a in sorted(dir_a.glob("*.json")):
        file_b = dir_b / file_a.name
        if not file_b.exists():
            print(f"{file_a.stem}: missing in {dir_b}")
            bad += 1
            continue
        found = diff(json.loads(file_a.read_text()), json.loads(file_b.read_text()))
        print(f"{file_a.stem}: {'identical' if not found else f'{len(found)} differences'}")
        for line in found[:10]:
            print(f"    {line}")
        bad += bool(found)
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("--tree", type=Path, default=REPO)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--set", action="append", default=[], dest="pins", help="an override for every run")
    s.add_argument("--only", action="append", default=[], help="runs whose name contains this")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args()
    if args.cmd == "snapshot":
        snapshot(args.tree.resolve(), args.out, args.pins, args.only)
    else:
        sys.exit(compare(args.a, args.b))


if __name__ == "__main__":
    main()
