"""Requests, their sampling parameters, lifecycle and fate."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


def eos_token_ids(eos_token_id: Optional[int], extra: Sequence[int] = ()) -> tuple[int, ...]:
    """Every token that ends a request as EOS does: the model's `eos_token_id`, then the
    further ones (`model.extra_eos_token_ids`: generation_config.json's list), each once."""
    return tuple(dict.fromkeys(([] if eos_token_id is None else [eos_token_id]) + list(extra)))


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"
    MAX_MODEL_LEN = "max_model_len"  # cut at the model's context before its own limit
    REJECTED = "rejected"
    ABORTED = "aborted"
    ERROR = "error"  # the executor failed on it (e.g. non-finite logits); the run went on
    NOT_ARRIVED = "not_arrived"  # the run stopped before its arrival time: never seen, no finish time


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def problem(self) -> Optional[str]:
        """Why these parameters are unusable, or None."""
        if self.max_tokens < 1:
            return f"max_tokens must be >= 1, got {self.max_tokens}"
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            return f"temperature must be >= 0, got {self.temperature}"
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p}"
        return None


@dataclass(eq=False)
class Request:
    """One request. The scheduler owns the mutable fields below the divider.

    A request with `target_output_len` set (simulated work, length-only traces) generates
    exactly min(target_output_len, sampling.max_tokens) tokens: reaching the target stands in
    for the model's EOS.
    """

    request_id: str
    arrival_s: float
    prompt_len: int
    prompt_token_ids: Optional[list[int]] = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    target_output_len: Optional[int] = None
    priority: int = 0
    client_id: str = "default"
    # A problem found while reading the request (bad trace line, bad field): reject on arrival.
    input_error: Optional[str] = None
    # Length-only requests: (seed, vocab_size) of synthetic prompt ids, drawn on first use so
    # that a simulated trace never pays for millions of ids it does not read.
    synthetic_prompt: Optional[tuple[int, int]] = None
    # A text prompt (JSONL `prompt`): the runner tokenizes it into prompt_token_ids before serving.
    prompt_text: Optional[str] = None
    # The id the input gave, when it had to be renamed (a duplicate): request_id is then unique.
    original_request_id: Optional[str] = None
    # Where the request was read ("trace.jsonl line 12"): a rejection's reason names it.
    source: Optional[str] = None
    # A turn of a multi-turn session (`workload=sessions`, conversation traces): its session,
    # its index there (0 first), and whether a later turn of the session follows it.
    session_id: Optional[str] = None
    turn: int = 0
    more_turns: bool = False
    # A later turn that arrives `pause_s` seconds after the turn before it ends (None: at
    # `arrival_s`). Until then (`cbjax.engine.followups`) its `arrival_s` is inf and its
    # `prompt_len` counts its new input alone; at release its prompt becomes the conversation
    # so far (that turn's prompt and output) followed by that new input.
    pause_s: Optional[float] = None

    # ---- scheduler-owned state ----
    status: Status = Status.WAITING
    num_generated: int = 0
    num_computed: int = 0  # tokens whose K/V sit in the cache
    output_token_ids: list[int] = field(default_factory=list)
    slot: int = -1
    num_new_tokens: int = 0  # tokens this request processes in the current iteration
    max_output_len: int = 0  # the stopping length, set at admission checks
    finish_reason: Optional[FinishReason] = None
    reject_reason: Optional[str] = None
    error: Optional[str] = None  # why the executor failed on it (finish_reason error)
    scheduled_s: Optional[float] = None  # start of its first iteration
    first_token_s: Optional[float] = None
    last_token_s: Optional[float] = None  # when its latest token came (time-between-tokens)
    finish_s: Optional[float] = None
    num_preemptions: int = 0
    admit_seq: int = 0  # admission order, for victim choice
    # With a host KV tier (`cache.host_pages`; None without): prompt tokens its first admission
    # found cached on the device and in host memory, and the seconds of the copies that loaded
    # its host pages (its share, by pages, of each step's loads)
    prefix_hit_tokens_device: Optional[int] = None
    prefix_hit_tokens_host: Optional[int] = None
    kv_load_s: Optional[float] = None
    # Speculative decoding (`cbjax.scheduler.drafts`): drafts verified and accepted in all, and
    # (proposed, accepted) per decode step (None while speculation is off: `cbjax.spec.trace`).
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_steps: Optional[list[tuple[int, int]]] = None

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return self.prompt_len + self.num_generated

    def prompt_ids(self, keep: bool = True) -> list[int]:
        """The prompt's token ids, drawing seeded synthetic ids for a length-only request; drawn
        ids are kept on the request unless `keep` is false (a caller that reads them once, as
        the prefix cache hashing a simulated prompt, so a long trace does not hold them all)."""
        if self.prompt_token_ids is not None:
            return self.prompt_token_ids
        if self.synthetic_prompt is None:
            raise ValueError(f"request {self.request_id}: has no prompt token ids")
        seed, vocab_size = self.synthetic_prompt
        ids = np.random.default_rng(seed).integers(0, vocab_size, size=self.prompt_len).tolist()
        if keep:
            self.prompt_token_ids = ids
        return ids

    def stop_length(self) -> int:
        """How many tokens this request may generate at most (before the model's max length)."""
        limit = self.sampling.max_tokens
        if self.target_output_len is not None:
            limit = min(limit, self.target_output_len)
        return limit
