"""One trace line as read, before defaults fill it, and the field parsers the trace readers share.

A parser raises `LineError` for a malformed field; `_attempt` turns it into the row's error,
so the line becomes a rejected request instead of a crash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


class LineError(ValueError):
    """A malformed trace line: it becomes that request's input_error, not a crash."""


@dataclass
class _Row:
    """What could be read from one line, before defaults fill the rest."""

    line: int
    errors: list[str] = field(default_factory=list)
    arrival_s: Optional[float] = None  # None: missing or unparseable
    request_id: Optional[str] = None
    prompt_len: Optional[int] = None
    prompt_token_ids: Optional[list[int]] = None
    prompt_text: Optional[str] = None
    output_len: Optional[int] = None
    max_tokens: Optional[int] = None
    sampling: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    client_id: str = "default"
    # a turn of a session: `cbjax.core.request.Request`'s fields of the same names; a later
    # turn with `pause_s` set has no arrival of its own (None) and `prompt_len` new tokens
    session_id: Optional[str] = None
    turn: int = 0
    more_turns: bool = False
    pause_s: Optional[float] = None


def _json_object(row: _Row, text: str) -> Optional[dict]:
    """A JSONL line's object, or None with the reason in `row.errors`."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        row.errors.append(f"invalid JSON: {e.msg} at column {e.colno}")
        return None
    if not isinstance(obj, dict):
        row.errors.append(f"expected a JSON object, got {type(obj).__name__}")
        return None
    return obj


def _attempt(row: _Row, parse: Callable[..., Any], *args: Any) -> Any:
    """parse(*args), or None with the LineError's message added to the row's errors."""
    try:
        return parse(*args)
    except LineError as e:
        row.errors.append(str(e))
        return None


def _text_int(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise LineError(f"{key} {text.strip()!r} is not an integer") from None


def _text_float(key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise LineError(f"{key} {text.strip()!r} is not a number") from None


def _json_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LineError(f"{key} {value!r} is not an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise LineError(f"{key} {value!r} is not an integer")
        value = int(value)
    return value


def _json_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LineError(f"{key} {value!r} is not a number")
    return float(value)


def _json_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise LineError(f"{key} {value!r} is not true or false")
    return value


def _json_str(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise LineError(f"{key} {value!r} is not a string")
    return value


def _json_id(key: str, value: Any) -> str:
    """An id given as a string or an integer, as a string."""
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return str(value)
    raise LineError(f"{key} must be a string or an integer, got {value!r}")


def _json_ids(key: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise LineError(f"{key} must be a list of token ids, got {type(value).__name__}")
    for i, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise LineError(f"{key}[{i}] {tok!r} is not a token id (an integer >= 0)")
    return value


def _split(n: int, text: str, order: list[str]) -> tuple[_Row, dict[str, str]]:
    """A CSV line's row and its fields by column (none, with the error, on a wrong count)."""
    row = _Row(line=n)
    fields = text.split(",")
    if len(fields) != len(order):
        row.errors.append(f"expected {len(order)} fields ({','.join(order)}), got {len(fields)}")
        return row, {}
    return row, dict(zip(order, fields))
