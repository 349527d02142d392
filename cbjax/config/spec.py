"""The spec group: speculative decoding, its speculation-length policy and, in the simulator, the
acceptance model (`cbjax.spec`, `cbjax.sim.acceptance`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from cbjax.config.checks import _class_path, _one_of, _require
from cbjax.config.machine import ModelConfig

SPEC_METHODS = ("none", "ngram", "draft")
SPEC_POLICIES = ("fixed", "batch_size", "goodput")
ACCEPTANCE_MODELS = ("fixed", "per_position", "trace")
# spec.policy=batch_size without a table: vLLM-style dynamic speculation, fewer drafts as the
# batch grows; each k is capped at spec.num_tokens (`default_batch_table`)
DEFAULT_BATCH_TABLE = {"1-16": 3, "17-64": 1, "65-1000000": 0}


@dataclass
class SpecConfig:
    """Speculative decoding: each decode may verify up to `num_tokens` drafts in its step."""

    # none: one token per decode step. ngram: prompt lookup on the host (the longest earlier
    # match of the last ngram_max..ngram_min tokens proposes what followed it). draft: a draft
    # model proposes (draft_model, or the target's first draft_layers layers and its head).
    method: str = "none"
    num_tokens: int = 3  # k: the most drafts per request per step
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: Optional[str] = None  # a configs/model name, or a path to such a YAML file
    draft_layers: Optional[int] = None  # self-speculation: the target's first N layers and its head
    # How many drafts each step: fixed (num_tokens) | batch_size (policy_args.table, by the
    # number of decodes) | goodput (the k of most expected tokens per second) | package.module:Class
    policy: str = "fixed"
    policy_args: dict[str, Any] = field(default_factory=dict)
    # The simulator's acceptance: fixed (each draft accepted with acceptance_rate, independently)
    # | per_position (draft i with acceptance_rates[i], the last rate beyond the list) | trace
    # (an engine run's spec_trace.jsonl at acceptance_path)
    acceptance: str = "fixed"
    acceptance_rate: float = 0.7
    acceptance_rates: list[float] = field(default_factory=list)
    acceptance_path: Optional[str] = None

    def __post_init__(self) -> None:
        _one_of("spec.method", self.method, SPEC_METHODS)
        _require(
            isinstance(self.num_tokens, int) and self.num_tokens >= 1, "spec.num_tokens", "must be an int >= 1",
            self.num_tokens,
        )  # fmt: skip
        _require(self.ngram_min >= 1, "spec.ngram_min", "must be >= 1", self.ngram_min)
        _require(
            self.ngram_max >= self.ngram_min, "spec.ngram_max", f"must be >= spec.ngram_min ({self.ngram_min})",
            self.ngram_max,
        )  # fmt: skip
        if self.method == "draft":
            _require(
                (self.draft_model is None) != (self.draft_layers is None),
                "spec.draft_model",
                "or spec.draft_layers: set exactly one with spec.method=draft",
                self.draft_model,
            )
        else:
            for key in ("draft_model", "draft_layers"):
                _require(getattr(self, key) is None, f"spec.{key}", "applies only with spec.method=draft", getattr(self, key))
        if self.draft_layers is not None:
            _require(self.draft_layers >= 1, "spec.draft_layers", "must be >= 1", self.draft_layers)
        if ":" in self.policy:
            _class_path("spec.policy", self.policy, 'must be fixed, batch_size, goodput or look like "package.module:Class"')
        else:
            _one_of("spec.policy", self.policy, SPEC_POLICIES)
        if self.policy == "batch_size":
            batch_table(self.policy_args.get("table", default_batch_table(self.num_tokens)), self.num_tokens,
                        "spec.policy_args.table")  # fmt: skip
        _one_of("spec.acceptance", self.acceptance, ACCEPTANCE_MODELS)
        _require(
            0.0 <= self.acceptance_rate <= 1.0, "spec.acceptance_rate", "must be in [0, 1]", self.acceptance_rate
        )
        if self.acceptance == "per_position":
            _require(len(self.acceptance_rates) > 0, "spec.acceptance_rates", "must list a rate per draft position "
                     "with spec.acceptance=per_position", self.acceptance_rates)  # fmt: skip
        for rate in self.acceptance_rates:
            _require(
                isinstance(rate, (int, float)) and 0.0 <= rate <= 1.0, "spec.acceptance_rates",
                "must hold rates in [0, 1]", self.acceptance_rates,
            )  # fmt: skip
        if self.acceptance == "trace":
            _require(
                bool(self.acceptance_path), "spec.acceptance_path",
                "is required by spec.acceptance=trace (a spec_trace.jsonl)", self.acceptance_path,
            )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.method != "none"


def default_batch_table(num_tokens: int) -> dict[str, int]:
    """DEFAULT_BATCH_TABLE with each k capped at `num_tokens`."""
    return {span: min(k, num_tokens) for span, k in DEFAULT_BATCH_TABLE.items()}


def batch_table(table: Any, num_tokens: int, key: str) -> list[tuple[int, int, int]]:
    """(lo, hi, k) per entry of a batch-size table such as {"1-16": 3, "17-64": 1, "65-4096": 0},
    sorted: k drafts while lo <= batch size <= hi (a size no range covers gets none). Ranges
    must not overlap; each k must be in [0, `num_tokens`]. Errors name `key`."""
    _require(isinstance(table, dict) and len(table) > 0, key, 'must be a mapping like {"1-16": 3, "17-64": 1}', table)
    out = []
    for span, k in table.items():
        lo, sep, hi = str(span).partition("-")
        ok = sep and lo.strip().isdigit() and hi.strip().isdigit() and 1 <= int(lo) <= int(hi)
        _require(bool(ok), key, f'has a bad range {span!r} (write "LO-HI", 1 <= LO <= HI)', table)
        _require(
            isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= num_tokens, key,
            f"maps {span!r} to {k!r}; drafts must be an int in [0, spec.num_tokens={num_tokens}]", table,
        )  # fmt: skip
        out.append((int(lo), int(hi), k))
    out.sort()
    for (_, hi, _), (lo, _, _) in zip(out, out[1:]):
        _require(lo > hi, key, f"has overlapping ranges (one ends at {hi}, the next starts at {lo})", table)
    return out


def check_spec_model(spec: SpecConfig, model: ModelConfig) -> None:
    """What the spec group needs of the target model: a draft of fewer layers, or a draft model of
    the same vocabulary. (A model.path checkpoint's fields are known only once it is read; the
    run checks again then, `cbjax.app.run.resolve`.)"""
    if spec.method != "draft":
        return
    if spec.draft_layers is not None:
        _require(
            spec.draft_layers < model.num_layers, "spec.draft_layers",
            f"must be below model.num_layers ({model.num_layers})", spec.draft_layers,
        )  # fmt: skip
        return
    draft = load_draft_model(spec.draft_model)
    _require(
        draft.vocab_size == model.vocab_size, "spec.draft_model",
        f"has vocab_size {draft.vocab_size}, the target model {model.name!r} has {model.vocab_size}; "
        "a draft must share the target's vocabulary", spec.draft_model,
    )  # fmt: skip


def draft_model_config(spec: SpecConfig, model: ModelConfig) -> Optional[ModelConfig]:
    """The draft's architecture: `spec.draft_model`'s config, or the target's first
    `spec.draft_layers` layers (its embeddings and head kept); None without a draft model."""
    if spec.method != "draft":
        return None
    if spec.draft_layers is not None:
        return replace(model, name=f"{model.name}[:{spec.draft_layers}]", num_layers=spec.draft_layers, path=None)
    return load_draft_model(spec.draft_model)


def separate_draft_model(spec: SpecConfig) -> Optional[ModelConfig]:
    """The draft model with weights and a KV pool of its own (`spec.draft_model`), or None (no
    speculation, n-gram drafts, or `spec.draft_layers`, which shares the target's)."""
    if spec.method != "draft" or spec.draft_model is None:
        return None
    return load_draft_model(spec.draft_model)


def load_draft_model(name: str) -> ModelConfig:
    """The model config `name` names: configs/model/NAME.yaml, or a path to a YAML file of
    ModelConfig keys. Errors name spec.draft_model."""
    from cbjax.config.overhead import config_dir

    path = Path(name) if str(name).endswith((".yaml", ".yml")) else config_dir() / "model" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in (config_dir() / "model").glob("*.yaml")))
        raise ValueError(f"spec.draft_model: unknown model {name!r} ({path} does not exist); choose one of {known}")
    stat = path.stat()
    return _load_model(path.resolve(), stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load_model(path: Path, mtime_ns: int) -> ModelConfig:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    data = OmegaConf.load(path)
    data.pop("defaults", None)
    unknown = sorted(set(data) - set(ModelConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"spec.draft_model: {path} has unknown keys {unknown}")
    try:  # typed as the command line types it
        model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), data))
    except (ValueError, OmegaConfBaseException) as err:
        raise ValueError(f"spec.draft_model: {path}: {str(err).splitlines()[0]}") from None
    if model.path:  # the engine's draft runs on seeded random weights, whatever path says
        raise ValueError(f"spec.draft_model: {path} sets path {model.path}; a draft model's weights are not "
                         "loaded from a checkpoint (its drafts would come from random weights); drop path")  # fmt: skip
    return model
