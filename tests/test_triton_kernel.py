"""The Triton paged-attention kernel body, run by Triton's CPU interpreter, against numpy."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import REPO

# Triton's interpreter must be switched on before triton is imported, so the kernel runs in a
# subprocess; it takes torch tensors (the CPU wheel from the test extra).
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    from cbjax.kernels.triton_paged_attention import _paged_attention_kernel, kernel_params
    case = json.loads(sys.argv[1])
    rng = np.random.default_rng(case["seed"])
    num_slots, num_heads, num_kv, head_dim, page_size, num_pages, max_pages = (
        case[k] for k in ("slots", "heads", "kv_heads", "head_dim", "page_size", "num_pages", "max_pages"))
    q = rng.standard_normal((num_slots, num_heads, head_dim), dtype=np.float32)
    k = np.full((num_kv, num_pages, page_size, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    lengths = np.array(case["lengths"], np.int32)
    table = rng.permutation(np.arange(1, num_pages))[: num_slots * max_pages].reshape(num_slots, max_pages).astype(np.int32)
    for s, n in enumerate(lengths):  # only the positions below each length hold numbers
        for pos in range(n):
            page, off = table[s, pos // page_size], pos % page_size
            k[:, page, off] = rng.standard_normal((num_kv, head_dim))
            v[:, page, off] = rng.standard_normal((num_kv, head_dim))
    out = torch.zeros(q.shape)
    args = [torch.from_numpy(x) for x in (q, k, v, table, lengths)]
    _paged_attention_kernel[(num_slots, num_kv)](*args, out, **kernel_params(q.shape, k.shape, table.shape, None))
    np.savez(case["out"], q=q, k=k, v=v, table=table, lengths=lengths, out=out.numpy())
    """
)


def dense_reference(q, k, v, table, lengths):
    num_slots, num_heads, head_dim = q.shape
    num_kv, _, page_size, _ = k.shape
    group = num_heads // num_kv
    out = np.zeros_like(q, dtype=np.float64)
    for s, n in enumerate(lengths):
        pos = np.arange(n)
        pages, offs = table[s, pos // page_size], pos % page_size
        for h in range(num_heads):
            keys = k[h // group, pages, offs].astype(np.float64)  # [n, head_dim]
            vals = v[h // group, pages, offs].astype(np.float64)
            if n:
                w = np.exp((keys @ q[s, h]) / np.sqrt(head_dim) - (keys @ q[s, h] / np.sqrt(head_dim)).max())
                out[s, h] = (w / w.sum()) @ vals
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,lengths",
    [(4, 4, [0, 1, 8, 13]), (4, 2, [5, 16, 3, 0]), (8, 2, [24, 7, 1, 9]), (6, 2, [11, 4, 0, 20])],
)
def test_triton_kernel_matches_dense_reference(tmp_path, heads, kv_heads, lengths):
    pytest.importorskip("triton", reason="triton comes with the test extra on x86-64 Linux")
    case = dict(slots=4, heads=heads, kv_heads=kv_heads, head_dim=16, page_size=4, num_pages=40, max_pages=6,
                lengths=lengths, seed=heads + kv_heads, out=str(tmp_path / "out.npz"))  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))

    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(case)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = np.load(case["out"])
    assert np.isfinite(r["out"]).all()  # NaN in every unread page never leaks
    np.testing.assert_allclose(r["out"], dense_reference(r["q"], r["k"], r["v"], r["table"], r["lengths"]), atol=1e-5, rtol=1e-5)
    assert not r["out"][np.array(lengths) == 0].any()  # empty slots give exact zeros
