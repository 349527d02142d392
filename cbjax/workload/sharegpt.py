"""ShareGPT-format conversations (`workload.format=sharegpt`): each conversation a session of turns.

The file is a JSON array of conversations, or JSONL with one conversation per line. A
conversation is {"id": ..., "conversations": [{"from": "human", "value": TEXT}, {"from": "gpt",
"value": TEXT}, ...]}. A turn is the user's messages (`human` or `user`; `system` messages join
them) and the model's reply after them (`gpt`, `assistant`, `chatgpt`, `bing`, `bard` or
`model`; consecutive replies are one). Model messages before the first user message join the
first turn's input (a greeting); user messages after the last reply are dropped, since a turn
takes its output length from its reply.

Lengths are token counts: a message's `num_tokens` when it has one, else its `value` encoded
with the model's tokenizer (`model.path`); without either the file cannot be read. A turn's
new input is its user messages' tokens, and it generates exactly its reply's tokens
(ignore_eos). Its prompt is the whole conversation so far followed by that new input
(`cbjax.engine.followups`); the prompt's ids are the session's seeded stream, not the text's.

Arrivals come from the workload config: conversations' first turns by `workload.arrival` at
`workload.rate`, each later turn a `workload.pause` draw after the turn before it ends.
`workload.limit` reads the first N conversations. A conversation's `id` is its `session_id`
(its position in the file when it has none) and its turns' request ids are "ID.TURN".

A malformed conversation is rejected alone: one row, its turn 0, whose reason names the line
its entry starts on and the field, e.g. `chats.json line 12: conversations[3].from 'bot' is not
a ShareGPT role`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from cbjax.config import WorkloadConfig
from cbjax.workload.rows import LineError, _json_id, _json_int, _Row
from cbjax.workload.sessions import sample_pauses, session_streams
from cbjax.workload.synthetic import arrival_times, rng_streams

USER_ROLES = ("human", "user", "system")
MODEL_ROLES = ("gpt", "assistant", "chatgpt", "bing", "bard", "model")
_SPACE = re.compile(r"\s*")


class _NoLength(Exception):
    """A message has neither `num_tokens` nor a tokenizer to count its text."""


def sharegpt_rows(path: Path, lines: list[str], cfg: WorkloadConfig, seed: int, tokenizer: Optional[Any]) -> list[_Row]:
    """Rows of every turn of the file's conversations (the first `cfg.limit`), sessions set."""
    entries = _entries(path, "\n".join(lines))[: cfg.limit]
    parsed = []
    for line, obj in entries:
        try:
            parsed.append((line, obj, _turns(obj, tokenizer)))
        except LineError as e:
            parsed.append((line, obj, str(e)))
        except _NoLength as e:
            raise ValueError(
                f"sharegpt file {path}: line {line}: {e} has no num_tokens, and no tokenizer counts its text; "
                "set model.path to a checkpoint with tokenizer.json, or give every message a num_tokens"
            ) from None
    arrivals = arrival_times(cfg.arrival, len(parsed), cfg.rate, cfg.cv, rng_streams(seed)["arrivals"]).tolist()
    num_turns = sum(len(turns) for _, _, turns in parsed if isinstance(turns, list))
    pauses = sample_pauses(cfg.pause, num_turns, session_streams(seed)[1]).tolist()
    rows: list[_Row] = []
    seen: dict[str, int] = {}
    explicit = {_given_id(obj) for _, obj, _ in parsed} - {None}
    j = 0
    for c, (line, obj, turns) in enumerate(parsed):
        sid, problem = _session_id(obj, c, line, seen, explicit)
        if problem is None and isinstance(turns, str):
            problem = turns
        if problem is not None:
            rows.append(_Row(line=line, errors=[problem], arrival_s=arrivals[c], request_id=f"{sid}.0", session_id=sid))
            j += len(turns) if isinstance(turns, list) else 0
            continue
        for k, (new, out, reply) in enumerate(turns):
            row = _Row(line=line, request_id=f"{sid}.{k}", prompt_len=new, output_len=out, session_id=sid, turn=k)
            row.more_turns = k < len(turns) - 1
            if k == 0:
                row.arrival_s = arrivals[c]
            else:
                row.pause_s = pauses[j]
            if out < 1:
                row.errors.append(f"conversations[{reply}]: the reply has no tokens")
            rows.append(row)
            j += 1
    return rows


def _entries(path: Path, text: str) -> list[tuple[int, Any]]:
    """(line where it starts, parsed JSON or an error message) of each conversation: the
    elements of a JSON array, or the lines of a JSONL file."""
    i = _SPACE.match(text).end()
    if not text.startswith("[", i):
        out = []
        for n, line in enumerate(text.split("\n"), 1):
            if line.strip():
                try:
                    out.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    out.append((n, f"invalid JSON: {e.msg} at column {e.colno}"))
        return out
    decoder = json.JSONDecoder()
    out, line, counted = [], 1, 0
    i = _SPACE.match(text, i + 1).end()
    if text.startswith("]", i):
        return out
    while True:
        line += text.count("\n", counted, i)
        counted = i
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"sharegpt file {path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
            ) from None
        out.append((line, obj))
        i = _SPACE.match(text, i).end()
        if text.startswith(",", i):
            i = _SPACE.match(text, i + 1).end()
        elif text.startswith("]", i):
            return out
        else:
            where = f"line {text.count(chr(10), 0, i) + 1}"
            raise ValueError(f"sharegpt file {path}: expected ',' or ']' after a conversation at {where}")


def _given_id(obj: Any) -> Optional[str]:
    """The conversation's own valid `id` as a string, or None."""
    given = obj.get("id") if isinstance(obj, dict) else None
    try:
        return None if given is None else _json_id("id", given)
    except LineError:
        return None


def _session_id(
    obj: Any, index: int, line: int, seen: dict[str, int], explicit: set[str]
) -> tuple[str, Optional[str]]:
    """The conversation's session id, and why it is rejected (a bad or duplicate id), or None.
    A conversation without an id takes its index, or a fresh id where another conversation
    gives that one: a default never collides with (or rejects) an explicit id. Session ids
    stay unique, a renamed duplicate's too."""
    given = obj.get("id") if isinstance(obj, dict) else None
    sid, problem = str(index), None
    if given is not None:
        try:
            sid = _json_id("id", given)
        except LineError as e:
            problem = str(e)
    if given is not None and problem is None and sid in seen:
        problem = f"duplicate id {sid!r} (first on line {seen[sid]})"
        sid = _fresh_id(sid, line, seen, explicit)
    elif (given is None or problem is not None) and (sid in seen or sid in explicit):
        sid = _fresh_id(sid, line, seen, explicit)
    seen[sid] = line
    return sid, problem


def _fresh_id(sid: str, line: int, seen: dict[str, int], explicit: set[str]) -> str:
    """`sid@lineN`, numbered further until no conversation has or gives it."""
    candidate, n = f"{sid}@line{line}", 1
    while candidate in seen or candidate in explicit:
        n += 1
        candidate = f"{sid}@line{line}#{n}"
    return candidate


def _turns(obj: Any, tokenizer: Optional[Any]) -> list[tuple[int, int, int]]:
    """(new input tokens, reply tokens, index of the reply's first message) of each turn."""
    if isinstance(obj, str):  # a JSONL line that did not parse
        raise LineError(obj)
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    messages = obj.get("conversations")
    if not isinstance(messages, list):
        raise LineError(f"conversations must be a list of messages, got {type(messages).__name__}")
    turns: list[tuple[int, int, int]] = []
    new, reply, reply_at, seen_user = 0, None, 0, False
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise LineError(f"conversations[{i}] must be an object with from and value, got {type(msg).__name__}")
        role = msg.get("from")
        if role not in USER_ROLES + MODEL_ROLES:
            raise LineError(
                f"conversations[{i}].from {role!r} is not a ShareGPT role ({', '.join(USER_ROLES + MODEL_ROLES)})"
            )
        n = _length(msg, i, tokenizer)
        if role in USER_ROLES:
            if reply is not None:
                turns.append((new, reply, reply_at))
                new, reply = 0, None
            new += n
            seen_user = True
        elif not seen_user:
            new += n  # the model spoke first: context for the first turn
        elif reply is None:
            reply, reply_at = n, i
        else:
            reply += n
    if reply is not None:
        turns.append((new, reply, reply_at))
    if not turns:
        raise LineError("conversations has no reply from the model after a user message: nothing to serve")
    return turns


def _length(msg: dict, i: int, tokenizer: Optional[Any]) -> int:
    if "num_tokens" in msg:
        n = _json_int(f"conversations[{i}].num_tokens", msg["num_tokens"])
        if n < 0:
            raise LineError(f"conversations[{i}].num_tokens must be >= 0, got {n}")
        return n
    value = msg.get("value")
    if not isinstance(value, str):
        raise LineError(f"conversations[{i}].value must be text, got {type(value).__name__}")
    if tokenizer is None:
        raise _NoLength(f"conversations[{i}]")
    return len(tokenizer.encode(value))
