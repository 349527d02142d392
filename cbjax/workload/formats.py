"""Readers for public trace formats researchers bring: the Azure LLM inference CSVs, BurstGPT's
CSV and Mooncake's JSONL (ShareGPT's conversations: `cbjax.workload.sharegpt`).

BurstGPT (Wang et al., 2024; github.com/HPMLL/BurstGPT): a CSV with the columns `Timestamp`
(seconds from 0:00 on the trace's first day), `Model` (ChatGPT or GPT-4), `Request tokens`,
`Response tokens`, `Total tokens` and `Log Type` (Conversation log or API log). A request's
arrival is its Timestamp minus the earliest one; its client is its Model. The files with
failures hold lines whose `Response tokens` is 0: those requests failed in the trace and are
rejected by name here, not served as zero-length requests.

BurstGPT's conversation releases add the columns `SessionID` and `Elapsed time` (seconds the
request took to serve). Lines of one session, in file order, are its turns. The first turn
arrives at its Timestamp; each later one `pause_s` after the turn before it ends, the pause
being its Timestamp minus that turn's Timestamp and Elapsed time (at least 0). `Request tokens`
counts the whole prompt a chat service sends, the conversation so far and the new message: a
later turn's new input is its Request tokens minus the turn before's Request and Response
tokens (at least 1), so that the served prompt, the conversation so far plus the new input,
has the trace's length.

Mooncake (Qin et al., FAST'25; github.com/kvcache-ai/Mooncake): JSONL lines of `timestamp`
(milliseconds since the first request), `input_length`, `output_length` and `hash_ids`, one
id per block of `workload.hash_block_size` prompt tokens (512 in Mooncake's release): two
requests whose `hash_ids` share a leading run share that prompt prefix. Each block's tokens
are drawn from a stream seeded by (run seed, hash id), so equal ids give equal tokens and the
prefix cache can hit; a request's last block is cut to its `input_length`. Its conversation
and tool-agent traces are read the same way: a conversation's turns share their history's
hash ids, and arrive at their timestamps. A line may carry a `session_id` (a string or an
integer): its lines, in file order, are then that session's turns in the outputs.

The Azure LLM inference traces of 2023 and 2024 share one schema (TIMESTAMP, ContextTokens,
GeneratedTokens). A request arrives at its TIMESTAMP minus the earliest one.
"""

from __future__ import annotations

import math
import re
from datetime import date
from typing import Any, Optional

import numpy as np

from cbjax.workload.rows import (
    LineError, _attempt, _json_float, _json_id, _json_int, _json_object, _Row, _split, _text_float, _text_int,
)

BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
BURSTGPT_SESSION_COLUMNS = ("SessionID", "Elapsed time")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE_OPTIONAL_KEYS = ("session_id",)
# 2023-11-16 18:17:03.9799600: up to 9 fractional digits (datetime takes 6), optional UTC offset.
_TIMESTAMP = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?\s*(Z|[+-]\d{2}:?\d{2})?"
)


def parse_timestamp(text: str) -> tuple[int, float]:
    """Whole seconds since 0001-01-01 UTC and the fraction, kept apart so no digit is lost."""
    m = _TIMESTAMP.fullmatch(text.strip())
    if m is None:
        raise LineError(f"TIMESTAMP {text!r} is not a timestamp like 2023-11-16 18:17:03.9799600")
    day, hh, mm, ss, frac, tz = m.groups()
    hours, minutes, secs = int(hh), int(mm), int(ss)
    try:
        days = date.fromisoformat(day).toordinal()
    except ValueError:
        days = -1
    if days < 0 or hours > 23 or minutes > 59 or secs > 59:
        raise LineError(f"TIMESTAMP {text!r} is not a valid date and time")
    whole = days * 86400 + hours * 3600 + minutes * 60 + secs
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        whole -= sign * (int(tz[1:3]) * 3600 + int(tz[-2:]) * 60)
    return whole, (int(frac) / 10 ** len(frac) if frac else 0.0)


def azure_rows(body: list[tuple[int, str]], order: list[str]) -> list[_Row]:
    """Rows of the Azure CSVs' lines (after the header, whose column order is `order`)."""
    rows, stamps = [], []
    for n, text in body:
        row, f = _split(n, text, order)
        stamp = None
        if f:
            stamp = _attempt(row, parse_timestamp, f["TIMESTAMP"])
            row.prompt_len = _attempt(row, _text_int, "ContextTokens", f["ContextTokens"])
            row.output_len = _attempt(row, _text_int, "GeneratedTokens", f["GeneratedTokens"])
        rows.append(row)
        stamps.append(stamp)
    # Seconds since the earliest timestamp: the first row's, since the trace is time-sorted.
    valid = [s for s in stamps if s is not None]
    if valid:
        first_whole, first_frac = min(valid)
        for row, stamp in zip(rows, stamps):
            if stamp is not None:
                row.arrival_s = (stamp[0] - first_whole) + (stamp[1] - first_frac)
    return rows


def burstgpt_rows(body: list[tuple[int, str]], order: list[str]) -> list[_Row]:
    """Rows of BurstGPT's CSV lines (after the header, whose column order is `order`); with
    its session columns, sessions of turns (see the module's docstring)."""
    sessions = BURSTGPT_SESSION_COLUMNS[0] in order
    if sessions and BURSTGPT_SESSION_COLUMNS[1] not in order:
        raise ValueError(
            f"burstgpt header has {BURSTGPT_SESSION_COLUMNS[0]} but not {BURSTGPT_SESSION_COLUMNS[1]}: a "
            "session's pauses need each turn's elapsed time"
        )
    rows, stamps, elapsed = [], [], []
    for n, text in body:
        row = _Row(line=n)
        fields = [f.strip() for f in text.split(",")]
        stamp = None
        if len(fields) != len(order):
            row.errors.append(f"expected {len(order)} fields ({','.join(order)}), got {len(fields)}")
        else:
            f = dict(zip(order, fields))
            stamp = _attempt(row, _text_float, "Timestamp", f["Timestamp"])
            # Every arrival is this minus the earliest stamp: one NaN, infinite or negative
            # stamp would shift (or poison) all of them, so it is rejected on its own line.
            if stamp is not None and not (math.isfinite(stamp) and stamp >= 0):
                row.errors.append(f"Timestamp {stamp} must be a finite number >= 0")
                stamp = None
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
            if sessions:
                row.session_id = f["SessionID"] or None
                took = _attempt(row, _text_float, "Elapsed time", f["Elapsed time"])
                if took is not None and not took >= 0:
                    row.errors.append(f"Elapsed time {took} must be >= 0")
                    took = None
                elapsed.append(took)
        rows.append(row)
        stamps.append(stamp)
        if len(elapsed) < len(rows):
            elapsed.append(None)
    valid = [s for s in stamps if s is not None]
    if valid:
        first = min(valid)
        for row, stamp in zip(rows, stamps):
            if stamp is not None:
                row.arrival_s = stamp - first
    if sessions:
        _burstgpt_sessions(rows, stamps, elapsed)
    return rows


def _burstgpt_sessions(rows: list[_Row], stamps: list[Optional[float]], elapsed: list[Optional[float]]) -> None:
    """Turn the rows of each session into its turns, in file order (see the module's docstring)."""
    last: dict[str, int] = {}  # session -> index of its latest turn so far
    prompts = [row.prompt_len for row in rows]  # each turn's whole prompt, as the trace counts it
    for i, row in enumerate(rows):
        if row.session_id is None:
            continue
        j = last.get(row.session_id)
        last[row.session_id] = i
        if j is None:
            continue
        prev = rows[j]
        prev.more_turns = True
        row.turn = prev.turn + 1
        ended = None if None in (stamps[j], elapsed[j]) else stamps[j] + elapsed[j]
        row.pause_s = max(0.0, stamps[i] - ended) if None not in (stamps[i], ended) else 0.0
        row.arrival_s = None  # it arrives as the turn before it ends
        if None not in (prompts[i], prompts[j], prev.output_len):
            row.prompt_len = max(1, prompts[i] - prompts[j] - prev.output_len)


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
            elif "hash_ids" in obj and not isinstance(hash_ids, list):
                row.errors.append(f"hash_ids must be a list of integers, got {type(hash_ids).__name__}")
        rows.append(row)
    last: dict[str, _Row] = {}  # a session's turns, in file order, at their own timestamps
    for row in rows:
        if row.session_id is not None:
            prev = last.get(row.session_id)
            if prev is not None:
                prev.more_turns, row.turn = True, prev.turn + 1
            last[row.session_id] = row
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
    unknown = [key for key in obj if key not in MOONCAKE_KEYS + MOONCAKE_OPTIONAL_KEYS]
    if unknown:
        row.errors.append(
            f"unknown key {unknown[0]!r}; a Mooncake line has {', '.join(MOONCAKE_KEYS)} "
            f"and optionally {', '.join(MOONCAKE_OPTIONAL_KEYS)}"
        )
    if "session_id" in obj:
        row.session_id = _attempt(row, _json_id, "session_id", obj["session_id"])
    for key in MOONCAKE_KEYS:
        if key not in obj:
            row.errors.append(f"{key} is missing")
    if "timestamp" in obj:
        ms = _attempt(row, _json_float, "timestamp", obj["timestamp"])
        if ms is not None and not (math.isfinite(ms) and ms >= 0):  # named as the file writes it
            row.errors.append(f"timestamp {ms:g} must be a finite number of milliseconds >= 0")
            ms = None
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
