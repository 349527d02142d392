"""Benchmark: the XLA ragged attention of a git ref (default main) against this checkout's, in one process.

    python benchmarks/attention_ab.py [--old-ref main] [--repeats 20] [--scenarios decode,prefill,mixed]

The peer "tiny" shape of `benchmarks/peer_transformers.py` (8 query / 4 kv heads, head_dim 32,
page 16, 32 slots, 4096 pages, max_model_len 2048), one layer of a 4-layer cache read through
`layer=` as the model step does. Scenarios: `decode` (32 rows, one token each, context 150,
bucket 32), `mixed32` (12 decodes at 200 and a 20-token chunk after 200 cached tokens),
`mixed128` (28 decodes at 200 and a 100-token chunk after 200), `prefill` (32 rows of 100 new
tokens, bucket 4096), `mixed` (28 decodes at 150 plus 4 prefills of 100 tokens, bucket 512). For each, both kernels are jitted alone, compiled
(CPU seconds of the compile, `time.process_time`), checked against each other, then timed
interleaved; the table shows median ms per layer call and old / new. The old kernel and its
tile builder are loaded from `git show REF:path`: a ref with the query groups of
`cbjax.layout.tiles` (main since they were merged), or the tile layout before them
(`--old-ref c43e2d6`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.kernels import xla_ragged as new_kernel
from cbjax.kernels.metadata import AttentionMetadata
from cbjax.report.tables import markdown_table
from cbjax.layout import tiles as new_tiles

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(layers=4, kv_heads=4, heads=8, head_dim=32, page_size=16, num_pages=4096, rows=32, max_model_len=2048)
SCENARIOS = {  # name: (token bucket, [(kv_len, num_new)] per row)
    "decode": (32, [(150, 1)] * 32),
    "mixed32": (32, [(200, 1)] * 12 + [(220, 20)]),
    "mixed128": (128, [(200, 1)] * 28 + [(300, 100)]),
    "prefill": (4096, [(100, 100)] * 32),
    "mixed": (512, [(150, 1)] * 28 + [(100, 100)] * 4),
}


def load_old(ref: str, name: str, path: str) -> types.ModuleType:
    src = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclasses look their module up while registering
    exec(compile(src, f"{ref}:{path}", "exec"), mod.__dict__)
    return mod


def make_batch(bucket: int, rows: list[tuple[int, int]], rng: np.random.Generator) -> dict:
    """Host metadata for `rows` in the fixed slot array, pages drawn at random from the pool."""
    s = SHAPE
    max_pages = s["max_model_len"] // s["page_size"]
    page_table = np.zeros((s["rows"], max_pages), np.int32)
    perm = rng.permutation(np.arange(1, s["num_pages"]))
    query_start = np.zeros(s["rows"] + 1, np.int32)
    kv_lens = np.zeros(s["rows"], np.int32)
    token_row = np.zeros(bucket, np.int32)
    token_pos = np.full(bucket, -1, np.int32)
    t = used = 0
    for r, (kv, n) in enumerate(rows):
        need = -(-kv // s["page_size"])
        page_table[r, :need] = perm[used : used + need]
        used += need
        kv_lens[r] = kv
        token_row[t : t + n] = r
        token_pos[t : t + n] = np.arange(kv - n, kv)
        t += n
        query_start[r + 1] = t
    query_start[len(rows) + 1 :] = t
    return dict(page_table=page_table, query_start=query_start, kv_lens=kv_lens, token_row=token_row,
                token_pos=token_pos, max_pages=max_pages)  # fmt: skip


def metadata(h: dict, work) -> AttentionMetadata:
    fields = ("page_table", "query_start", "kv_lens", "token_row", "token_pos")
    return AttentionMetadata(*(jnp.asarray(h[f]) for f in fields), work=work)


def old_md(old_k, old_t, bucket: int, h: dict) -> AttentionMetadata:
    if hasattr(old_t, "count_steps"):  # a ref with the query-group layout: built as this checkout's
        return new_md(bucket, h, old_k, old_t)
    chunks = (old_t.CHUNK_SINGLE, old_t.CHUNK_BLOCK)
    cap = old_t.tile_capacity(bucket, SHAPE["rows"], h["max_pages"], old_t.BLOCK_Q, chunks)
    single, block = old_t.build_tiles(
        h["query_start"], h["kv_lens"], h["page_table"], bucket, SHAPE["page_size"], old_t.BLOCK_Q, cap
    )
    work = old_k.RaggedWork(old_k.Tiles(*map(jnp.asarray, single)), old_k.Tiles(*map(jnp.asarray, block)))
    return metadata(h, work)


def new_md(bucket: int, h: dict, kernel=new_kernel, t=new_tiles) -> AttentionMetadata:
    """Query groups as `t` (a tiles module, default this checkout's) lays them out for `kernel`."""
    cap = t.tile_capacity(bucket, SHAPE["rows"], t.BLOCK_Q, (t.CHUNK_SINGLE, t.block_chunk(bucket)))
    single, block = t.build_tiles(h["query_start"], h["kv_lens"], bucket, SHAPE["page_size"], t.BLOCK_Q, cap)
    work = kernel.RaggedWork(*(kernel.Tiles(*map(jnp.asarray, lists)) for lists in (single, block)))
    return metadata(h, work)


def compiled(fn, *args):
    """(executable, CPU seconds of its compile)."""
    lowered = jax.jit(fn).lower(*args)
    t0 = time.process_time()
    exe = lowered.compile()
    return exe, time.process_time() - t0


def timed(exe, args) -> float:
    t0 = time.perf_counter()
    exe(*args).block_until_ready()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-ref", default="main")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = ap.parse_args()
    old_k = load_old(args.old_ref, "old_xla_ragged", "cbjax/kernels/xla_ragged.py")
    old_t = load_old(args.old_ref, "old_tiles", "cbjax/runtime/tiles.py")
    s = SHAPE
    rng = np.random.default_rng(0)
    cache_shape = (s["layers"], s["kv_heads"], s["num_pages"], s["page_size"], s["head_dim"])
    k = jnp.asarray(rng.standard_normal(cache_shape, np.float32))
    v = jnp.asarray(rng.standard_normal(cache_shape, np.float32))
    layer = jnp.int32(2)
    if hasattr(old_t, "count_steps"):  # the query-group kernel takes pages per inner step
        old_fn = lambda q, k, v, md, layer: old_k.ragged_attention_xla(  # noqa: E731
            q, k, v, md, layer=layer, pages_single=old_t.PAGES_SINGLE, pages_block=old_t.PAGES_BLOCK
        )
    else:  # the tile kernel before it (c43e2d6 and earlier) takes chunk sizes
        old_fn = lambda q, k, v, md, layer: old_k.ragged_attention_xla(  # noqa: E731
            q, k, v, md, layer=layer, chunk_single=old_t.CHUNK_SINGLE, chunk_block=old_t.CHUNK_BLOCK
        )
    new_fn = lambda q, k, v, md, layer: new_kernel.ragged_attention_xla(  # noqa: E731
        q, k, v, md, layer=layer, pages_single=new_tiles.PAGES_SINGLE, pages_block=new_tiles.PAGES_BLOCK
    )
    table, seen = [], set()
    for name in args.scenarios.split(","):
        bucket, rows = SCENARIOS[name]
        h = make_batch(bucket, rows, rng)
        q = jnp.asarray(rng.standard_normal((bucket, s["heads"], s["head_dim"]), np.float32))
        old_args = (q, k, v, old_md(old_k, old_t, bucket, h), layer)
        new_args = (q, k, v, new_md(bucket, h), layer)
        old_exe, old_compile = compiled(old_fn, *old_args)
        new_exe, new_compile = compiled(new_fn, *new_args)
        diff = float(jnp.max(jnp.abs(old_exe(*old_args) - new_exe(*new_args))))
        old_t_s, new_t_s = [], []
        for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
            old_t_s.append(timed(old_exe, old_args))
            new_t_s.append(timed(new_exe, new_args))
        old_ms, new_ms = 1e3 * statistics.median(old_t_s), 1e3 * statistics.median(new_t_s)
        # jax reuses a bucket's program compiled for an earlier scenario: no compile to show
        compile_s = ("same program", "same program") if bucket in seen else (f"{old_compile:.2f}", f"{new_compile:.2f}")
        seen.add(bucket)
        table.append([name, bucket, f"{old_ms:.2f}", f"{new_ms:.2f}", f"{old_ms / new_ms:.2f}", *compile_s, f"{diff:.1e}"])
        print(f"{name}: old {old_ms:.2f} ms, new {new_ms:.2f} ms per layer", file=sys.stderr, flush=True)
    head = ["scenario", "bucket", "old ms/layer", "new ms/layer", "old/new", "old compile CPU s",
            "new compile CPU s", "max |old-new|"]  # fmt: skip
    print(markdown_table(head, table))


if __name__ == "__main__":
    main()
