"""The workload group: length distributions, clients, sessions and the synthetic or trace workload."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from cbjax.config.checks import _one_of, _require

ARRIVALS = ("all_at_once", "poisson", "gamma", "uniform")
LENGTH_DISTS = ("fixed", "uniform", "exponential", "lognormal")
TRUNCATIONS = ("clip", "resample")
WORKLOADS = ("synthetic", "trace", "shared_prefix", "sessions")
TRACE_FORMATS = ("auto", "azure", "azure2024", "burstgpt", "mooncake", "sharegpt", "csv", "jsonl")
PAUSE_DISTS = ("fixed", "exponential", "lognormal", "pareto")


@dataclass
class LengthConfig:
    """A length distribution. Draws are rounded, then brought into [min, max]: clipped to the
    bound (`truncation=clip`) or redrawn until inside (`truncation=resample`, a truncated
    distribution; its mean then differs from `mean`, the untruncated one's)."""

    dist: str = "fixed"
    value: int = 128  # fixed
    low: int = 1  # uniform, inclusive
    high: int = 256  # uniform, inclusive
    mean: float = 128.0  # exponential and lognormal
    sigma: float = 1.0  # lognormal: std of the underlying normal
    min: int = 1
    max: int = 4096
    truncation: str = "clip"

    @staticmethod
    def scalar_override(key: str, value: Any) -> str:
        """How to write `key=value` on the command line: a fixed length of `value` tokens (max
        raised with it, since draws are clipped to [min, max])."""
        return f"{key}.dist=fixed {key}.value={value} {key}.max={value}"

    def check(self, key: str) -> None:
        _one_of(f"{key}.dist", self.dist, LENGTH_DISTS)
        _one_of(f"{key}.truncation", self.truncation, TRUNCATIONS)
        _require(self.min >= 1, f"{key}.min", "must be >= 1", self.min)
        _require(self.max >= self.min, f"{key}.max", f"must be >= {key}.min ({self.min})", self.max)
        if self.dist == "fixed":
            _require(self.value >= 1, f"{key}.value", "must be >= 1", self.value)
            # Every draw is brought into [min, max]: a fixed value outside would silently
            # become another length (clip) or never be drawn (resample).
            _require(
                self.min <= self.value <= self.max, f"{key}.value",
                f"must be in [{self.min}, {self.max}] ({key}.min, {key}.max), which bound every draw", self.value,
            )  # fmt: skip
        if self.dist == "uniform":
            _require(1 <= self.low <= self.high, f"{key}.low", f"must be in [1, {key}.high]", self.low)
            # likewise: a range past [min, max] would pile its outside draws on a bound
            _require(self.min <= self.low, f"{key}.low", f"must be >= {key}.min ({self.min}), which bounds every draw",
                     self.low)  # fmt: skip
            _require(self.high <= self.max, f"{key}.high", f"must be <= {key}.max ({self.max}), which bounds every draw",
                     self.high)  # fmt: skip
        if self.dist in ("exponential", "lognormal"):
            _require(self.mean > 0, f"{key}.mean", "must be > 0", self.mean)
        if self.dist == "lognormal":
            _require(self.sigma >= 0, f"{key}.sigma", "must be >= 0", self.sigma)


@dataclass
class PauseConfig:
    """Seconds between a session's turn ending and its next turn arriving (`workload=sessions`,
    ShareGPT conversations): fixed (`value`), exponential (a person's think time, `mean`),
    lognormal (`mean` and `sigma` of the underlying normal) or pareto (a tool call's heavy
    tail: shape `alpha` > 1, scaled to `mean`); draws above `max` are clipped to it."""

    dist: str = "exponential"
    value: float = 1.0  # fixed
    mean: float = 5.0  # exponential, lognormal and pareto
    sigma: float = 1.0  # lognormal
    alpha: float = 1.5  # pareto
    max: Optional[float] = None

    def check(self, key: str) -> None:
        _one_of(f"{key}.dist", self.dist, PAUSE_DISTS)
        _require(self.value >= 0 and math.isfinite(self.value), f"{key}.value", "must be >= 0", self.value)
        _require(self.mean > 0 and math.isfinite(self.mean), f"{key}.mean", "must be > 0", self.mean)
        _require(self.sigma >= 0 and math.isfinite(self.sigma), f"{key}.sigma", "must be >= 0", self.sigma)
        if self.dist == "pareto":
            _require(self.alpha > 1 and math.isfinite(self.alpha), f"{key}.alpha", "must be > 1 (a finite mean)", self.alpha)
        if self.max is not None:
            _require(self.max >= 0, f"{key}.max", "must be >= 0", self.max)


@dataclass
class ClientConfig:
    """One client of a multi-client synthetic workload; unset fields take the workload's.

    Checked by WorkloadConfig, which knows the entry's index for its error messages.
    """

    client_id: str = ""
    rate: float = 1.0  # requests per second
    arrival: Optional[str] = None
    cv: Optional[float] = None
    prompt_len: Optional[LengthConfig] = None
    output_len: Optional[LengthConfig] = None
    # How many requests it sends. None: those that arrive before workload.duration_s.
    num_requests: Optional[int] = None


@dataclass
class SharedPrefixConfig:
    """workload=shared_prefix (cbjax.workload.shared_prefix): each prompt is one of
    `num_groups` shared prefixes of `prefix_len` tokens (a system prompt, few-shot examples),
    group k drawn with Zipf weight 1 / (k + 1) ** zipf_s (0: uniform), then its own suffix
    of workload.prompt_len tokens."""

    num_groups: int = 8
    prefix_len: int = 512
    zipf_s: float = 1.0

    def __post_init__(self) -> None:
        _require(self.num_groups >= 1, "workload.shared_prefix.num_groups", "must be >= 1", self.num_groups)
        _require(self.prefix_len >= 1, "workload.shared_prefix.prefix_len", "must be >= 1", self.prefix_len)
        _require(
            self.zipf_s >= 0 and math.isfinite(self.zipf_s), "workload.shared_prefix.zipf_s", "must be >= 0", self.zipf_s
        )


@dataclass
class WorkloadConfig:
    name: str = "synthetic"
    num_requests: int = 256
    arrival: str = "all_at_once"
    rate: float = 4.0  # requests per second, poisson, gamma and uniform (evenly spaced)
    cv: float = 1.0  # gamma: coefficient of variation of inter-arrival times
    prompt_len: LengthConfig = field(default_factory=lambda: LengthConfig(dist="uniform", low=16, high=512))
    output_len: LengthConfig = field(
        default_factory=lambda: LengthConfig(dist="exponential", mean=128.0, max=1024)
    )
    # The client's sampling cap. None: each request's own output length.
    max_tokens: Optional[int] = None
    vocab_size: int = 512  # range of synthetic prompt token ids (the tiny model's vocabulary)
    # Multi-client synthetic workload: each client's requests carry its client_id (read by
    # scheduler=vtc and metrics' client_service); num_requests and the top-level lengths and
    # arrival process are then per-client defaults. duration_s: how long clients send.
    clients: list[ClientConfig] = field(default_factory=list)
    duration_s: Optional[float] = None
    # trace replay
    path: Optional[str] = None
    # auto (from the first line) | azure | azure2024 (the same schema) | burstgpt | mooncake | csv | jsonl
    format: str = "auto"
    # mooncake: prompt tokens per hash id (a block of a shared prefix); 512 in Mooncake's traces
    hash_block_size: int = 512
    limit: Optional[int] = None  # replay only the first N requests
    time_scale: float = 1.0  # arrival times are divided by this (2.0 replays twice as fast)
    # A request arriving later (after time_scale) is rejected with its reason: an absurd time
    # would zero its latencies in float64 and make the real engine wait for it. 1e7 s: ~116 days.
    max_arrival_s: float = 1e7
    shared_prefix: SharedPrefixConfig = field(default_factory=SharedPrefixConfig)
    # workload=sessions (cbjax.workload.sessions): num_sessions conversations, each of `turns`
    # turns; a turn's new input is a prompt_len draw, its output an output_len draw, and the
    # next turn arrives a `pause` draw after it ends. Sessions' first turns arrive by
    # `arrival` at `rate`. ShareGPT files take `pause` and the first turns' arrivals too.
    num_sessions: int = 64
    turns: LengthConfig = field(default_factory=lambda: LengthConfig(dist="fixed", value=4, max=64))
    pause: PauseConfig = field(default_factory=PauseConfig)

    def __post_init__(self) -> None:
        _one_of("workload.name", self.name, WORKLOADS)
        _one_of("workload.arrival", self.arrival, ARRIVALS)
        _one_of("workload.format", self.format, TRACE_FORMATS)
        _require(self.hash_block_size >= 1, "workload.hash_block_size", "must be >= 1", self.hash_block_size)
        _require(self.num_requests >= 1, "workload.num_requests", "must be >= 1", self.num_requests)
        _require(self.rate > 0 and math.isfinite(self.rate), "workload.rate", "must be > 0", self.rate)
        _require(self.cv > 0 and math.isfinite(self.cv), "workload.cv", "must be > 0", self.cv)
        _require(self.time_scale > 0 and math.isfinite(self.time_scale), "workload.time_scale", "must be > 0",
                 self.time_scale)  # fmt: skip
        _require(self.max_arrival_s > 0, "workload.max_arrival_s", "must be > 0", self.max_arrival_s)
        _require(self.vocab_size >= 2, "workload.vocab_size", "must be >= 2", self.vocab_size)
        if self.max_tokens is not None:
            _require(self.max_tokens >= 1, "workload.max_tokens", "must be >= 1", self.max_tokens)
        if self.limit is not None:
            _require(self.limit >= 1, "workload.limit", "must be >= 1", self.limit)
        if self.name == "trace":
            _require(bool(self.path), "workload.path", "is required for workload=trace", self.path)
        else:  # the trace's knobs: set on another workload they would be silently ignored
            _require(self.time_scale == 1.0, "workload.time_scale", "applies only to workload=trace", self.time_scale)
            _require(self.limit is None, "workload.limit", "applies only to workload=trace", self.limit)
        self.prompt_len.check("workload.prompt_len")
        self.output_len.check("workload.output_len")
        _require(self.num_sessions >= 1, "workload.num_sessions", "must be >= 1", self.num_sessions)
        self.turns.check("workload.turns")
        self.pause.check("workload.pause")
        if self.duration_s is not None:
            _require(self.duration_s > 0, "workload.duration_s", "must be > 0", self.duration_s)
            _require(bool(self.clients), "workload.duration_s", "applies only with workload.clients", self.duration_s)
        if self.clients:
            _require(self.name == "synthetic", "workload.clients", "needs workload=synthetic", self.name)
            self.clients = [_check_client(self, i, c) for i, c in enumerate(self.clients)]
            seen: dict[str, int] = {}
            for i, c in enumerate(self.clients):
                if c.client_id in seen:
                    raise ValueError(
                        f"workload.clients[{i}].client_id: duplicate {c.client_id!r} "
                        f"(also workload.clients[{seen[c.client_id]}])"
                    )
                seen[c.client_id] = i


def check_fits_model(workload: WorkloadConfig, max_model_len: int) -> None:
    """Raise ValueError when no request of `workload` could fit a model context of
    `max_model_len` tokens: shared_prefix prompts are the prefix plus at least
    workload.prompt_len.min suffix tokens, and a prompt needs room for one generated token."""
    if workload.name != "shared_prefix" or max_model_len <= 0:  # 0: the checkpoint's, not read yet
        return
    prefix, suffix = workload.shared_prefix.prefix_len, workload.prompt_len.min
    if prefix + suffix >= max_model_len:
        raise ValueError(
            f"workload.shared_prefix.prefix_len {prefix} plus workload.prompt_len.min {suffix} suffix "
            f"token(s) leaves no room to generate in model.max_model_len {max_model_len}: every request "
            "would be rejected; shorten the prefix or use a model with a longer context"
        )


def _check_client(workload: WorkloadConfig, i: int, entry: Any) -> ClientConfig:
    """Entry i of workload.clients as a checked ClientConfig (a plain dict after with_overrides)."""
    key = f"workload.clients[{i}]"
    if isinstance(entry, dict):
        entry = dict(entry)
        unknown = sorted(set(entry) - {f.name for f in dataclasses.fields(ClientConfig)})
        if unknown:
            raise ValueError(f"{key}: unknown keys {unknown}")
        for name in ("prompt_len", "output_len"):
            if isinstance(entry.get(name), dict):
                entry[name] = LengthConfig(**entry[name])
        entry = ClientConfig(**entry)
    c = entry
    c.client_id = str(c.client_id)
    _require(bool(c.client_id), f"{key}.client_id", "must be a non-empty string", c.client_id)
    _require(c.rate > 0 and math.isfinite(c.rate), f"{key}.rate", "must be > 0", c.rate)
    arrival = c.arrival or workload.arrival
    _one_of(f"{key}.arrival", arrival, ARRIVALS)
    if c.cv is not None:
        _require(c.cv > 0 and math.isfinite(c.cv), f"{key}.cv", "must be > 0", c.cv)
    if c.num_requests is not None:
        _require(c.num_requests >= 1, f"{key}.num_requests", "must be >= 1", c.num_requests)
    elif arrival == "all_at_once" or workload.duration_s is None:
        raise ValueError(f"{key}: set num_requests (or workload.duration_s, with an arrival process)")
    for name in ("prompt_len", "output_len"):
        if getattr(c, name) is not None:
            getattr(c, name).check(f"{key}.{name}")
    return c
