"""Typed run configuration: one dataclass per Hydra group, each checking its own rules.

The library never imports Hydra; `cbjax.app.cli` registers these schemas in Hydra's ConfigStore
so a misspelled key or a wrong type fails at startup with the key's name.

The groups live by job: the engine's (scheduler, cache, executor, distributed) and the run
here, the workload in `workload`, the model and hardware in `machine`, a stack's host costs in
`overhead`, what a run reports in `reporting`; every name is importable from `cbjax.config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from cbjax.config.checks import _class_path, _one_of, _require
from cbjax.config.cluster import BACKENDS, ClusterConfig
from cbjax.config.machine import DTYPES, MLP_KINDS, HardwareConfig, ModelConfig
from cbjax.config.overhead import OverheadConfig
from cbjax.config.spec import ACCEPTANCE_MODELS, SPEC_METHODS, SPEC_POLICIES, SpecConfig, check_spec_model
from cbjax.config.reporting import (
    LOGGERS, WANDB_MODES, ExperimentConfig, LoggerConfig, MetricsConfig, ServiceWeights, SLOConfig,
)  # fmt: skip
from cbjax.config.workload import (
    ARRIVALS, LENGTH_DISTS, TRUNCATIONS, WORKLOADS, ClientConfig, LengthConfig, PauseConfig, WorkloadConfig,
    check_fits_model,
)  # fmt: skip

__all__ = [
    "PREDICTORS", "PREEMPTION_MODES", "EXECUTORS", "ARRIVALS", "LENGTH_DISTS", "TRUNCATIONS",
    "WORKLOADS", "DTYPES", "MLP_KINDS", "LOGGERS", "WANDB_MODES",
    "SchedulerConfig", "CacheConfig", "MeshConfig", "ExecutorConfig", "LengthConfig", "PauseConfig",
    "ClientConfig", "WorkloadConfig", "ModelConfig", "HardwareConfig", "OverheadConfig", "ExperimentConfig", "ServiceWeights",
    "MetricsConfig", "SLOConfig", "LoggerConfig", "DistributedConfig", "RunConfig",
    "ClusterConfig", "BACKENDS", "SpecConfig", "SPEC_METHODS", "SPEC_POLICIES", "ACCEPTANCE_MODELS",
]  # fmt: skip

PREDICTORS = ("oracle", "mean", "learned")
PREEMPTION_MODES = ("recompute", "swap")
EXECUTORS = ("sim", "jax")
# A value chosen from a registry (scheduler.name, cache.allocation, cache.host_eviction,
# executor.cost_model, executor.pace, executor.attention, executor.matmul, cluster.router) is checked against it
# where a config enters a run (`cbjax.app.choices`): the registries' packages import this one.


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
    # Every row is recomputed from its first token: no swap, host tier or P/D (K/V copied in).
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
        if self.policy_class is not None:
            _class_path("scheduler.policy_class", self.policy_class)
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
    # the weights (resolved by `cbjax.app.run.resolve`, reported in summary.json's num_pages).
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
    # cached (evicted LRU once the free list is empty) for later requests. On by default, as in
    # vLLM v1 and SGLang; a reproduction of a system without it sets it false.
    prefix_caching: bool = True
    # Host pages for scheduler.preemption=swap. None: as many as num_pages (with a host tier:
    # as many as host_pages, whose pool swap shares).
    num_swap_pages: Optional[int] = None
    # The host-memory tier of the prefix cache (cbjax.cache.host_tier): pages of host memory
    # that keep full pages evicted from the device pool for later requests to load back. 0: no
    # tier. Swap preemption shares the pool and takes precedence (it evicts tier pages).
    host_pages: int = 0
    # Which host page goes when the tier is full: lru, session (keep the pages of sessions whose
    # next turn is expected), or "package.module:ClassName" (a cbjax.cache.eviction.HostEviction).
    host_eviction: str = "lru"
    # Load a waiting request's host pages while it waits, beside other requests' steps.
    host_prefetch: bool = False

    def __post_init__(self) -> None:
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
                f"cache.allocation={self.allocation} cannot combine with cache.prefix_caching=true (on by "
                "default): a reservation is one contiguous run, a shared prefix page lies elsewhere; "
                "set cache.prefix_caching=false"
            )
        if self.num_swap_pages is not None:
            _require(self.num_swap_pages >= 0, "cache.num_swap_pages", "must be >= 0", self.num_swap_pages)
        self._check_host_tier()

    def _check_host_tier(self) -> None:
        _require(
            isinstance(self.host_pages, int) and not isinstance(self.host_pages, bool) and self.host_pages >= 0,
            "cache.host_pages", "must be an int >= 0 (0: no host tier)", self.host_pages,
        )  # fmt: skip
        if ":" in self.host_eviction:  # a built-in name is checked against its registry (cbjax.app.choices)
            _class_path("cache.host_eviction", self.host_eviction, 'must be a built-in policy or "package.module:ClassName"')
        if self.host_prefetch:
            _require(self.host_pages > 0, "cache.host_prefetch", "needs a host tier (cache.host_pages > 0)", True)
        if self.host_pages:
            _require(self.prefix_caching, "cache.host_pages", "needs cache.prefix_caching=true", self.host_pages)

    @property
    def swap_capacity(self) -> int:
        """Host pages available to swap preemption (with a host tier, within its pool)."""
        if self.num_pages == "auto" and self.num_swap_pages is None:
            raise ValueError("cache.num_pages=auto must be resolved (cbjax.app.run.resolve) before use")
        if self.host_pages:
            return self.host_pages if self.num_swap_pages is None else min(self.num_swap_pages, self.host_pages)
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
    # The step's weight matmuls. auto: `native` (a C++ kernel reading each layer's weights in
    # place from the stacked layers; several times XLA's speed at a decode step's few rows) on
    # CPU for a float32 model on one device when the kernel builds, else `xla` (jnp.tensordot).
    matmul: str = "auto"
    # Token counts the one-forward step is compiled for (a step's flat buffer is padded up to
    # one). None: 1, 2, 4, 8, steps of ~sqrt(2) up to max_num_seqs, then doubling up to the
    # largest step, min(max_num_batched_tokens, max_num_seqs * max_model_len).
    token_buckets: Optional[list[int]] = None
    # JAX's persistent compilation cache: a rerun loads programs instead of compiling them.
    # None (null) turns it off.
    compilation_cache_dir: Optional[str] = "~/.cache/cbjax/jax"
    # Pipelined serving (vLLM's async scheduling): the host schedules and packs step t+1 while
    # step t runs, and step t+1 reads step t's tokens on the device. Outputs are the same; a
    # request that stops on a token (EOS, a stop token) costs one wasted row in the step after.
    # One process without tensor parallelism only (elsewhere steps run one at a time).
    async_scheduling: bool = True
    # sim only: none, the virtual clock jumps (offline); realtime, it follows the wall clock and
    # each step's tokens are released at its simulated end (an endpoint with the model's latencies).
    pace: str = "none"
    mesh: MeshConfig = field(default_factory=MeshConfig)

    def __post_init__(self) -> None:
        _one_of("executor.name", self.name, EXECUTORS)
        if self.name == "sim" and self.cost_model == "profiled":
            _require(bool(self.profile), "executor.profile", "is required by cost_model=profiled (a profile.json)", self.profile)
        if self.pace != "none":
            _require(self.name == "sim", "executor.pace", "paces the simulator's clock; it needs executor=sim", self.pace)
        if self.token_buckets is not None:
            _require(
                len(self.token_buckets) > 0 and all(int(b) >= 1 for b in self.token_buckets),
                "executor.token_buckets",
                "must be a non-empty list of sizes >= 1",
                self.token_buckets,
            )


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
    overhead: OverheadConfig = field(default_factory=OverheadConfig)  # the serving stack's host costs
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
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # replicas, router, P/D (cbjax.cluster)
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding (cbjax.spec)

    def __post_init__(self) -> None:
        _require(self.window_iterations >= 1, "window_iterations", "must be >= 1", self.window_iterations)
        _require(self.seed >= 0, "seed", "must be >= 0", self.seed)  # numpy's generators take no negative seed
        check_fits_model(self.workload, self.model.max_model_len)
        if self.scheduler.static_padding:
            # The engine computes only the rows a plan schedules; padding is a cost-model charge.
            _require(
                self.executor.name == "sim",
                "scheduler.static_padding",
                "is a simulator charge (executor=sim); the engine runs the unpadded batch, so it cannot be used with executor=jax",
                self.scheduler.static_padding,
            )
            # A padded batch charges every row a prefill from its first token, as `generate`
            # computes it; a row whose K/V was copied in would pay the copy and that prefill.
            for key, copies in (
                ("scheduler.preemption=swap", self.scheduler.preemption == "swap"),
                ("cache.host_pages", self.cache.host_pages > 0),
                ("cluster.prefill_replicas/decode_replicas (P/D)", self.cluster.disaggregated),
            ):  # fmt: skip
                _require(not copies, "scheduler.static_padding", f"cannot combine with {key}: a padded batch "
                         "recomputes every row from its first token, so K/V copied in would be charged twice",
                         self.scheduler.static_padding)  # fmt: skip
        if self.spec.enabled:
            check_spec_model(self.spec, self.model)
            _require(
                not self.scheduler.static_padding, "spec.method",
                "cannot combine with scheduler.static_padding (a padded batch decodes one token a step)", self.spec.method,
            )  # fmt: skip
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
            _require(
                not self.cache.host_pages,
                "cache.host_pages",
                f"(a host tier) is not supported with distributed.num_processes={n}",
                self.cache.host_pages,
            )
