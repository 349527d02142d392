"""Peer benchmark: cbjax vs transformers' continuous batching and static `generate`, same weights.

    python benchmarks/peer_transformers.py [--requests 48] [--repeats 3] [--slots 48]

A random-weight Llama (hidden 256, 4 layers, 8 heads / 4 KV heads, head_dim 32, ffn 768,
vocab 4096, f32) is built with transformers, saved with `save_pretrained` and loaded into
cbjax with `model=hf`'s loader, so both sides run the same weights. Workload: prompts of
uniform 16-200 random token ids, output lengths exponential with mean 64 (clipped to
[1, 256]), greedy, EOS ignored, all requests queued at t=0.

Systems, each timed from the first request handed in to the last token out, warmup excluded:
- cbjax: JaxExecutor + fcfs scheduler (`serve`), 48 slots, 256 tokens per iteration, prefill
  buckets every 32 tokens up to 256 (up to 4 same-bucket prompts per call), decode compiled
  for 1/2/4/8/16/24/32/48 rows (active slots packed into the smallest) and, with the default
  ragged attention on CPU, a few page-entry counts per row count; compilation happens in
  `warmup()`, untimed.
- transformers CB: `init_continuous_batching` manager (its default config, sized by workload
  hints as `generate_batch` does), per-request `max_new_tokens`, EOS disabled; one untimed
  warmup round of a few requests first.
- transformers static: one left-padded `generate` over all requests with the longest
  `max_new_tokens`; only each request's own tokens count. One untimed small warmup call.

Prints medians over repeats: tokens/s per system, ratios, and how many outputs are
token-for-token identical to cbjax's. `--profile` adds one more (untimed) cbjax run that
times every jitted call: where cbjax's time goes, by step kind and shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
from cbjax.engine import serve
from cbjax.model.hf import load_config, load_params
from cbjax.report import markdown_table
from cbjax.request import Request, SamplingParams
from cbjax.runtime.executor import JaxExecutor
from cbjax.scheduler import Scheduler

MODEL_KW = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=32, max_position_embeddings=512, rope_theta=10000.0, eos_token_id=2,
)  # fmt: skip
INIT_STD = 0.05  # wider than HF's 0.02 so greedy argmaxes are rarely near-ties


def make_checkpoint(model_dir: str, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**MODEL_KW)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, INIT_STD)
    model.save_pretrained(model_dir)
    return model


def make_workload(num: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(16, 201, num)
    output_lens = np.clip(np.rint(rng.exponential(64.0, num)), 1, 256).astype(int)
    return [(rng.integers(3, vocab, int(p)).tolist(), int(o)) for p, o in zip(prompt_lens, output_lens)]


# ---- cbjax ----
def cbjax_runner(model_dir: str, args):
    model = load_config(ModelConfig(name="peer", path=model_dir, dtype="float32", max_model_len=512))
    sched_cfg = SchedulerConfig(max_num_seqs=args.slots, max_num_batched_tokens=args.budget)
    cache = CacheConfig(page_size=16, num_pages=args.pages)
    buckets = [b for b in range(32, 513, 32) if b < args.budget] + [args.budget]
    ex_cfg = ExecutorConfig(
        name="jax", attention=args.attention, prefill_buckets=buckets, max_prefill_batch=args.prefill_batch,
        decode_page_buckets=[8, 16, 32], decode_row_buckets=args.decode_rows,
    )  # fmt: skip
    ex = JaxExecutor(model, cache, sched_cfg, ex_cfg, params=load_params(model))
    t0 = time.perf_counter()
    ex.warmup()
    warmup_s = time.perf_counter() - t0

    def run(workload):
        reqs = [
            Request(str(i), 0.0, len(p), list(p), SamplingParams(max_tokens=o, ignore_eos=True))
            for i, (p, o) in enumerate(workload)
        ]
        sched = Scheduler(
            sched_cfg, cache, model.max_model_len, validate=ex.validate, eos_token_id=model.eos_token_id,
            vocab_size=model.vocab_size,
        )
        result = serve(reqs, sched, ex)
        outs = [r.output_token_ids for r in result.requests]
        return sum(map(len, outs)) / result.makespan_s, outs, result

    return run, warmup_s, ex


def profile_cbjax(run, ex, workload) -> str:
    """One more cbjax run with each jitted call timed to completion, summed by kind and shape."""
    import jax

    totals: dict[tuple, list] = {}

    def timed(kind, fn, shape_of):
        def call(*a):
            t0 = time.perf_counter()
            out = fn(*a)
            jax.block_until_ready(out[0])
            entry = totals.setdefault((kind, shape_of(a)), [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - t0
            return out

        return call

    steps = ex._decode, ex._prefill, ex._prefill_ctx
    decode_for = ex._decode

    def decode(entries):
        def shape_of(a):
            work = f"{entries} page entries" if entries is not None else f"{a[4].shape[1]} pages"
            return f"{a[2].shape[0]} rows x {work}"

        return timed("decode", decode_for(entries), shape_of)

    ex._decode = decode
    ex._prefill = timed("prefill", ex._prefill, lambda a: f"{a[2].shape[0]} rows x {a[2].shape[1]} tokens")
    ex._prefill_ctx = timed("context prefill", ex._prefill_ctx, lambda a: f"{a[2].shape[1]} tokens")
    try:
        _, _, result = run(workload)
    finally:
        ex._decode, ex._prefill, ex._prefill_ctx = steps
    device = sum(t for _, t in totals.values())
    rows = [
        (kind, shape, n, f"{t:.2f}", f"{1e3 * t / n:.1f}", f"{t / result.makespan_s:.0%}")
        for (kind, shape), (n, t) in sorted(totals.items(), key=lambda kv: -kv[1][1])
    ]
    rows.append(("host (schedule, pack, postprocess)", "", result.stats.iterations,
                 f"{result.makespan_s - device:.2f}", "", f"{1 - device / result.makespan_s:.0%}"))  # fmt: skip
    return markdown_table(["cbjax step", "shape", "calls", "total s", "ms/call", "share"], rows)


# ---- transformers continuous batching ----
def hf_cb_runner(model, workload, args):
    import torch
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.initialization import WorkloadHints

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in workload), eos_token_id=-1)
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p, _ in workload),
        max_generated_length=max(o for _, o in workload),
        num_requests=len(workload),
    )
    manager = model.init_continuous_batching(generation_config=gen, workload_hints=hints)
    manager.warmup()
    manager.start()

    def run(reqs):
        with torch.no_grad():
            t0 = time.perf_counter()
            ids = [manager.add_request(list(p), max_new_tokens=o, eos_token_id=-1) for p, o in reqs]
            results = {}
            while len(results) < len(ids):
                out = manager.get_result(timeout=60)
                if out is None:
                    raise RuntimeError("transformers CB: no result within 60 s")
                if out.is_finished():
                    results[out.request_id] = out
            elapsed = time.perf_counter() - t0
        outs = [list(results[i].generated_tokens) for i in ids]
        return sum(map(len, outs)) / elapsed, outs

    t0 = time.perf_counter()
    run(workload[:4])  # warmup round
    return run, time.perf_counter() - t0, manager


# ---- transformers static padded generate ----
def hf_static_runner(model, workload):
    import torch

    model.generation_config.eos_token_id = None  # ignore EOS: every row runs to max_new_tokens

    def generate(reqs):
        longest = max(len(p) for p, _ in reqs)
        ids = torch.zeros((len(reqs), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(reqs):  # left padding
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        max_new = max(o for _, o in reqs)
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            elapsed = time.perf_counter() - t0
        outs = [out[i, longest : longest + o].tolist() for i, (_, o) in enumerate(reqs)]
        return sum(map(len, outs)) / elapsed, outs

    t0 = time.perf_counter()
    generate([(p, 4) for p, _ in workload[:4]])  # warmup
    return generate, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=48)
    ap.add_argument("--budget", type=int, default=256, help="cbjax tokens per iteration (the largest prefill bucket)")
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--decode-rows", type=int, nargs="*", default=[1, 2, 4, 8, 16, 24, 32], help="cbjax decode row buckets")
    ap.add_argument("--attention", default="auto", help="cbjax executor.attention (auto: ragged on CPU)")
    ap.add_argument("--static-repeats", type=int, default=1, help="static generate is slow: fewer repeats")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--profile", action="store_true", help="time cbjax's jitted calls in one extra run")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    workload = make_workload(args.requests, args.seed, MODEL_KW["vocab_size"])
    with tempfile.TemporaryDirectory() as model_dir:
        model = make_checkpoint(model_dir, args.seed)
        cb_run, cb_warm, ex = cbjax_runner(model_dir, args)
        hf_run, hf_warm, manager = hf_cb_runner(model, workload, args)
        try:
            runs = {"cbjax": [], "transformers CB": []}
            paired = []  # cbjax / transformers CB per repeat: the two run back to back, under the same load
            outs = {}
            for _ in range(args.repeats):
                tok_s, outs["cbjax"], result = cb_run(workload)
                runs["cbjax"].append(tok_s)
                tok_s, outs["transformers CB"] = hf_run(workload)
                runs["transformers CB"].append(tok_s)
                paired.append(runs["cbjax"][-1] / tok_s)
            profile = profile_cbjax(cb_run, ex, workload) if args.profile else None
        finally:
            manager.stop(block=True, timeout=10)
        warm = {"cbjax": cb_warm, "transformers CB": hf_warm}
        if not args.skip_static:
            st_run, warm["transformers static"] = hf_static_runner(model, workload)
            runs["transformers static"] = []
            for _ in range(args.static_repeats):
                tok_s, outs["transformers static"] = st_run(workload)
                runs["transformers static"].append(tok_s)

    ref = outs["cbjax"]
    base = statistics.median(runs["transformers CB"])
    rows = []
    for name, values in runs.items():
        med = statistics.median(values)
        same = sum(a == b for a, b in zip(outs[name], ref))
        rows.append((name, f"{med:.0f}", f"{min(values):.0f}-{max(values):.0f}", f"{med / base:.2f}x",
                     f"{same}/{len(ref)}", f"{warm[name]:.1f}"))  # fmt: skip
    total = sum(o for _, o in workload)
    prompts = [len(p) for p, _ in workload]
    print(f"{args.requests} requests (prompts {min(prompts)}-{max(prompts)} tokens, {total} output tokens, "
          f"exponential mean 64), greedy, ignore_eos; torch {torch.__version__} on {torch.get_num_threads()} "
          f"threads, {os.cpu_count()} CPUs; cbjax {args.slots} slots, budget {args.budget}; "
          f"medians of {args.repeats}, warmup excluded")  # fmt: skip
    print(markdown_table(
        ["system", "tok/s (median)", "range", "vs transformers CB", "outputs identical to cbjax", "warmup s"], rows
    ))  # fmt: skip
    print(f"\ncbjax / transformers CB per repeat (back to back): "
          f"{', '.join(f'{r:.2f}x' for r in paired)}; median {statistics.median(paired):.2f}x")  # fmt: skip
    stats = result.stats
    m = ex.metrics()
    sched_ms = 1e3 * (stats.schedule_s + stats.postprocess_s)
    print(f"\ncbjax last run: {stats.iterations} iterations, host {sched_ms:.0f} ms "
          f"scheduler, {1e3 * m['host_pack_s']:.0f} ms packing (all runs), compiles after warmup "
          f"{m['compiles_after_warmup']}")  # fmt: skip
    if profile:
        print("\nWhere cbjax's time goes (one extra run, each call timed to completion):\n" + profile)


if __name__ == "__main__":
    main()
