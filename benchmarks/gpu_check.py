"""GPU check: compiled ragged kernel vs reference, decode HBM bandwidth.

    python benchmarks/gpu_check.py kernel --out DIR     # (1) and (2), appended to DIR/gpu_check.md
    python benchmarks/gpu_check.py engine --out DIR --summary FILE --overrides ...  # (3): report a run

`benchmarks/gpu_check.sh` runs both, each section guarded so a failure in one still
reports the others. With no GPU visible to JAX, `kernel` prints so and exits 0.

(1) `ragged_paged_attention` compiled for the GPU (Triton lowering) against the jnp
    reference and the float64 oracle on a few mixed batches, f32 and bf16, with the test
    suite's tolerances (f32 1e-5, bf16 2e-2; atol = rtol).
(2) Decode attention (one new token per row, long contexts) timed as back-to-back jitted
    calls; bandwidth = bytes of K/V pages the rows hold / time per call, as a fraction of
    the H200 datasheet's 4.8 TB/s. The jnp reference and a plain device copy are timed
    beside it for scale (the copy counts bytes read plus written).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # ragged_cases: the shared cases and float64 oracle
DATASHEET_BW = 4.8e12  # H200 SXM HBM3e, bytes/s (configs/hardware/h200.yaml)
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}

# (1): (name, rows as (kv_len, new tokens), kv heads, group, head_dim, block_q); page_size 16.
KERNEL_SHAPES = [
    ("mixed d128 g4", [(300, 1), (17, 1), (64, 64), (200, 37), (33, 9), (0, 0)], 2, 4, 128, 8),
    ("decode d64 g1", [(n, 1) for n in (1, 15, 16, 17, 255, 256, 700, 1000)], 4, 1, 64, 1),
    ("prefill+chunk d64 g8", [(128, 128), (96, 31), (16, 16), (513, 100)], 1, 8, 64, 16),
]
# (2): (name, rows, context, kv heads, group, head_dim, [(block_q, pages_per_block)]).
DECODE_SHAPES = [
    ("1B-class (8 kv heads x 64, group 4)", 256, 2048, 8, 4, 64, [(1, 4), (1, 8), (8, 8)]),
    ("8B-class (8 kv heads x 128, group 4)", 128, 4096, 8, 4, 128, [(1, 4), (1, 8)]),
]


def _md(out: Path, text: str) -> None:
    print(text, flush=True)
    with open(out / "gpu_check.md", "a") as f:
        f.write(text + "\n")


def _guarded(out: Path, title: str, fn) -> dict:
    _md(out, f"\n## {title}\n")
    try:
        return fn()
    except Exception:  # noqa: BLE001: report and carry on with the next section
        _md(out, "FAILED:\n\n```\n" + traceback.format_exc()[-4000:] + "```")
        return {"error": traceback.format_exc(limit=1)}


def _metadata(case):
    import jax.numpy as jnp

    from cbjax.kernels.metadata import AttentionMetadata

    return AttentionMetadata(
        *(jnp.asarray(case[n]) for n in ("page_table", "query_start", "kv_lens", "token_row", "token_pos"))
    )


def check_kernel(out: Path) -> dict:
    import jax
    import jax.numpy as jnp

    from cbjax.kernels.pallas_ragged import ragged_paged_attention
    from cbjax.kernels.reference import ragged_attention_reference
    from ragged_cases import make_case, oracle

    reference = jax.jit(ragged_attention_reference)
    _md(out, "| shape | dtype | max abs err vs reference | vs float64 oracle | tolerance | ok |")
    _md(out, "|---|---|---|---|---|---|")
    results, all_ok = [], True
    for name, rows, kvh, group, head_dim, block_q in KERNEL_SHAPES:
        num_tokens = -(-sum(n for _, n in rows) // 16) * 16 + 16  # padding tokens too
        case = make_case(rows, num_kv_heads=kvh, group=group, head_dim=head_dim, page_size=16,
                         num_tokens=num_tokens, num_rows=len(rows) + 2, seed=len(results))  # fmt: skip
        md = _metadata(case)
        for dtype in ("float32", "bfloat16"):
            q, k, v = (jnp.asarray(case[n], dtype) for n in ("q", "k_pages", "v_pages"))
            got = ragged_paged_attention(q, k, v, md, block_q=block_q)
            got = np.asarray(got.astype(jnp.float32))
            ref = np.asarray(reference(q, k, v, md).astype(jnp.float32))
            # The oracle sees the same rounded inputs as the kernel.
            rnd = lambda x, dtype=dtype: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
            exact = oracle(dict(case, q=rnd(case["q"]), dense_k=[rnd(x) for x in case["dense_k"]],
                                dense_v=[rnd(x) for x in case["dense_v"]]))  # fmt: skip
            tol = TOLERANCE[dtype]
            ok = bool(
                np.isfinite(got).all()
                and np.allclose(got, ref, atol=tol, rtol=tol)
                and np.allclose(got, exact, atol=tol, rtol=tol)
            )
            all_ok &= ok
            err_ref, err_exact = float(np.abs(got - ref).max()), float(np.abs(got - exact).max())
            results.append(dict(shape=name, dtype=dtype, err_ref=err_ref, err_oracle=err_exact, ok=ok))
            _md(out, f"| {name} | {dtype} | {err_ref:.2e} | {err_exact:.2e} | {tol:g} | {'yes' if ok else 'NO'} |")
    return {"cases": results, "all_ok": all_ok}


def _time_per_call(fn, *args, calls: int = 20, trials: int = 5) -> float:
    """Median over trials of (time of `calls` back-to-back calls) / calls, after warmup."""
    import jax

    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def decode_bandwidth(out: Path) -> dict:
    import jax
    import jax.numpy as jnp

    from cbjax.kernels.metadata import AttentionMetadata
    from cbjax.kernels.pallas_ragged import ragged_paged_attention
    from cbjax.kernels.reference import ragged_attention_reference

    page_size = 16
    _md(out, f"Decode: one new token per row, page_size {page_size}, bf16. Bytes = K and V pages the rows hold.\n")
    _md(out, "| shape | rows x context | K/V bytes | impl | ms/call | TB/s | of 4.8 TB/s |")
    _md(out, "|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    results = []
    for name, rows, context, kvh, group, head_dim, tilings in DECODE_SHAPES:
        pages_per_row = -(-context // page_size)
        num_pages = rows * pages_per_row + 1
        key = jax.random.PRNGKey(0)
        shape = (kvh, num_pages, page_size, head_dim)
        k_pages = jax.random.normal(key, shape, jnp.bfloat16)
        v_pages = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.bfloat16)
        q = jax.random.normal(jax.random.fold_in(key, 2), (rows, kvh * group, head_dim), jnp.bfloat16)
        table = (1 + rng.permutation(num_pages - 1)).reshape(rows, pages_per_row).astype(np.int32)
        md = AttentionMetadata(
            page_table=jnp.asarray(table),
            query_start=jnp.arange(rows + 1, dtype=jnp.int32),
            kv_lens=jnp.full((rows,), context, jnp.int32),
            token_row=jnp.arange(rows, dtype=jnp.int32),
            token_pos=jnp.full((rows,), context - 1, jnp.int32),
        )
        kv_bytes = 2 * rows * pages_per_row * page_size * kvh * head_dim * 2
        impls = [
            (f"pallas block_q={bq} pages_per_block={ppb}",
             jax.jit(functools.partial(ragged_paged_attention, block_q=bq, pages_per_block=ppb)))
            for bq, ppb in tilings
        ] + [("jnp reference", jax.jit(ragged_attention_reference))]  # fmt: skip
        for impl, fn in impls:
            try:
                t = _time_per_call(fn, q, k_pages, v_pages, md)
            except Exception as err:  # noqa: BLE001: one tiling failing must not hide the others
                _md(out, f"| {name} | {rows} x {context} | {kv_bytes / 1e9:.2f} GB | {impl} | failed: "
                         f"{type(err).__name__}: {str(err)[:200]} | | |")  # fmt: skip
                continue
            bw = kv_bytes / t
            results.append(dict(shape=name, impl=impl, ms=t * 1e3, bytes=kv_bytes, tb_s=bw / 1e12,
                                fraction=bw / DATASHEET_BW))  # fmt: skip
            _md(out, f"| {name} | {rows} x {context} | {kv_bytes / 1e9:.2f} GB | {impl} | {t * 1e3:.3f} "
                     f"| {bw / 1e12:.2f} | {bw / DATASHEET_BW:.1%} |")  # fmt: skip
        del k_pages, v_pages

    x = jnp.ones((1 << 30,), jnp.bfloat16)  # 2 GiB
    t = _time_per_call(jax.jit(lambda a: a + 1), x)
    copy_bw = 2 * x.nbytes / t
    _md(out, f"\nPlain device copy (x + 1 over 2 GiB, read + write): {copy_bw / 1e12:.2f} TB/s, "
             f"{copy_bw / DATASHEET_BW:.1%} of the datasheet.")  # fmt: skip
    return {"decode": results, "copy_tb_s": copy_bw / 1e12}


def engine(out: Path, summary_path: Path, overrides: list) -> dict:
    """Report the engine run's summary.json (the run itself is gpu_check.sh's, in a fresh process)."""
    _md(out, "`cbjax " + " ".join(overrides) + "`\n")
    if not summary_path.is_file():
        log = out / "engine.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.is_file() else "(no engine.log)"
        _md(out, f"No {summary_path.name}: the engine run failed or timed out. engine.log ends:\n\n```\n{tail}\n```")
        return {"error": "no summary.json"}
    summary = json.loads(summary_path.read_text())
    keys = ["throughput_tok_s", "iterations", "num_finished", "makespan_s", "mean_batch_size", "warmup_s",
            "compiled_programs", "device_calls_per_iteration", "compiles_after_warmup", "tpot_s_p50",
            "ttft_s_p50"]  # fmt: skip
    _md(out, "| metric | value |\n|---|---|")
    for key in keys:
        if key in summary:
            _md(out, f"| {key} | {summary[key]} |")
    return {k: summary[k] for k in keys if k in summary}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=["kernel", "engine"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--summary", type=Path, help="engine: the run's summary.json")
    parser.add_argument("--overrides", nargs=argparse.REMAINDER, default=[], help="engine: the cbjax overrides run")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "gpu_check.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}

    if args.section == "kernel":
        import jax

        if jax.default_backend() != "gpu":
            print(f"gpu_check: JAX sees no GPU (backend {jax.default_backend()!r}); no device available, nothing run.")
            return 0
        device = jax.devices()[0]
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        _md(args.out, f"# GPU check\n\njax {jax.__version__} on {device.device_kind}, {when}")
        results["device"] = device.device_kind
        results["kernel_vs_reference"] = _guarded(
            args.out, "(1) Compiled kernel vs reference", lambda: check_kernel(args.out)
        )
        results["decode_bandwidth"] = _guarded(
            args.out, "(2) Decode attention HBM bandwidth", lambda: decode_bandwidth(args.out)
        )
    else:
        results["engine"] = _guarded(
            args.out, "(3) Engine tok/s, random 1B-class Llama", lambda: engine(args.out, args.summary, args.overrides)
        )
    results_path.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
