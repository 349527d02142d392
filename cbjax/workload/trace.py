"""Trace replay: the Azure LLM inference CSVs (2023 and 2024), BurstGPT's CSV, Mooncake's JSONL
(`cbjax.workload.formats`), plain CSV and JSONL files, read into Requests.

A problem with the whole file (missing, unknown format, bad header) raises ValueError. A
malformed line becomes a Request with `input_error` set, so the run rejects it and it still
shows in the outputs; its unparsed fields take defaults (prompt_len 0, the previous valid
arrival time). Arrival times that go backwards are replayed sorted (`build_workload`), with one
warning that counts the rows out of order.

A JSONL line may give its prompt as text (`prompt`); `encode_text_prompts` turns it into
token ids with the model's tokenizer before the run.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

from cbjax.config import WorkloadConfig
from cbjax.core.request import Request, SamplingParams
from cbjax.workload.rows import (
    _attempt, _json_bool, _json_float, _json_id, _json_ids, _json_int, _json_object, _json_str, _Row, _split, _text_float, _text_int,
)  # fmt: skip
from cbjax.workload.formats import BURSTGPT_COLUMNS, MOONCAKE_KEYS, azure_rows, burstgpt_rows, mooncake_rows
from cbjax.workload.formats import parse_timestamp  # noqa: F401  (read here by callers)
from cbjax.workload.sharegpt import sharegpt_rows
from cbjax.workload.synthetic import rng_streams, sampling_seeds, prompt_seeds

log = logging.getLogger("cbjax")

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
CSV_COLUMNS = ("arrival_s", "prompt_len", "output_len")
# each format's names for the prompt and output lengths, for a reason naming one
LENGTH_NAMES = {"azure": AZURE_COLUMNS[1:], "burstgpt": ("Request tokens", "Response tokens"),
                "mooncake": ("input_length", "output_length")}  # fmt: skip
JSONL_KEYS = (
    "arrival_s", "prompt_token_ids", "prompt_len", "max_tokens", "output_len", "request_id",
    "temperature", "top_k", "top_p", "seed", "ignore_eos", "priority", "client_id", "stop_token_ids",
    "prompt",
)  # fmt: skip


def load_trace(cfg: WorkloadConfig, seed: int, tokenizer: Optional[Any] = None) -> list[Request]:
    """The requests of `cfg.path` in file order; arrival times and sessions' pauses are divided
    by `cfg.time_scale`. `tokenizer` counts a ShareGPT file's message tokens."""
    path = resolve_path(cfg.path) if cfg.path else None
    if path is None or not path.is_file():
        where = f" (resolved to {path.resolve()})" if path is not None else ""
        raise ValueError(f"trace file {cfg.path!r}{where} does not exist or is not a file")
    try:
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"trace file {path}: cannot read it: {e}") from e
    numbered = [(n, text.strip()) for n, text in enumerate(lines, 1) if text.strip()]
    if not numbered:
        raise ValueError(f"trace file {path} is empty")
    fmt = cfg.format if cfg.format != "auto" else detect_format(path, _first_object_line(numbered))
    fmt = "azure" if fmt == "azure2024" else fmt  # the 2024 release keeps the 2023 schema
    if fmt == "sharegpt":
        rows = sharegpt_rows(path, lines, cfg, seed, tokenizer)
    elif fmt == "jsonl":
        rows = [_jsonl_row(n, text) for n, text in numbered[: cfg.limit]]
    elif fmt == "mooncake":
        rows = mooncake_rows(numbered[: cfg.limit], cfg.hash_block_size, cfg.vocab_size, seed)
    elif fmt == "burstgpt":
        order = _csv_header(path, fmt, numbered[0][1], BURSTGPT_COLUMNS)
        rows = burstgpt_rows(numbered[1:][: cfg.limit], order)
    else:
        columns = AZURE_COLUMNS if fmt == "azure" else CSV_COLUMNS
        order = _csv_header(path, fmt, numbered[0][1], columns)
        body = numbered[1:][: cfg.limit]
        rows = (azure_rows if fmt == "azure" else _csv_rows)(body, order)
    if not rows:
        raise ValueError(f"trace file {path} holds no requests")
    if fmt in ("jsonl", "mooncake", "sharegpt") and all(row.errors[:1] and row.errors[0].startswith("invalid JSON") for row in rows):
        first = rows[0]
        raise ValueError(f"trace file {path}: no line is valid JSON (line {first.line}: {first.errors[0]})")
    _warn_backwards(rows, path)
    return _to_requests(rows, path.name, cfg, seed, LENGTH_NAMES.get(fmt, ("prompt_len", "output_len")))


def resolve_path(path: str) -> Path:
    """A file path, or `pkg://PACKAGE/FILE` for a file shipped inside an installed package
    (e.g. pkg://cbjax.data/AzureLLMInferenceTrace_code_sample.csv)."""
    if not path.startswith("pkg://"):
        return Path(path)
    package, _, name = path[len("pkg://") :].partition("/")
    try:
        root = importlib.resources.files(package)
    except (ImportError, TypeError) as e:
        raise ValueError(f"workload.path {path!r}: no package {package!r} ({e})") from None
    return Path(str(root.joinpath(name)))


def _first_object_line(numbered: list[tuple[int, str]]) -> str:
    """The line `detect_format` reads: the first, or in a file of JSON lines the first that is
    a JSON object, so one corrupt first line rejects that line alone, not the whole file read
    as the wrong format."""
    first = numbered[0][1]
    if not first.startswith("{"):
        return first
    for _, text in numbered:
        try:
            if isinstance(json.loads(text), dict):
                return text
        except json.JSONDecodeError:
            continue
    return first


def detect_format(path: Path, first_line: str) -> str:
    """'jsonl', 'mooncake', 'azure', 'burstgpt' or 'csv', from the first non-blank line of `path`:
    a JSON object with Mooncake's `hash_ids` or `input_length` is Mooncake's, one with
    `conversations` (or a JSON array) ShareGPT's, any other JSONL; a CSV by its header's columns."""
    if first_line.startswith("["):
        return "sharegpt"
    if first_line.startswith("{"):
        try:
            keys = set(json.loads(first_line))
        except (json.JSONDecodeError, TypeError):
            keys = set()
        if "conversations" in keys:
            return "sharegpt"
        return "mooncake" if keys & {"hash_ids", "input_length"} else "jsonl"
    columns = {c.strip() for c in first_line.split(",")}
    for fmt, expected in (("azure", AZURE_COLUMNS), ("csv", CSV_COLUMNS)):
        if columns == set(expected):
            return fmt
    if columns >= set(BURSTGPT_COLUMNS):
        return "burstgpt"
    raise ValueError(
        f"trace file {path}: cannot tell its format from the first line {first_line[:80]!r}; "
        f"{_closest_csv(columns)}expected JSON objects (jsonl, or mooncake with {', '.join(MOONCAKE_KEYS)}), a CSV header "
        f"{','.join(AZURE_COLUMNS)} (azure, azure2024), {','.join(BURSTGPT_COLUMNS)} (burstgpt) "
        f"or {','.join(CSV_COLUMNS)} (csv); or set workload.format"
    )


def _closest_csv(columns: set[str]) -> str:
    """'closest is FORMAT, missing ...; ' for the CSV format sharing the most columns with a
    header, or '' when it shares none."""
    known = (("azure", AZURE_COLUMNS), ("burstgpt", BURSTGPT_COLUMNS), ("csv", CSV_COLUMNS))
    # the most shared columns, then the fewest missing
    shared, _, fmt, expected = max((len(columns & set(c)), -len(c), fmt, c) for fmt, c in known)
    if not shared:
        return ""
    missing = [c for c in expected if c not in columns]
    # BurstGPT's reader skips columns it does not read; the others take exactly theirs.
    extra = [] if fmt == "burstgpt" else sorted(columns - set(expected))
    parts = [f"missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)}"] if missing else []
    parts += [f"unexpected column{'s' if len(extra) > 1 else ''} {', '.join(extra)}"] if extra else []
    return f"closest is {fmt} ({' and '.join(parts)}); "


def _csv_header(path: Path, fmt: str, header: str, expected: tuple[str, ...]) -> list[str]:
    """The header's columns in order. BurstGPT's may carry more columns than it reads (its
    announced SessionID, Elapsed time); the others' must be exactly `expected`."""
    columns = [c.strip() for c in header.split(",")]
    ok = set(columns) >= set(expected) if fmt == "burstgpt" else sorted(columns) == sorted(expected)
    if not ok:
        missing = [c for c in expected if c not in columns]
        which = f" (missing {', '.join(missing)})" if missing else ""
        raise ValueError(
            f"trace file {path}: {fmt} header must have the columns {','.join(expected)}{which}, "
            f"got {header[:80]!r}"
        )
    return columns


def _warn_backwards(rows: list[_Row], path: Path) -> None:
    """Log one warning when arrival times go backwards: the run replays requests sorted by
    arrival (`build_workload`), so such rows move ahead of lines above them."""
    latest, moved, first = -math.inf, 0, None
    for row in rows:
        t = row.arrival_s
        if t is None or not (math.isfinite(t) and t >= 0):
            continue  # defaulted or rejected: it keeps its place
        if t < latest:
            moved += 1
            first = first or row.line
        latest = max(latest, t)
    if moved:
        log.warning(
            f"trace file {path}: arrival times go backwards; {moved} of {len(rows)} rows arrive before "
            f"a row above them (first at line {first}) and are replayed in arrival order"
        )


def _csv_rows(body: list[tuple[int, str]], order: list[str]) -> list[_Row]:
    rows = []
    for n, text in body:
        row, f = _split(n, text, order)
        if f:
            row.arrival_s = _attempt(row, _text_float, "arrival_s", f["arrival_s"])
            row.prompt_len = _attempt(row, _text_int, "prompt_len", f["prompt_len"])
            row.output_len = _attempt(row, _text_int, "output_len", f["output_len"])
        rows.append(row)
    return rows


def _jsonl_row(n: int, text: str) -> _Row:
    row = _Row(line=n)
    obj = _json_object(row, text)
    if obj is None:
        return row
    unknown = [key for key in obj if key not in JSONL_KEYS]
    if unknown:
        names = ", ".join(repr(key) for key in unknown)
        plural = "s" if len(unknown) > 1 else ""
        row.errors.append(f"unknown key{plural} {names}; allowed: {', '.join(JSONL_KEYS)}")
    obj = {key: value for key, value in obj.items() if value is not None}
    if "arrival_s" in obj:
        row.arrival_s = _attempt(row, _json_float, "arrival_s", obj["arrival_s"])
    else:
        row.errors.append("arrival_s is missing")
    if "prompt_token_ids" in obj:
        row.prompt_token_ids = _attempt(row, _json_ids, "prompt_token_ids", obj["prompt_token_ids"])
    if "prompt_len" in obj:
        row.prompt_len = _attempt(row, _json_int, "prompt_len", obj["prompt_len"])
    if "prompt" in obj:
        row.prompt_text = _attempt(row, _json_str, "prompt", obj["prompt"])
        if "prompt_token_ids" in obj or "prompt_len" in obj:
            row.errors.append("prompt (text) excludes prompt_token_ids and prompt_len")
    elif "prompt_token_ids" not in obj and "prompt_len" not in obj:
        row.errors.append("needs prompt, prompt_token_ids or prompt_len")
    elif row.prompt_token_ids is not None and row.prompt_len is not None:
        if row.prompt_len != len(row.prompt_token_ids):
            row.errors.append(
                f"prompt_len {row.prompt_len} does not match {len(row.prompt_token_ids)} prompt_token_ids"
            )
    if "output_len" in obj:
        row.output_len = _attempt(row, _json_int, "output_len", obj["output_len"])
    if "max_tokens" in obj:
        row.max_tokens = _attempt(row, _json_int, "max_tokens", obj["max_tokens"])
    if "output_len" not in obj and "max_tokens" not in obj:
        row.errors.append("needs max_tokens or output_len")
    if "request_id" in obj:
        row.request_id = _attempt(row, _json_id, "request_id", obj["request_id"])
    optional = {"priority": _json_int, "client_id": _json_str, "temperature": _json_float,
                "top_k": _json_int, "top_p": _json_float, "seed": _json_int,
                "ignore_eos": _json_bool, "stop_token_ids": _json_ids}  # fmt: skip
    for key, parse in optional.items():
        value = _attempt(row, parse, key, obj[key]) if key in obj else None
        if value is None:
            continue
        if key in ("priority", "client_id"):
            setattr(row, key, value)
        else:
            row.sampling[key] = tuple(value) if key == "stop_token_ids" else value
    return row


def _to_requests(rows: list[_Row], name: str, cfg: WorkloadConfig, seed: int, lengths: tuple[str, str]) -> list[Request]:
    """The rows as requests; `lengths` are the file's names for the prompt and output lengths."""
    rngs = rng_streams(seed)
    for row in rows:
        if row.prompt_len is not None and row.prompt_len < 0:
            row.errors.append(f"{lengths[0]} must be >= 0, got {row.prompt_len}")
            row.prompt_len = None
        if row.output_len is not None and row.output_len < 0:
            row.errors.append(f"{lengths[1]} must be >= 0, got {row.output_len}")
            row.output_len = None
    pseeds = prompt_seeds(len(rows), rngs["token_ids"])
    seeds = sampling_seeds(len(rows), rngs["sampling_seed"])

    explicit = {row.request_id for row in rows if row.request_id is not None}
    given_ids = explicit | {str(i) for i, row in enumerate(rows) if row.request_id is None}
    requests, seen, prev_arrival = [], {}, 0.0
    session_seeds: dict[str, int] = {}  # a session's turns share its first turn's prompt stream
    for index, (row, default_seed, pseed) in enumerate(zip(rows, seeds, pseeds)):
        arrival = prev_arrival
        if row.session_id is not None:
            pseed = session_seeds.setdefault(row.session_id, pseed)
        if row.pause_s is not None:
            arrival = math.inf  # it arrives as the turn before it ends
        elif row.arrival_s is not None:
            if math.isfinite(row.arrival_s) and row.arrival_s >= 0:
                arrival = prev_arrival = row.arrival_s / cfg.time_scale
            else:
                row.errors.append(f"arrival_s must be a finite number >= 0, got {row.arrival_s}")
                arrival = 0.0
        if row.request_id is not None:
            rid = original = row.request_id
            if rid in seen:
                row.errors.append(f"duplicate request_id {rid!r} (first on line {seen[rid]})")
                rid = _unique_id(original, row.line, given_ids, seen)
        else:
            # A line without an id gets its index, or, where a line gives that id explicitly,
            # a fresh one: a default never collides with (or rejects) an explicit id.
            rid = original = str(index)
            if rid in explicit or rid in seen:
                rid = original = _unique_id(rid, row.line, given_ids, seen)
        seen[rid] = row.line
        has_prompt = row.prompt_token_ids is not None or row.prompt_text is not None
        requests.append(
            Request(
                request_id=rid,
                arrival_s=arrival,
                prompt_len=len(row.prompt_token_ids) if row.prompt_token_ids is not None else row.prompt_len or 0,
                prompt_token_ids=row.prompt_token_ids,
                synthetic_prompt=None if has_prompt else (pseed, cfg.vocab_size),
                prompt_text=row.prompt_text,
                sampling=_sampling(row, cfg, default_seed),
                target_output_len=row.output_len,
                priority=row.priority,
                client_id=row.client_id,
                input_error=f"{name} line {row.line}: {'; '.join(row.errors)}" if row.errors else None,
                original_request_id=original if rid != original else None,
                source=f"{name} line {row.line}",
                session_id=row.session_id,
                turn=row.turn,
                more_turns=row.more_turns,
                pause_s=None if row.pause_s is None else row.pause_s / cfg.time_scale,
            )
        )
    return requests


def _unique_id(rid: str, line: int, given: set[str], taken: dict[str, int]) -> str:
    """A new id for a duplicate of `rid` that no request of the file has or will take."""
    candidate, n = f"{rid}@line{line}", 1
    while candidate in given or candidate in taken:
        n += 1
        candidate = f"{rid}@line{line}#{n}"
    return candidate


def encode_text_prompts(requests: list[Request], tokenizer: Optional[Any], where: str = "the model") -> None:
    """Tokenize each request's `prompt_text` into its prompt ids, in place.

    `tokenizer` has `encode(text) -> list[int]`; without one, text requests are rejected by
    name. Requests already rejected keep their first error.
    """
    for req in requests:
        if req.prompt_text is None or req.input_error is not None:
            continue
        if tokenizer is None:
            req.input_error = (
                f"{req.source or f'request {req.request_id}'}: prompt is text, but {where} has no tokenizer; "
                "set model.path to a Hugging Face directory with tokenizer.json"
            )
            continue
        req.prompt_token_ids = tokenizer.encode(req.prompt_text)
        req.prompt_len = len(req.prompt_token_ids)


def _sampling(row: _Row, cfg: WorkloadConfig, default_seed: int) -> SamplingParams:
    """A given output_len is the request's length: it defaults ignore_eos on and, without an
    explicit max_tokens, sets max_tokens (cfg.max_tokens, when set, takes that place)."""
    kwargs = {"seed": default_seed, **row.sampling}
    if row.max_tokens is not None:
        kwargs["max_tokens"] = row.max_tokens
    elif row.output_len is not None:
        kwargs["max_tokens"] = cfg.max_tokens if cfg.max_tokens is not None else row.output_len
    if row.output_len is not None:
        kwargs.setdefault("ignore_eos", True)
    return SamplingParams(**kwargs)
