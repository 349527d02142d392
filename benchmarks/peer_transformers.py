"""Peer benchmark: cbjax at default settings vs transformers' continuous batching and static `generate`.

    python benchmarks/peer_transformers.py [--shape tiny|smollm] [--requests N] [--repeats 3] [--slots 32]

A random-weight Llama is built with transformers, saved with `save_pretrained` and loaded into
cbjax with `model=hf`'s loader (`load_model`), so every system runs the same f32 weights:
- `--shape tiny` (default, 48 requests): hidden 256, 4 layers, 8/4 heads, head_dim 32, ffn 768,
  vocab 4096, context 512;
- `--shape smollm` (24 requests): SmolLM-135M's shape, 30 layers, hidden 576, 9/3 heads,
  head_dim 64, ffn 1536, vocab 49,152, tied embeddings, context 2048.
Workload: prompts of uniform 16-200 random token ids, output lengths exponential with mean 64
(clipped to [1, 256]), greedy, EOS ignored, all requests queued at t=0.

Systems, each timed from the first request handed in to the last token out, warmup excluded,
run one after another within each repeat (cbjax, transformers CB, transformers static):
- cbjax: JaxExecutor + fcfs scheduler (`serve`) at default executor and scheduler settings;
  only the slot count (`--slots`, scheduler.max_num_seqs) and the workload are set (the
  default page pool holds every request at once, so nothing is preempted). Compilation
  happens in `warmup()`, untimed.
- transformers CB: `init_continuous_batching` manager (its default config, sized by workload
  hints as `generate_batch` does), per-request `max_new_tokens`, EOS disabled; one untimed
  warmup round of a few requests first.
- transformers static: one left-padded `generate` over all requests with the longest
  `max_new_tokens`; only each request's own tokens count. One untimed small warmup call.

Prints medians and ranges over repeats of tokens/s, each system's ratio to transformers CB,
the per-repeat paired ratios, and how many outputs are token-for-token identical to cbjax's.
Then bounds measured on this machine: the weight-streaming floor (f32 weight bytes read
per decode step at this machine's streaming bandwidth, the best of an XLA sum, a numpy sum
and an XLA matrix-vector product over `--stream-mb` MB, times cbjax's iteration count) with
the fraction of it cbjax reached; and the f32 matmul peak (XLA, 1024^3) with cbjax's model
FLOP/s (2 x non-embedding params x tokens processed + attention FLOPs + the LM head, 2 x
d_model x vocab, at each token whose logits the run needs, over its serving time) as a fraction of it, beside the same work over the time the model's matmuls alone take at
the step shapes cbjax ran (`gemm_floor_s`), through XLA's GEMMs and through cbjax's native
kernel: the highest fraction those shapes allow with each; and with the KV bytes the decode
tokens must read at the streaming bandwidth added, a bound on the fraction for this workload.
The VM's speed drifts between phases, so the peak is also measured right after each cbjax run
and each run's model FLOP/s is divided by the peak next to it: the median of those paired
fractions is the figure that phase drift moves least.
`--profile` times every model-step call of one more (untimed) cbjax run by token bucket: where
cbjax's time goes; `--trace` runs one more under JAX's profiler and sums op time by kind (native
matmuls, XLA dots, native attention, other XLA ops) beside the host-only rest. Every figure is
also written as JSON to `--out` (default outputs/peer_transformers_<shape>.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
from cbjax.engine.offline import serve
from cbjax.model.hf import load_config, load_model
from cbjax.report.tables import markdown_table
from cbjax.core.request import Request, SamplingParams
from cbjax.runtime.executor import JaxExecutor
from cbjax.scheduler import Scheduler

SHAPES = {
    "tiny": dict(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=512, rope_theta=10000.0, eos_token_id=2,
    ),
    "smollm": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, rope_theta=10000.0, eos_token_id=2,
        tie_word_embeddings=True,
    ),
}  # fmt: skip
DEFAULT_REQUESTS = {"tiny": 48, "smollm": 24}
REPO = Path(__file__).resolve().parent.parent
INIT_STD = 0.05  # wider than HF's 0.02 so greedy argmaxes are rarely near-ties


def make_checkpoint(model_dir: str, shape: str, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).eval()
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
    model = load_config(ModelConfig(name="peer", path=model_dir, dtype="float32", max_model_len=0))
    sched_cfg = SchedulerConfig(max_num_seqs=args.slots)
    cache = CacheConfig(num_pages=args.pages)
    ex = JaxExecutor(model, cache, sched_cfg, ExecutorConfig(name="jax"), llama=load_model(model), progress=False)
    ex.warmup()

    def run(workload):
        reqs = [
            Request(str(i), 0.0, len(p), list(p), SamplingParams(max_tokens=o, ignore_eos=True))
            for i, (p, o) in enumerate(workload)
        ]
        sched = Scheduler(
            sched_cfg, cache, model.max_model_len, validate=ex.validate, eos_token_id=model.eos_token_id,
            vocab_size=model.vocab_size,
        )
        before = ex.metrics()
        calls_before = dict(ex.bucket_calls)
        result = serve(reqs, sched, ex)
        after = ex.metrics()
        result.bucket_calls = {b: n - calls_before.get(b, 0) for b, n in ex.bucket_calls.items() if n > calls_before.get(b, 0)}
        outs = [r.output_token_ids for r in result.requests]
        result.host_pack_s = after["host_pack_s"] - before["host_pack_s"]
        result.device_wait_s = after["device_wait_s"] - before["device_wait_s"]
        return sum(map(len, outs)) / result.makespan_s, outs, result

    return run, ex.warmup_s, ex, model


@contextlib.contextmanager
def wrapped_steps(ex, wrap):
    """Within the block, ex's compiled step for each bucket is wrap(bucket, step)."""
    compiled = dict(ex._compiled)
    ex._compiled.update({b: wrap(b, fn) for b, fn in compiled.items()})
    try:
        yield
    finally:
        ex._compiled.update(compiled)


def profile_cbjax(run, ex, workload) -> str:
    """One more cbjax run with each model-step call timed to completion, summed by token bucket."""
    import jax

    totals: dict[int, list] = {}

    def timed(bucket, fn):
        def call(*a):
            t0 = time.perf_counter()
            out = fn(*a)
            jax.block_until_ready(out[0])
            entry = totals.setdefault(bucket, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - t0
            return out

        return call

    with wrapped_steps(ex, timed):
        _, _, result = run(workload)
    device = sum(t for _, t in totals.values())
    span = result.makespan_s
    rows = [
        (f"{b} tokens", n, f"{t:.2f}", f"{1e3 * t / n:.1f}", f"{t / span:.0%}")
        for b, (n, t) in sorted(totals.items(), key=lambda kv: -kv[1][1])
    ]
    rows.append(("host (schedule, pack, postprocess)", result.stats.iterations, f"{span - device:.2f}", "",
                 f"{1 - device / span:.0%}"))  # fmt: skip
    return markdown_table(["cbjax model step", "calls", "total s", "ms/call", "share"], rows)


def trace_cbjax(run, ex, workload, slots: int) -> tuple[str, dict]:
    """One more cbjax run under JAX's profiler: op time by kind (native matmuls, XLA dots,
    native attention, other XLA ops), for steps of at most `slots` tokens and larger ones,
    beside XLA's busy wall time and the host-only rest (cbjax.runtime.op_time)."""
    import jax

    from cbjax.runtime.op_time import KINDS, breakdown, op_kinds, read_trace

    kinds = {b: op_kinds(c.as_text()) for b, c in ex._compiled.items()}
    marks: list[int] = []  # the bucket of each step, in order

    def annotated(bucket, fn):
        def call(*a):
            marks.append(bucket)
            with jax.profiler.TraceAnnotation("cbjax_step"):
                return fn(*a)

        return call

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no Python function events: the host runs near its own speed
    with tempfile.TemporaryDirectory() as directory:
        with wrapped_steps(ex, annotated), jax.profiler.trace(directory, profiler_options=options):
            _, _, result = run(workload)
        events = read_trace(directory)
    starts = sorted(e.start_us for e in events if e.name == "cbjax_step")
    if len(starts) != len(marks):
        raise RuntimeError(f"trace: {len(starts)} step annotations for {len(marks)} steps")
    label = {True: f"steps <= {slots} tokens", False: f"steps > {slots} tokens"}
    steps = [(t, label[b <= slots], kinds[b]) for t, b in zip(starts, marks)]
    out = breakdown(events, steps, result.makespan_s)
    groups = [label[True], label[False]]
    span = result.makespan_s

    def row(name, values):
        total = sum(values)
        return [name, *(f"{v:.3f}" for v in values), f"{total:.3f}", f"{total / span:.0%}"]

    g = out["groups"]
    rows = [row(k, [g.get(n, {}).get(k, 0.0) for n in groups]) for k in KINDS]
    rows.append(row("XLA busy, no op event running (wall)", [g.get(n, {}).get("between_ops_s", 0.0) for n in groups]))
    rows.append(["host only: no XLA op running (wall)", "", "", f"{out['host_only_s']:.3f}", f"{out['host_only_s'] / span:.0%}"])  # fmt: skip
    header = ["op kind", *(f"{n} ({g.get(n, {}).get('steps', 0)}) s" for n in groups), "total s", "share of span"]
    text = (
        f"traced run: {span:.2f} s serving ({len(marks)} steps), XLA busy "
        f"{out['xla_busy_s']:.2f} s; op seconds are summed over XLA's threads; XLA:CPU runs a large dot "
        "asynchronously after its event ends, so the larger steps' dots count as 'no op event running'\n"
        + markdown_table(header, rows)
    )
    return text, out


# ---- transformers continuous batching ----
def hf_cb_runner(model, workload):
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
                out = manager.get_result(timeout=120)
                if out is None:
                    raise RuntimeError("transformers CB: no result within 120 s")
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


# ---- this machine's bounds ----
def _median_time(fn, repeats: int) -> float:
    fn()  # compile / first touch
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def streaming_gb_s(mb: int) -> dict[str, float]:
    """Read bandwidth (GB/s) over an `mb` MB f32 array, medians of 5: XLA and numpy sums, and an
    XLA matrix-vector product (how a decode step streams a weight matrix, on every core)."""
    import jax
    import jax.numpy as jnp

    n = mb * 2**20 // 4
    host = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dev = jax.device_put(host)
    matrix = dev.reshape(-1, 1024)
    vector = jnp.ones(1024, jnp.float32)
    reduce, matvec = jax.jit(jnp.sum), jax.jit(jnp.matmul)
    return {
        "XLA sum": 4 * n / _median_time(lambda: reduce(dev).block_until_ready(), 5) / 1e9,
        "numpy sum": 4 * n / _median_time(host.sum, 5) / 1e9,
        "XLA matvec": 4 * n / _median_time(lambda: matvec(matrix, vector).block_until_ready(), 5) / 1e9,
    }


def matmul_gflop_s(n: int = 1024, repeats: int = 10) -> float:
    """XLA f32 matmul at n^3, GFLOP/s: median of `repeats` calls."""
    import jax
    import jax.numpy as jnp

    a = jax.device_put(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
    b = jax.device_put(np.random.default_rng(1).standard_normal((n, n), dtype=np.float32))
    mm = jax.jit(jnp.matmul)
    return 2 * n**3 / _median_time(lambda: mm(a, b).block_until_ready(), repeats) / 1e9


def gemm_floor_s(model: ModelConfig, bucket_calls: dict[int, int], num_rows: int, matmul: str = "xla") -> dict[int, float]:
    """Seconds per call of the model's matmuls alone at each token bucket: per layer the fused
    q/k/v, o, fused gate/up and down projections on [bucket, ...] rows, then the LM head on the
    first min(bucket, num_rows) rows (as the step runs it), in one jitted program per bucket;
    medians of repeated calls. matmul="xla": XLA's dots, each layer with weights of its own (no
    slicing from a stack); "native": cbjax's kernel (`executor.matmul=native`) on the stacked
    weights in panel order, as the step runs it. Summed over a run's bucket calls, it is the time those GEMMs
    alone need for the step shapes the run used, padding included."""
    import jax
    import jax.numpy as jnp

    d, q_dim, kv_dim, ffn = model.d_model, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, model.ffn_dim
    rng = np.random.default_rng(0)

    def w(*shape):
        return jax.device_put(rng.standard_normal(shape, dtype=np.float32))

    layers = [dict(qkv=w(d, q_dim + 2 * kv_dim), o=w(q_dim, d), gate_up=w(d, 2 * ffn), down=w(ffn, d))
              for _ in range(model.num_layers)]  # fmt: skip
    head = w(d, model.vocab_size)
    if matmul == "native":
        from cbjax.kernels.native import layer_matmul, to_panels

        # [num_layers, in, out], in panel order as the executor holds them
        layers = {k: jax.device_put(to_panels(np.stack([lw[k] for lw in layers]))) for k in layers[0]}
        head = jax.device_put(to_panels(np.asarray(head)[None]))

        @jax.jit
        def gemms(x, stacked, head):
            def body(x, i):
                x = x + layer_matmul(layer_matmul(x, stacked["qkv"], i)[:, :q_dim], stacked["o"], i)
                return x + layer_matmul(layer_matmul(x, stacked["gate_up"], i)[:, :ffn], stacked["down"], i), None

            x, _ = jax.lax.scan(body, x, jnp.arange(model.num_layers))
            return layer_matmul(x[: min(x.shape[0], num_rows)], head)
    else:

        @jax.jit
        def gemms(x, layers, head):
            for lw in layers:
                x = x + (x @ lw["qkv"])[:, :q_dim] @ lw["o"]
                x = x + (x @ lw["gate_up"])[:, :ffn] @ lw["down"]
            return x[: min(x.shape[0], num_rows)] @ head

    out = {}
    for bucket in sorted(bucket_calls):
        x = jax.device_put(rng.standard_normal((bucket, d), dtype=np.float32))
        out[bucket] = _median_time(lambda x=x: jax.block_until_ready(gemms(x, layers, head)), 20 if bucket <= 512 else 5)
    return out


def model_counts(torch_model, model: ModelConfig, workload) -> dict[str, float]:
    """Parameter counts and the work of the workload (no preemption: each request processes
    its prompt and all but its last output token, each at its position's causal context)."""
    embed = model.vocab_size * model.d_model
    total = sum(p.numel() for p in torch_model.parameters())  # tied weights counted once
    non_embed = total - embed * (1 if model.tie_embeddings else 2)
    tokens = sum(len(p) + o - 1 for p, o in workload)
    contexts = sum((n := len(p) + o - 1) * (n + 1) // 2 for p, o in workload)  # sum of (pos + 1)
    attn_flops = 4 * model.num_layers * model.num_heads * model.head_dim * contexts  # QK^T and PV
    # the LM head (Chinchilla's "final logits" term) at the tokens whose logits the run needs:
    # each output token comes from one row of logits (a prompt's last token, then each decode)
    head_flops = 2 * model.d_model * model.vocab_size * sum(o for _, o in workload)
    # each decode token (a request's output tokens but the last) reads its whole context's K and V
    decode_contexts = sum(len(p) * (o - 1) + (o - 1) * o // 2 for p, o in workload)
    kv_bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4
    flops = 2 * non_embed * tokens + attn_flops + head_flops
    return {
        "decode_kv_bytes": kv_bytes_per_token * decode_contexts,
        "non_embed": non_embed,
        # a decode step reads every layer's weights and the whole output projection
        "decode_weight_bytes": 4 * (non_embed + embed),
        "tokens": tokens,
        "flops": flops,
        "flops_without_head": flops - head_flops,
        "attn_share": attn_flops / flops,
        "head_share": head_flops / flops,
    }


def bounds_report(counts, bandwidth, peak, cb_tok_s, cb_span_s, result, workload, gemm_s, matmul) -> tuple[str, dict]:
    """The bounds as text, and their figures for the JSON record."""
    outputs = sum(o for _, o in workload)
    gb_s = max(bandwidth.values())
    step_s = counts["decode_weight_bytes"] / (gb_s * 1e9)
    iters = result.stats.iterations
    floor_tok_s = outputs / (iters * step_s)
    min_iters = max(o for _, o in workload)
    flop_s = counts["flops"] / cb_span_s
    fraction_without_head = counts["flops_without_head"] / cb_span_s / 1e9 / peak
    lines = [
        f"Weight-streaming floor: a decode step reads {counts['decode_weight_bytes'] / 1e6:.0f} MB of f32 weights; "
        f"this machine streams {', '.join(f'{v:.1f} GB/s ({k})' for k, v in bandwidth.items())}; at the best, "
        f"{gb_s:.1f} GB/s, a step takes at least {1e3 * step_s:.1f} ms.",
        f"  cbjax ran {iters} iterations for {outputs} output tokens: floor {floor_tok_s:.0f} tok/s; cbjax "
        f"{cb_tok_s:.0f} tok/s = {cb_tok_s / floor_tok_s:.0%} of it. (At the fewest possible iterations, "
        f"{min_iters} = the longest output: floor {outputs / (min_iters * step_s):.0f} tok/s, "
        f"cbjax at {cb_tok_s * min_iters * step_s / outputs:.0%}.)",
        f"Compute: this machine's XLA f32 matmul at 1024^3 runs {peak:.0f} GFLOP/s (median). cbjax's model work: "
        f"{counts['tokens']} tokens processed x 2 x {counts['non_embed'] / 1e6:.1f} M non-embedding params + "
        f"attention ({counts['attn_share']:.0%}) + the LM head at the {outputs} tokens whose logits "
        f"are needed ({counts['head_share']:.0%}) = {counts['flops'] / 1e9:.1f} GFLOP in {cb_span_s:.2f} s = "
        f"{flop_s / 1e9:.1f} GFLOP/s, {flop_s / 1e9 / peak:.0%} of the matmul peak "
        f"({fraction_without_head:.0%} without the LM head).",
    ]
    floors = {name: sum(n * per_call[b] for b, n in result.bucket_calls.items()) for name, per_call in gemm_s.items()}
    lines.append(
        f"  The GEMMs alone: this run's {sum(result.bucket_calls.values())} steps at their token buckets "
        f"({', '.join(f'{b}: {n}' for b, n in sorted(result.bucket_calls.items()))} calls) take "
        + "; ".join(
            f"{s:.2f} s as {'plain XLA matmuls with each layer its own weights' if name == 'xla' else 'cbjax native matmuls on the stacked weights'} "
            f"(the model work over that time: {counts['flops'] / s / 1e9:.1f} GFLOP/s, {counts['flops'] / s / 1e9 / peak:.0%} "
            f"of the matmul peak)"
            for name, s in floors.items()
        )
        + f": the most an engine running these step shapes through those GEMMs can reach. cbjax (executor.matmul="
        f"{matmul}) spends the other {cb_span_s - floors[matmul]:.2f} s of its {cb_span_s:.2f} s in attention, norms, "
        f"host work and dispatch."
    )
    kv_s = counts["decode_kv_bytes"] / (gb_s * 1e9)
    best = min(floors.values()) + kv_s
    lines.append(
        f"  Attention's KV reads: each decode token reads its whole context's f32 K and V, "
        f"{counts['decode_kv_bytes'] / 1e9:.2f} GB over the run, at least {kv_s:.3f} s at {gb_s:.1f} GB/s (the cache is "
        f"larger than the CPU's caches). The faster GEMM floor plus these reads, {best:.2f} s, bounds this workload at "
        f"{counts['flops'] / best / 1e9:.1f} GFLOP/s, {counts['flops'] / best / 1e9 / peak:.0%} of the matmul peak, with "
        f"norms, host work and dispatch at zero."
    )
    if result.stats.batched_tokens != counts["tokens"]:
        lines.append(f"  note: cbjax scheduled {result.stats.batched_tokens} tokens, not {counts['tokens']} "
                     f"(preemption recomputes?): the FLOP count assumes none")  # fmt: skip
    figures = {
        "streaming_gb_s": bandwidth,
        "weight_floor_tok_s": floor_tok_s,
        "weight_floor_fraction": cb_tok_s / floor_tok_s,
        "matmul_peak_gflop_s": peak,
        "model_gflop": counts["flops"] / 1e9,
        "model_gflop_without_head": counts["flops_without_head"] / 1e9,
        "model_gflop_s": flop_s / 1e9,
        "peak_fraction": flop_s / 1e9 / peak,
        "peak_fraction_without_head": fraction_without_head,
        "gemm_floor_s": floors,
        "gemm_floor_fraction": {name: counts["flops"] / s / 1e9 / peak for name, s in floors.items()},
        "decode_kv_gb": counts["decode_kv_bytes"] / 1e9,
        "bound_s": best,
        "bound_fraction": counts["flops"] / best / 1e9 / peak,
    }
    return "\n".join(lines), figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--requests", type=int, default=None, help="default: 48 (tiny), 24 (smollm)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=32, help="cbjax scheduler.max_num_seqs")
    ap.add_argument("--pages", type=int, default=CacheConfig().num_pages, help="cbjax cache.num_pages (its default)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--stream-mb", type=int, default=1024, help="array size for the bandwidth measurement")
    ap.add_argument("--profile", action="store_true", help="time cbjax's model-step calls in one extra run")
    ap.add_argument("--trace", action="store_true",
                    help="one extra cbjax run under JAX's profiler: op time by kind and the host-only rest")  # fmt: skip
    ap.add_argument("--out", default=str(REPO / "outputs" / "peer_transformers_{shape}.json"),
                    help="the figures as JSON ({shape} is replaced by --shape)")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    num = args.requests or DEFAULT_REQUESTS[args.shape]
    workload = make_workload(num, args.seed, SHAPES[args.shape]["vocab_size"])
    systems = ["cbjax", "transformers CB"] + ([] if args.skip_static else ["transformers static"])
    runs = {name: [] for name in systems}
    outs, warm = {}, {}
    with tempfile.TemporaryDirectory() as model_dir:
        torch_model = make_checkpoint(model_dir, args.shape, args.seed)
        matmul_gflop_s(repeats=1)  # its program compiles now, before cbjax's warmup starts counting compiles
        cb_run, warm["cbjax"], ex, model = cbjax_runner(model_dir, args)
        hf_run, warm["transformers CB"], manager = hf_cb_runner(torch_model, workload)
        try:
            if not args.skip_static:
                st_run, warm["transformers static"] = hf_static_runner(torch_model, workload)
            spans, results, peaks = [], [], []
            for _ in range(args.repeats):  # the systems side by side, under the same load
                tok_s, outs["cbjax"], result = cb_run(workload)
                runs["cbjax"].append(tok_s)
                spans.append(result.makespan_s)
                results.append(result)
                # the matmul peak right after the run, in the same phase of a VM whose speed drifts
                peaks.append(matmul_gflop_s(repeats=10))
                tok_s, outs["transformers CB"] = hf_run(workload)
                runs["transformers CB"].append(tok_s)
                if not args.skip_static:
                    tok_s, outs["transformers static"] = st_run(workload)
                    runs["transformers static"].append(tok_s)
            profile = profile_cbjax(cb_run, ex, workload) if args.profile else None
            trace = trace_cbjax(cb_run, ex, workload, args.slots) if args.trace else None
            m = ex.metrics()  # before the bounds below compile their own programs
        finally:
            manager.stop(block=True, timeout=10)
    bandwidth = streaming_gb_s(args.stream_mb)
    peak = matmul_gflop_s()
    mid = sorted(range(len(spans)), key=spans.__getitem__)[len(spans) // 2]  # the median cbjax run
    kinds = ["xla"] + (["native"] if m["matmul"] == "native" else [])
    gemm_s = {kind: gemm_floor_s(model, results[mid].bucket_calls, args.slots, kind) for kind in kinds}

    ref = outs["cbjax"]
    identical = {name: sum(a == b for a, b in zip(outs[name], ref)) for name in systems}
    paired = {name: [a / b for a, b in zip(runs["cbjax"], runs[name])] for name in systems[1:]}
    base = statistics.median(runs["transformers CB"])
    rows = []
    for name, values in runs.items():
        med = statistics.median(values)
        rows.append((name, f"{med:.0f}", f"{min(values):.0f}-{max(values):.0f}", f"{med / base:.2f}x",
                     f"{identical[name]}/{len(ref)}", f"{warm[name]:.1f}"))  # fmt: skip
    total = sum(o for _, o in workload)
    prompts = [len(p) for p, _ in workload]
    print(f"--shape {args.shape}: {num} requests (prompts {min(prompts)}-{max(prompts)} tokens, {total} output tokens, "
          f"exponential mean 64), greedy, ignore_eos; torch {torch.__version__} on {torch.get_num_threads()} "
          f"threads, {os.cpu_count()} CPUs; cbjax {args.slots} slots, {args.pages} pages, default executor "
          f"(token buckets {list(ex.shapes.token_buckets)}); medians of {args.repeats}, warmup excluded")  # fmt: skip
    print(markdown_table(
        ["system", "tok/s (median)", "range", "vs transformers CB", "outputs identical to cbjax", "warmup s"], rows
    ))  # fmt: skip
    for name, ratios in paired.items():
        print(f"cbjax / {name} per repeat: {', '.join(f'{r:.2f}x' for r in ratios)}; "
              f"median {statistics.median(ratios):.2f}x")  # fmt: skip

    result = results[mid]
    stats = result.stats
    print(f"\ncbjax median run: {stats.iterations} iterations, {m['device_calls_per_iteration']:.2f} model-step calls "
          f"per iteration, {result.makespan_s:.2f} s serving: device wait {result.device_wait_s:.2f} s, host "
          f"{stats.schedule_s + stats.postprocess_s:.2f} s scheduler + {result.host_pack_s:.2f} s packing; warmup "
          f"{m['warmup_s']:.1f} s for {m['compiled_programs']} programs; compiles after warmup "
          f"{m['compiles_after_warmup']}; step calls by bucket (all runs) {m['bucket_calls']}")  # fmt: skip
    counts = model_counts(torch_model, model, workload)
    text, figures = bounds_report(counts, bandwidth, peak, runs["cbjax"][mid], result.makespan_s, result, workload,
                                  gemm_s, m["matmul"])  # fmt: skip
    shares = [counts["flops"] / span / 1e9 / p for span, p in zip(spans, peaks)]
    figures["paired_peaks_gflop_s"] = peaks
    figures["paired_peak_fractions"] = shares
    figures["paired_peak_fraction_median"] = statistics.median(shares)
    text += (
        f"\n  Each run against the matmul peak measured right after it (the VM's speed drifts between phases): "
        f"{', '.join(f'{f:.0%} ({p:.0f} GFLOP/s, {span:.2f} s)' for f, p, span in zip(shares, peaks, spans))}; "
        f"median {statistics.median(shares):.0%} of the matmul peak."
    )
    print("\n" + text)
    if profile:
        print("\nWhere cbjax's time goes (one extra run, each model step timed to completion):\n" + profile)
    if trace:
        print("\nWhere cbjax's time goes by op kind (one extra run, traced):\n" + trace[0])
    record = {
        "args": vars(args),
        "requests": num,
        "output_tokens": total,
        "tok_s": runs,
        "median_tok_s": {name: statistics.median(v) for name, v in runs.items()},
        "paired_ratio": paired,
        "outputs_identical": identical,
        "warmup_s": warm,
        "cbjax_median_run": {
            "iterations": stats.iterations, "makespan_s": result.makespan_s, "device_wait_s": result.device_wait_s,
            "host_pack_s": result.host_pack_s, "bucket_calls": result.bucket_calls,
        },
        "cbjax_metrics": m,
        "bounds": figures,
        "trace": trace[1] if trace else None,
    }
    out = Path(args.out.format(shape=args.shape))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
