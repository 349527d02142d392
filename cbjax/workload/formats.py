"""Readers for public trace formats researchers bring: BurstGPT's CSV and Mooncake's JSONL.

BurstGPT (Wang et al., 2024; github.com/HPMLL/BurstGPT): a CSV with the columns `Timestamp`
(seconds from 0:00 on the trace's first day), `Model` (ChatGPT or GPT-4), `Request tokens`,
`Response tokens`, `Total tokens` and `Log Type` (Conversation log or API log). A request's
arrival is its Timestamp minus the earliest one; its client is its Model. The files with
failures hold lines whose `Response tokens` is 0: those requests failed in the trace and are
rejected by name here, not served as zero-length requests.

Mooncake (Qin et al., FAST'25; github.com/kvcache-ai/Mooncake): JSONL lines of `timestamp`
(milliseconds since the first request), `input_length`, `output_length` and `hash_ids`, one
id per block of `workload.hash_block_size` prompt tokens (512 in Mooncake's release): two
requests whose `hash_ids` share a leading run share that prompt prefix. Each block's tokens
are drawn from a stream seeded by (run seed, hash id), so equal ids give equal tokens and the
prefix cache can hit; a request's last block is cut to its `input_length`.

The Azure LLM inference traces of 2023 and 2024 share one schema (TIMESTAMP, ContextTokens,
GeneratedTokens) and are read by `cbjax.workload.trace`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cbjax.workload.rows import (
    LineError, _attempt, _json_float, _json_int, _json_object, _Row, _text_float, _text_int,
)

BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def burstgpt_rows(body: list[tuple[int, str]], order: list[str]) -> list[_Row]:
    """Rows of BurstGPT's CSV lines (after the header, whose column order is `order`)."""
    rows, stamps = [], []
    for n, text in body:
        row = _Row(line=n)
        fields = [f.strip() for f in text.split(",")]
        stamp = None
        if len(fields) != len(order):
            row.errors.append(f"expected {len(order)} fields ({','.join(order)}), got {len(fields)}")
        else:
            f = dict(zip(order, fields))
            stamp = _attempt(row, _text_float, "Timestamp", f["Timestamp"])
            row.prompt_len = _attempt(row, _text_int, "Request tokens", f["Request tokens"])
            row.output_len = _attempt(row, _text_int, "Response tokens", f["Response tokens"])
            total = _attempt(row, _text_int, "Total tokens", f["Total tokens"])
            if f["Model"]:
                row.client_id = f["Model"]
            if row.output_len == 0:
                row.errors.append("Response tokens 0: the request failed in the trace")
            if None not in (total, row.prompt_len, row.output_len) and total != row.prompt_len + row.output_len:
                row.errors.append(
                    f"Total tokens {total} is not Request tokens {row.prompt_len} + Response tokens {row.output_len}"
                )
        rows.append(row)
        stamps.append(stamp)
    valid = [s for s in stamps if s is not None]
    if valid:
        first = min(valid)
        for row, stamp in zip(rows, stamps):
            if stamp is not None:
                row.arrival_s = stamp - first
    return rows


def mooncake_rows(body: list[tuple[int, str]], block_size: int, vocab_size: int, seed: int) -> list[_Row]:
    """Rows of Mooncake JSONL lines, prompts built from their hash blocks."""
    blocks: dict[int, np.ndarray] = {}
    rows = []
    for n, text in body:
        row = _Row(line=n)
        obj = _json_object(row, text)
        if obj is not None:
            _mooncake_fields(row, obj)
            hash_ids = obj.get("hash_ids")
            if row.prompt_len is not None and isinstance(hash_ids, list):
                ids = _attempt(row, _hash_ids, hash_ids, row.prompt_len, block_size)
                if ids is not None:
                    row.prompt_token_ids = prompt_from_blocks(ids, row.prompt_len, block_size, vocab_size, seed, blocks)
            elif "hash_ids" in obj:
                row.errors.append(f"hash_ids must be a list of integers, got {type(hash_ids).__name__}")
        rows.append(row)
    return rows


def prompt_from_blocks(
    hash_ids: list[int], length: int, block_size: int, vocab_size: int, seed: int, cache: dict[int, np.ndarray]
) -> list[int]:
    """`length` prompt tokens: block i is hash id i's tokens (seeded by (seed, id)), the last cut."""
    out: list[int] = []
    for hid in hash_ids:
        if hid not in cache:
            cache[hid] = np.random.default_rng((seed, hid)).integers(0, vocab_size, block_size)
        out.extend(int(t) for t in cache[hid][: length - len(out)])
    return out


def _mooncake_fields(row: _Row, obj: dict[str, Any]) -> None:
    unknown = [key for key in obj if key not in MOONCAKE_KEYS]
    if unknown:
        row.errors.append(f"unknown key {unknown[0]!r}; a Mooncake line has {', '.join(MOONCAKE_KEYS)}")
    for key in MOONCAKE_KEYS:
        if key not in obj:
            row.errors.append(f"{key} is missing")
    if "timestamp" in obj:
        ms = _attempt(row, _json_float, "timestamp", obj["timestamp"])
        row.arrival_s = None if ms is None else ms / 1000.0
    if "input_length" in obj:
        row.prompt_len = _attempt(row, _json_int, "input_length", obj["input_length"])
    if "output_length" in obj:
        row.output_len = _attempt(row, _json_int, "output_length", obj["output_length"])


def _hash_ids(value: list[Any], length: int, block_size: int) -> list[int]:
    for i, hid in enumerate(value):
        # A hash id seeds its block's tokens, and a seed must be a non-negative integer.
        if isinstance(hid, bool) or not isinstance(hid, int) or hid < 0:
            raise LineError(f"hash_ids[{i}] {hid!r} is not a hash id (an integer >= 0)")
    need = -(-length // block_size)
    if len(value) != need:
        raise LineError(
            f"hash_ids has {len(value)} blocks, input_length {length} needs {need} of {block_size} tokens "
            "(workload.hash_block_size)"
        )
    return value
