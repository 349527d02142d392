"""cbjax-bench's config: the `bench` group beside cbjax's workload and SLO groups (no Hydra here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

from cbjax.config import SLOConfig, WorkloadConfig
from cbjax.config.checks import _one_of, _require

ENDPOINTS = ("completions", "chat")
PROMPT_FORMATS = ("ids", "text")


@dataclass
class BenchClientConfig:
    """Where the load goes and how each request is sent."""

    url: str = "http://127.0.0.1:8000/v1"  # the OpenAI base (…/v1)
    model: Optional[str] = None  # None: the first model GET /models lists
    api_key: Optional[str] = None  # sent as `Authorization: Bearer <api_key>`
    # None: open loop, each request sent at its workload arrival time. N: closed loop, N
    # requests in flight, the next sent as one ends (arrival times ignored).
    concurrency: Optional[int] = None
    endpoint: str = "completions"  # completions | chat
    # ids: the prompt as token ids (exact lengths; completions only). text: `prompt_len`
    # words of filler text, or the workload's own text prompts.
    prompt: str = "ids"
    # Ask for exactly the workload's output length (vLLM's ignore_eos; OpenAI's own API refuses it).
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0  # per request
    # Stop sending after this long (None: the whole workload); requests not sent get no row.
    duration_s: Optional[float] = None

    def __post_init__(self) -> None:
        _require(self.url.startswith(("http://", "https://")), "bench.url", "must be an http(s) URL ending in /v1", self.url)
        _require(_address_ok(self.url), "bench.url", "needs a host, and a port from 1 to 65535 if it names one", self.url)
        if self.concurrency is not None:
            _require(self.concurrency >= 1, "bench.concurrency", "must be >= 1 (null: open loop)", self.concurrency)
        _one_of("bench.endpoint", self.endpoint, ENDPOINTS)
        _one_of("bench.prompt", self.prompt, PROMPT_FORMATS)
        if self.endpoint == "chat":
            _require(self.prompt == "text", "bench.prompt", "must be text with bench.endpoint=chat", self.prompt)
        _require(self.temperature >= 0, "bench.temperature", "must be >= 0", self.temperature)
        _require(self.timeout_s > 0, "bench.timeout_s", "must be > 0", self.timeout_s)
        if self.duration_s is not None:
            _require(self.duration_s > 0, "bench.duration_s", "must be > 0", self.duration_s)


def _address_ok(url: str) -> bool:
    """The URL names a host, and its port, if any, is one a socket can take."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError outside 0..65535 or when not a number
    except ValueError:
        return False
    return bool(parts.hostname) and port != 0


@dataclass
class BenchConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    bench: BenchClientConfig = field(default_factory=BenchClientConfig)
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        _require(self.seed >= 0, "seed", "must be >= 0", self.seed)  # numpy's generators take no negative seed
