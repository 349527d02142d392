"""Typed run configuration: one dataclass per Hydra group, each checking its own rules.

The library never imports Hydra; `cbjax.cli` registers these schemas in Hydra's ConfigStore
so a misspelled key or a wrong type fails at startup with the key's name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

PREDICTORS = ("oracle", "mean", "learned")
PREEMPTION_MODES = ("recompute", "swap")
EXECUTORS = ("sim", "jax")
ATTENTION_IMPLS = ("auto", "native", "pallas", "ragged", "reference", "triton")
ARRIVALS = ("all_at_once", "poisson", "gamma", "uniform")
LENGTH_DISTS = ("fixed", "uniform", "exponential", "lognormal")
TRUNCATIONS = ("clip", "resample")
WORKLOADS = ("synthetic", "trace")
DTYPES = ("float32", "bfloat16")
MLP_KINDS = ("gated", "plain")
LOGGERS = ("none", "mlflow", "tensorboard", "wandb")
WANDB_MODES = ("offline", "online", "disabled")


def _require(cond: bool, key: str, msg: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"{key} {msg}, got {value!r}")


def _one_of(key: str, value: Any, allowed: Iterable[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}: unknown value {value!r}; choose one of {', '.join(allowed)}")


# Choice lists that have a registry are read from it, so a registered addition is selectable.
# Imported when a config is checked: the registries' modules import this one.
def policy_names() -> list[str]:
    from cbjax.scheduler.policy import POLICIES

    return list(POLICIES)


def allocation_names() -> list[str]:
    from cbjax.cache.allocator import ALLOCATIONS

    return list(ALLOCATIONS)


def cost_model_names() -> list[str]:
    from cbjax.sim.cost import COST_MODELS

    return list(COST_MODELS)


@dataclass
class SchedulerConfig:
    name: str = "fcfs"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    # recompute: drop the victim's K/V and prefill it again. swap: copy its pages to host
    # memory (cache.num_swap_pages) and back on readmission; recompute when that is full.
    preemption: str = "recompute"
    # Split prompts into chunks under max_num_batched_tokens, mixed with decodes (Sarathi-Serve).
    chunked_prefill: bool = False
    # Mix prefills and decodes in one iteration (Orca, Sarathi-Serve). False: an iteration with
    # prefill work runs only prefills, and decodes wait (vLLM's original scheduler).
    hybrid_batching: bool = True
    # Without hybrid batching, when both wait: false, prefill work goes first (vLLM's original
    # order); true, prefill and decode iterations alternate, so neither starves the other.
    alternate_phases: bool = False
    # static only: charge compute as a padded `generate` batch does: prompts padded to the
    # batch's longest, finished rows computed until the whole batch ends (Schedule.cost_rows).
    static_padding: bool = False
    # Policy knobs; each policy reads only its own (see cbjax/scheduler/policies/).
    priority_preempt: bool = False  # priority: a waiting request may evict a lower-priority one
    predictor: str = "oracle"  # sjf: oracle | mean | learned
    predictor_path: Optional[str] = None  # sjf with predictor=learned: a saved predictor (.npz)
    mlfq_num_queues: int = 5
    mlfq_base_quantum: int = 32  # tokens; queue i has quantum base * 2**i
    mlfq_preempt: bool = True  # FastServe preempts lower-queue requests at iteration level
    vtc_input_weight: float = 1.0  # service cost per prompt token
    vtc_output_weight: float = 2.0  # service cost per generated token
    # A policy from the user's own code, "package.module:ClassName" (a cbjax Policy subclass,
    # importable from the working directory or PYTHONPATH); it replaces `name`'s policy.
    policy_class: Optional[str] = None
    # Keyword arguments for the policy's constructor, after the config: its own knobs.
    policy_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _one_of("scheduler.name", self.name, policy_names())
        if self.policy_class is not None:
            module, _, cls = self.policy_class.partition(":")
            _require(
                bool(module and cls and all(part.isidentifier() for part in module.split(".") + cls.split("."))),
                "scheduler.policy_class",
                'must look like "package.module:ClassName"',
                self.policy_class,
            )
        _one_of("scheduler.preemption", self.preemption, PREEMPTION_MODES)
        _one_of("scheduler.predictor", self.predictor, PREDICTORS)
        if self.name == "sjf" and self.predictor == "learned":
            _require(
                bool(self.predictor_path),
                "scheduler.predictor_path",
                "is required for predictor=learned",
                self.predictor_path,
            )
        if self.static_padding:
            _require(self.name == "static", "scheduler.static_padding", "needs scheduler=static", self.name)
            if self.chunked_prefill:
                raise ValueError(
                    "scheduler.static_padding=true cannot combine with scheduler.chunked_prefill=true: "
                    "a padded batch prefills every prompt whole"
                )
        _require(self.mlfq_num_queues >= 1, "scheduler.mlfq_num_queues", "must be >= 1", self.mlfq_num_queues)
        _require(self.mlfq_base_quantum >= 1, "scheduler.mlfq_base_quantum", "must be >= 1", self.mlfq_base_quantum)
        for key in ("vtc_input_weight", "vtc_output_weight"):
            value = getattr(self, key)
            _require(value >= 0 and math.isfinite(value), f"scheduler.{key}", "must be >= 0", value)
        _require(self.max_num_seqs >= 1, "scheduler.max_num_seqs", "must be >= 1", self.max_num_seqs)
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "scheduler.max_num_batched_tokens",
            f"must be >= scheduler.max_num_seqs ({self.max_num_seqs}) so every decode fits",
            self.max_num_batched_tokens,
        )


@dataclass
class CacheConfig:
    page_size: int = 16
    # An int, or "auto": sized as vLLM does from hardware.mem_bytes x memory_utilization minus
    # the weights (resolved by `cbjax.run.resolve`, reported in summary.json's num_pages).
    num_pages: Any = 4096
    memory_utilization: float = 0.9
    # paged: pages on demand. reserve_max | reserve_pow2 | reserve_oracle: Orca-style contiguous
    # runs reserved at admission for the maximum length, prompt + next power of two of the
    # output, or prompt + output (see cbjax.cache.reservation).
    allocation: str = "paged"
    # reserve_*: where a run goes. first_fit: the lowest free run that holds it. buddy: rounded
    # up to a power of two of pages at an aligned place, as a buddy allocator does.
    reservation_fit: str = "first_fit"
    # Share full pages with an identical token prefix between requests, and keep released ones
    # cached (evicted LRU once the free list is empty) for later requests.
    prefix_caching: bool = False
    # Host pages for scheduler.preemption=swap. None: as many as num_pages.
    num_swap_pages: Optional[int] = None

    def __post_init__(self) -> None:
        _one_of("cache.allocation", self.allocation, allocation_names())
        _one_of("cache.reservation_fit", self.reservation_fit, ("first_fit", "buddy"))
        _require(self.page_size >= 1, "cache.page_size", "must be >= 1", self.page_size)
        if self.num_pages != "auto":
            _require(
                isinstance(self.num_pages, int) and not isinstance(self.num_pages, bool) and self.num_pages >= 2,
                "cache.num_pages",
                "must be an int >= 2 (page 0 is the null page) or auto",
                self.num_pages,
            )
        _require(
            0 < self.memory_utilization <= 1, "cache.memory_utilization", "must be in (0, 1]", self.memory_utilization
        )
        if self.allocation != "paged" and self.prefix_caching:
            raise ValueError(
                f"cache.allocation={self.allocation} cannot combine with cache.prefix_caching=true: a "
                "reservation is one contiguous run, a shared prefix page lies elsewhere"
            )
        if self.num_swap_pages is not None:
            _require(self.num_swap_pages >= 0, "cache.num_swap_pages", "must be >= 0", self.num_swap_pages)

    @property
    def swap_capacity(self) -> int:
        """Host pages available to swap preemption."""
        if self.num_pages == "auto" and self.num_swap_pages is None:
            raise ValueError("cache.num_pages=auto must be resolved (cbjax.run.resolve) before use")
        return self.num_pages if self.num_swap_pages is None else self.num_swap_pages


@dataclass
class MeshConfig:
    """The device mesh of the JAX engine (cbjax.runtime.mesh)."""

    # Tensor parallelism: heads and MLP columns split over this many devices. 1: one device.
    tensor: int = 1

    def __post_init__(self) -> None:
        _require(self.tensor >= 1, "executor.mesh.tensor", "must be >= 1", self.tensor)


@dataclass
class ExecutorConfig:
    name: str = "sim"
    # sim
    cost_model: str = "roofline"
    # profiled: the profile.json that `python -m cbjax.profile` wrote for this model and machine
    profile: Optional[str] = None
    # jax
    # auto: the Pallas ragged kernel on GPU/TPU; on CPU `native` (the XLA formulation `ragged`,
    # whose work follows the pages each token reads, with its decode pass as a C++ custom call)
    # when the C++ kernel builds, else `ragged`. reference: the plain-jnp oracle.
    attention: str = "auto"
    # Token counts the one-forward step is compiled for (a step's flat buffer is padded up to
    # one). None: 1, 2, 4, 8, steps of ~sqrt(2) up to max_num_seqs, then doubling up to the
    # largest step, min(max_num_batched_tokens, max_num_seqs * max_model_len).
    token_buckets: Optional[list[int]] = None
    # JAX's persistent compilation cache: a rerun loads programs instead of compiling them.
    # None (null) turns it off.
    compilation_cache_dir: Optional[str] = "~/.cache/cbjax/jax"
    mesh: MeshConfig = field(default_factory=MeshConfig)

    def __post_init__(self) -> None:
        _one_of("executor.name", self.name, EXECUTORS)
        _one_of("executor.cost_model", self.cost_model, cost_model_names())
        if self.name == "sim" and self.cost_model == "profiled":
            _require(bool(self.profile), "executor.profile", "is required by cost_model=profiled (a profile.json)", self.profile)
        _one_of("executor.attention", self.attention, ATTENTION_IMPLS)
        if self.token_buckets is not None:
            _require(
                len(self.token_buckets) > 0 and all(int(b) >= 1 for b in self.token_buckets),
                "executor.token_buckets",
                "must be a non-empty list of sizes >= 1",
                self.token_buckets,
            )


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

    def check(self, key: str) -> None:
        _one_of(f"{key}.dist", self.dist, LENGTH_DISTS)
        _one_of(f"{key}.truncation", self.truncation, TRUNCATIONS)
        _require(self.min >= 1, f"{key}.min", "must be >= 1", self.min)
        _require(self.max >= self.min, f"{key}.max", f"must be >= {key}.min ({self.min})", self.max)
        if self.dist == "fixed":
            _require(self.value >= 1, f"{key}.value", "must be >= 1", self.value)
        if self.dist == "uniform":
            _require(1 <= self.low <= self.high, f"{key}.low", f"must be in [1, {key}.high]", self.low)
        if self.dist in ("exponential", "lognormal"):
            _require(self.mean > 0, f"{key}.mean", "must be > 0", self.mean)
        if self.dist == "lognormal":
            _require(self.sigma >= 0, f"{key}.sigma", "must be >= 0", self.sigma)


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
    format: str = "auto"  # auto | azure | csv | jsonl
    limit: Optional[int] = None  # replay only the first N requests
    time_scale: float = 1.0  # arrival times are divided by this (2.0 replays twice as fast)
    # A request arriving later (after time_scale) is rejected with its reason: an absurd time
    # would zero its latencies in float64 and make the real engine wait for it. 1e7 s: ~116 days.
    max_arrival_s: float = 1e7

    def __post_init__(self) -> None:
        _one_of("workload.name", self.name, WORKLOADS)
        _one_of("workload.arrival", self.arrival, ARRIVALS)
        _one_of("workload.format", self.format, ("auto", "azure", "csv", "jsonl"))
        _require(self.num_requests >= 1, "workload.num_requests", "must be >= 1", self.num_requests)
        _require(self.rate > 0 and math.isfinite(self.rate), "workload.rate", "must be > 0", self.rate)
        _require(self.cv > 0 and math.isfinite(self.cv), "workload.cv", "must be > 0", self.cv)
        _require(self.time_scale > 0, "workload.time_scale", "must be > 0", self.time_scale)
        _require(self.max_arrival_s > 0, "workload.max_arrival_s", "must be > 0", self.max_arrival_s)
        _require(self.vocab_size >= 2, "workload.vocab_size", "must be >= 2", self.vocab_size)
        if self.max_tokens is not None:
            _require(self.max_tokens >= 1, "workload.max_tokens", "must be >= 1", self.max_tokens)
        if self.limit is not None:
            _require(self.limit >= 1, "workload.limit", "must be >= 1", self.limit)
        if self.name == "trace":
            _require(bool(self.path), "workload.path", "is required for workload=trace", self.path)
        self.prompt_len.check("workload.prompt_len")
        self.output_len.check("workload.output_len")
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


@dataclass
class ModelConfig:
    """A Llama-family decoder. Used by the JAX engine and by the roofline cost model."""

    name: str = "tiny"
    vocab_size: int = 512
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    max_model_len: int = 1024
    tie_embeddings: bool = False
    dtype: str = "float32"
    mlp: str = "gated"  # gated: SwiGLU (Llama); plain: two matrices (OPT)
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    o_proj_bias: bool = False  # Llama checkpoints with attention_bias also bias o_proj
    mlp_bias: bool = False  # Llama's mlp_bias: gate/up/down biases
    norm_eps: float = 1e-5
    eos_token_id: Optional[int] = None
    # A local Hugging Face model directory (config.json, *.safetensors, maybe tokenizer.json).
    # Its config.json sets the architecture fields; with it, dtype "auto" and max_model_len 0
    # mean "the checkpoint's" (see cbjax.model.hf).
    path: Optional[str] = None

    def __post_init__(self) -> None:
        if self.dtype == "auto" or self.max_model_len == 0:
            _require(
                bool(self.path), "model.path", "is required by model=hf (dtype auto, max_model_len 0)", self.path
            )
        _one_of("model.dtype", self.dtype, DTYPES + (("auto",) if self.path else ()))
        _one_of("model.mlp", self.mlp, MLP_KINDS)
        for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim"):
            value = getattr(self, key)
            _require(value >= 1, f"model.{key}", "must be >= 1", value)
        if not (self.path and self.max_model_len == 0):
            _require(self.max_model_len >= 2, "model.max_model_len", "must be >= 2", self.max_model_len)
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_heads",
            f"must be a multiple of model.num_kv_heads ({self.num_kv_heads})",
            self.num_heads,
        )

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def num_params(self) -> int:
        """Parameter count, embeddings and LM head included."""
        d, hd = self.d_model, self.head_dim
        attn = d * self.num_heads * hd * 2 + d * self.num_kv_heads * hd * 2
        mlp = d * self.ffn_dim * (3 if self.mlp == "gated" else 2)
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * d) + embed + d

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass
class HardwareConfig:
    """An accelerator for the roofline cost model. Figures come from public datasheets."""

    name: str = "a100_80gb"
    peak_flops: float = 312e12  # dense bf16 tensor-core FLOP/s
    mem_bw: float = 2.039e12  # HBM bytes/s
    mem_bytes: float = 80e9
    flops_efficiency: float = 0.6  # achievable fraction of peak_flops
    bw_efficiency: float = 0.8  # achievable fraction of mem_bw
    overhead_s: float = 0.002  # fixed per-iteration cost: launch, scheduling, sampling
    # host cost per scheduled sequence per iteration (per-sequence sampling and bookkeeping)
    overhead_s_per_seq: float = 0.0
    # paged attention's fixed cost per KV page a sequence reads in an iteration, all layers
    # together (a page's loop step, table lookup and partial-result merge): small pages pay it often
    page_overhead_s: float = 0.0
    # Host<->device bytes/s for swap preemption. PCIe 4.0 x16 carries 31.5 GB/s each way
    # (16 GT/s x 16 lanes, 128b/130b encoding; PCI-SIG PCIe 4.0 spec); pinned copies reach ~25.
    host_bw: float = 25e9
    # Fixed cost of one host<->device copy call. Swapping copies each page's K and V per layer
    # separately (vLLM's per-block cudaMemcpyAsync), so small pages pay it often.
    host_copy_latency_s: float = 0.0
    # Tensor parallelism over num_devices identical devices (the figures above are per device):
    # weights, KV and FLOPs split evenly; two ring all-reduces of the activations per layer
    # over interconnect_bw (bytes/s each way per device, e.g. NVLink).
    num_devices: int = 1
    interconnect_bw: float = 300e9

    def __post_init__(self) -> None:
        _require(self.num_devices >= 1, "hardware.num_devices", "must be >= 1", self.num_devices)
        _require(self.host_copy_latency_s >= 0, "hardware.host_copy_latency_s", "must be >= 0", self.host_copy_latency_s)
        for key in ("peak_flops", "mem_bw", "mem_bytes", "host_bw", "interconnect_bw"):
            value = getattr(self, key)
            _require(value > 0, f"hardware.{key}", "must be > 0", value)
        for key in ("flops_efficiency", "bw_efficiency"):
            value = getattr(self, key)
            _require(0 < value <= 1, f"hardware.{key}", "must be in (0, 1]", value)
        _require(self.overhead_s >= 0, "hardware.overhead_s", "must be >= 0", self.overhead_s)
        _require(self.page_overhead_s >= 0, "hardware.page_overhead_s", "must be >= 0", self.page_overhead_s)
        _require(self.overhead_s_per_seq >= 0, "hardware.overhead_s_per_seq", "must be >= 0", self.overhead_s_per_seq)


@dataclass
class ExperimentConfig:
    """Arms are named sets of dotted overrides run one after another and compared."""

    name: str = "single"
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Each table: {title: str, arms: [name, ...], metrics: [key, ...]}; ratios are vs the first arm.
    tables: list[dict[str, Any]] = field(default_factory=list)
    # Published numbers to check against the arms' summaries (schema: cbjax.reproduction).
    reproduction: list[dict[str, Any]] = field(default_factory=list)
    # Where ours differs from the paper, the modelling difference that explains it (for
    # docs/REPRODUCTIONS.md, written by experiments/reproduce.py).
    notes: str = ""


@dataclass
class ServiceWeights:
    """VTC's service cost per token (Sheng et al., OSDI'24 use input 1, output 2)."""

    input: float = 1.0
    output: float = 2.0


@dataclass
class MetricsConfig:
    """What summary.json measures beyond the defaults (see cbjax.service)."""

    # client_service in summary.json and client_service.csv weigh tokens with these.
    service_weights: ServiceWeights = field(default_factory=ServiceWeights)
    # [start, end] in seconds: restrict the summary to this window (rules in cbjax.service).
    window_s: Optional[list[float]] = None
    # Bin width of client_service.csv. None: a hundredth of the run (or window).
    series_bin_s: Optional[float] = None

    def __post_init__(self) -> None:
        for key in ("input", "output"):
            value = getattr(self.service_weights, key)
            _require(value >= 0 and math.isfinite(value), f"metrics.service_weights.{key}", "must be >= 0", value)
        if self.window_s is not None:
            ok = len(self.window_s) == 2 and 0 <= self.window_s[0] < self.window_s[1] < math.inf
            _require(ok, "metrics.window_s", "must be [start, end] with 0 <= start < end", self.window_s)
            self.window_s = [float(x) for x in self.window_s]
        if self.series_bin_s is not None:
            _require(self.series_bin_s > 0, "metrics.series_bin_s", "must be > 0", self.series_bin_s)


@dataclass
class SLOConfig:
    """Latency targets: a served request meets its SLO when both hold (None: no target)."""

    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None

    def __post_init__(self) -> None:
        for key in ("ttft_s", "tpot_s"):
            value = getattr(self, key)
            if value is not None:
                _require(value > 0, f"slo.{key}", "must be > 0", value)


@dataclass
class LoggerConfig:
    """Experiment tracking of the `cbjax` command (cbjax.tracking); each backend reads its own knobs."""

    name: str = "none"
    experiment_name: str = "cbjax"  # MLflow experiment, W&B project
    run_name: Optional[str] = None  # None: the job's overrides in a sweep, else the run dir's name
    # mlflow. None: a file store, mlruns/ in the sweep dir (multirun) or the run dir (no server)
    tracking_uri: Optional[str] = None
    # tensorboard and wandb. None: tensorboard/ or wandb/ beside that mlruns/
    save_dir: Optional[str] = None
    wandb_mode: str = "offline"  # offline needs no account; `wandb sync` uploads later

    def __post_init__(self) -> None:
        _one_of("logger.name", self.name, LOGGERS)
        _one_of("logger.wandb_mode", self.wandb_mode, WANDB_MODES)
        _require(bool(self.experiment_name), "logger.experiment_name", "must be non-empty", self.experiment_name)


@dataclass
class DistributedConfig:
    """Multi-host JAX (cbjax.runtime.distributed): one process per host, all running the same
    sharded step; process 0 schedules and writes the outputs. Off while num_processes is 1."""

    coordinator_address: Optional[str] = None  # host:port of process 0
    num_processes: int = 1
    process_id: Optional[int] = None  # 0 .. num_processes - 1

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1

    def __post_init__(self) -> None:
        _require(self.num_processes >= 1, "distributed.num_processes", "must be >= 1", self.num_processes)
        if not self.enabled:
            return
        _require(
            bool(self.coordinator_address),
            "distributed.coordinator_address",
            "is required by distributed.num_processes > 1 (host:port of process 0)",
            self.coordinator_address,
        )
        _require(
            self.process_id is not None,
            "distributed.process_id",
            f"is required by distributed.num_processes={self.num_processes} (this process's index)",
            self.process_id,
        )
        _require(
            0 <= self.process_id < self.num_processes,
            "distributed.process_id",
            f"must be in [0, {self.num_processes})",
            self.process_id,
        )


@dataclass
class RunConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    seed: int = 0
    progress: bool = True
    # "requests completed in N iterations", the seeds' throughput measure
    window_iterations: int = 1000
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # A multirun skips a job whose dir holds a complete run of the same config; true reruns all.
    overwrite: bool = False
    # A summary.json key the job returns to a Hydra sweeper (optuna maximizes or minimizes it).
    optimized_metric: Optional[str] = None
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        _require(self.window_iterations >= 1, "window_iterations", "must be >= 1", self.window_iterations)
        if self.optimized_metric is not None:
            _require(
                not self.experiment.arms,
                "optimized_metric",
                f"needs a single run, but experiment {self.experiment.name!r} has arms",
                self.optimized_metric,
            )
        if self.distributed.enabled:
            n = self.distributed.num_processes
            _require(self.executor.name == "jax", "executor.name", f"must be jax with distributed.num_processes={n}", self.executor.name)
            _require(
                not self.experiment.arms,
                "experiment.arms",
                f"are not supported with distributed.num_processes={n} (a multi-host run serves one config)",
                sorted(self.experiment.arms),
            )
            _require(
                self.scheduler.preemption != "swap",
                "scheduler.preemption",
                f"swap is not supported with distributed.num_processes={n}; use recompute",
                self.scheduler.preemption,
            )
