"""Speculative decoding on the engine: tokens/s with and without it, side by side in one run.

    python benchmarks/spec_speed.py [--repeats 3] [--batches 1 8] [--k 3] [--draft-layers 15] [--cores 1]

The JAX engine at SmolLM-135M's shape (configs/model/smollm_135m.yaml, random weights), pinned to
`--cores` CPUs (default 1, as `taskset -c 0` does) before jax starts. For each batch size B
(`--batches`, default 1 and 8): B requests at t=0 in B slots, greedy, EOS ignored, each a
prompt of `--prompt-len` random token ids and `--max-tokens` outputs; batch B serves the first B
prompts of one list, so a smaller batch's requests are all in a larger one. Arms, interleaved
in every repeat so the machine's drift falls on all of them alike:
- none: one token per decode step;
- ngram: prompt lookup on the host (`spec.method=ngram`, k = `--k`);
- draft_layers: the target's first `--draft-layers` layers and its head draft k tokens on the
  device (`spec.method=draft spec.draft_layers=N`).
Random weights under greedy decoding fall into loops, so later outputs repeat earlier ones and
prompt lookup finds them; the script prints how much of the none arm's output an n-gram lookup
of its own history predicts (`repeat`), to show the workload is one whose outputs repeat.
Whether the first layers' argmax equals the whole model's is, with random weights, a matter of
each prompt's loop: the draft_layers arm's acceptance differs widely between requests (alone or
batched alike, as tests/test_spec_batched.py checks), so the script prints it per request.

Prints, per batch size and arm: tokens/s (median over repeats and the range), its ratio to the
none arm (median of the per-repeat paired ratios), the acceptance rate (accepted / proposed
drafts), tokens per decode step, and whether every output equals the none arm's (greedy
parity) and compiles during its runs (0; counted from once every arm is warm, since the arms'
executors share the process's compile count). Warmup (compiles) is untimed. Figures also go
to `--out` as JSON. Tokens per step counts every row's tokens of an iteration, prefill steps
included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, default=3, help="spec.num_tokens")
    p.add_argument("--draft-layers", type=int, default=15, help="spec.draft_layers for the draft_layers arm")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--cores", type=int, default=1, help="pin to this many CPUs (None: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "outputs" / "spec_speed.json")
    return p.parse_args()


def repeat_rate(outputs: list[list[int]], n: int = 3) -> float:
    """The fraction of output tokens whose previous n tokens occurred earlier in the same output,
    followed by this token: what an n-gram lookup would have drafted right."""
    hits = total = 0
    for out in outputs:
        seen: dict[tuple, int] = {}
        for i in range(n, len(out)):
            key = tuple(out[i - n : i])
            total += 1
            hits += seen.get(key) == out[i]
            seen[key] = out[i]
    return hits / total if total else 0.0


def main() -> None:
    args = parse_args()
    from cbjax.profile.pinning import pin

    pin(args.cores, "--cores")  # before jax starts its threads

    import numpy as np

    from cbjax.config import CacheConfig, ExecutorConfig, SchedulerConfig, SpecConfig
    from cbjax.config.spec import load_draft_model
    from cbjax.core.request import Request, SamplingParams
    from cbjax.engine.offline import serve
    from cbjax.runtime.executor import JaxExecutor
    from cbjax.scheduler import Scheduler

    model = load_draft_model("smollm_135m")  # configs/model/smollm_135m.yaml
    if args.prompt_len + args.max_tokens > model.max_model_len:
        raise SystemExit(f"--prompt-len + --max-tokens must fit model.max_model_len={model.max_model_len}")
    arms = {
        "none": SpecConfig(),
        "ngram": SpecConfig(method="ngram", num_tokens=args.k),
        "draft_layers": SpecConfig(method="draft", num_tokens=args.k, draft_layers=args.draft_layers),
    }
    rng = np.random.default_rng(args.seed)
    all_prompts = [rng.integers(0, model.vocab_size, args.prompt_len).tolist() for _ in range(max(args.batches))]
    results: dict = {}
    for batch in args.batches:
        prompts = all_prompts[:batch]
        page_size = 16
        cache = CacheConfig(num_pages=1 + batch * (model.max_model_len // page_size + 1), page_size=page_size,
                            prefix_caching=False)  # fmt: skip
        budget = batch * max(args.prompt_len, 1 + args.k)  # the prompts prefill in one step
        sched_cfg = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=budget)
        step = batch * (1 + args.k)  # a decode step's most tokens
        buckets = sorted({b for b in (1, 2, 4, batch, step, budget) if b <= budget})
        engines = {}
        for name, spec in arms.items():
            ex = JaxExecutor(model, cache, sched_cfg, ExecutorConfig(name="jax", token_buckets=buckets), seed=args.seed,
                             progress=False, spec=spec)  # fmt: skip
            t0 = time.perf_counter()
            ex.warmup(sampling=False)
            print(f"batch {batch} {name}: warmup {time.perf_counter() - t0:.1f}s", flush=True)
            engines[name] = ex
        for ex in engines.values():  # each arm counts only the compiles of its own runs
            ex.restart_compile_count()
        runs: dict[str, list] = {name: [] for name in arms}
        for rep in range(args.repeats):
            for name, spec in arms.items():
                reqs = [
                    Request(str(i), 0.0, len(p), prompt_token_ids=list(p),
                            sampling=SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
                    for i, p in enumerate(prompts)
                ]  # fmt: skip
                sched = Scheduler(sched_cfg, cache, model.max_model_len, vocab_size=model.vocab_size, spec=spec)
                ex = engines[name]
                steps_before = ex.num_steps
                t0 = time.perf_counter()
                result = serve(reqs, sched, ex)
                wall = time.perf_counter() - t0
                done = sorted(result.requests, key=lambda r: int(r.request_id))
                tokens = sum(len(r.output_token_ids) for r in done)
                runs[name].append({
                    "tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens,
                    "steps": ex.num_steps - steps_before,
                    "proposed": sum(r.spec_proposed for r in done), "accepted": sum(r.spec_accepted for r in done),
                    "acceptance_by_request": [r.spec_accepted / r.spec_proposed if r.spec_proposed else None for r in done],
                    "outputs": [r.output_token_ids for r in done],
                    "compiles_after_warmup": ex.metrics()["compiles_after_warmup"],
                })  # fmt: skip
                print(f"  batch {batch} repeat {rep} {name}: {tokens / wall:.1f} tokens/s", flush=True)
        results[batch] = summarize(runs)
    report(results, args)


def summarize(runs: dict[str, list]) -> dict:
    base = runs["none"]
    out = {"repeat_rate_3gram": repeat_rate(base[0]["outputs"])}
    for name, rs in runs.items():
        tps = [r["tokens_per_s"] for r in rs]
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, base)]
        proposed, accepted = sum(r["proposed"] for r in rs), sum(r["accepted"] for r in rs)
        out[name] = {
            "tokens_per_s": statistics.median(tps), "tokens_per_s_range": [min(tps), max(tps)],
            "ratio_to_none": statistics.median(ratios), "ratios": ratios,
            "acceptance_rate": accepted / proposed if proposed else None,
            "acceptance_by_request": rs[-1]["acceptance_by_request"],
            "tokens_per_step": statistics.median(r["tokens"] / r["steps"] for r in rs),
            "same_outputs_as_none": all(r["outputs"] == b["outputs"] for r, b in zip(rs, base)),
            "compiles_after_warmup": rs[-1]["compiles_after_warmup"],
        }  # fmt: skip
    return out


def report(results: dict, args) -> None:
    print(f"\nSmolLM-135M shape, random weights, k={args.k}, draft_layers={args.draft_layers}, "
          f"prompt {args.prompt_len} + {args.max_tokens} tokens, {args.repeats} repeats, cores={args.cores}")  # fmt: skip
    print(f"{'batch':>5} {'arm':>12} {'tokens/s':>9} {'range':>15} {'x none':>7} {'accept':>7} {'tok/step':>8} "
          f"{'same':>5} compiles")  # fmt: skip
    for batch, res in results.items():
        for name in ("none", "ngram", "draft_layers"):
            r = res[name]
            lo, hi = r["tokens_per_s_range"]
            acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
            print(f"{batch:>5} {name:>12} {r['tokens_per_s']:>9.1f} {f'{lo:.1f}-{hi:.1f}':>15} "
                  f"{r['ratio_to_none']:>7.2f} {acc:>7} {r['tokens_per_step']:>8.2f} {str(r['same_outputs_as_none']):>5} "
                  f"{r['compiles_after_warmup']}")  # fmt: skip
        print(f"{batch:>5} {'':>12} repeat (3-gram lookup of the none arm's outputs): {res['repeat_rate_3gram']:.2f}")
        by_request = " ".join("-" if a is None else f"{a:.2f}" for a in res["draft_layers"]["acceptance_by_request"])
        print(f"{batch:>5} {'':>12} draft_layers acceptance by request: {by_request}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
