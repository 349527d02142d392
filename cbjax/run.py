"""Build a run from a RunConfig, serve it, and write its outputs; experiments compare arms."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any, Optional

from cbjax.config import RunConfig
from cbjax.config_merge import merge_overrides
from cbjax.engine import serve
from cbjax.metrics import summarize
from cbjax.plots import plot_comparison
from cbjax.report import comparison_table, format_summary, write_run
from cbjax.scheduler.core import Scheduler
from cbjax.workload import build_workload
from cbjax.workload.trace import encode_text_prompts


def resolve_model(cfg: RunConfig) -> RunConfig:
    """With model.path set, `cfg` with the model's fields read from the checkpoint's config.json,
    so the scheduler, the cost model and the executor all see the real model."""
    if not cfg.model.path:
        return cfg
    from cbjax.model.hf import load_config

    return dataclasses.replace(cfg, model=load_config(cfg.model))


def build_executor(cfg: RunConfig):
    cfg = resolve_model(cfg)
    if cfg.executor.name == "sim":
        from cbjax.sim import SimExecutor, make_cost_model

        return SimExecutor(make_cost_model(cfg.executor.cost_model, cfg.model, cfg.hardware))
    if cfg.executor.name == "jax":
        from cbjax.runtime.executor import JaxExecutor

        params = None
        if cfg.model.path:
            from cbjax.model.hf import load_params

            params = load_params(cfg.model)
        return JaxExecutor(cfg.model, cfg.cache, cfg.scheduler, cfg.executor, seed=cfg.seed, params=params)
    raise ValueError(f"executor.name: unknown executor {cfg.executor.name!r}")


def run_single(cfg: RunConfig, out_dir: Optional[Path] = None, *, verbose: bool = True) -> dict[str, Any]:
    """Serve the configured workload once; write summary.json, requests.jsonl, config.yaml."""
    cfg = resolve_model(cfg)
    requests = build_workload(cfg.workload, cfg.seed)
    tokenizer = None
    if cfg.model.path:
        from cbjax.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.path)
    encode_text_prompts(requests, tokenizer, where=f"model {cfg.model.name!r}")
    executor = build_executor(cfg)
    scheduler = Scheduler(
        cfg.scheduler,
        cfg.cache,
        cfg.model.max_model_len,
        validate=executor.validate,
        eos_token_id=cfg.model.eos_token_id,
        vocab_size=cfg.model.vocab_size,
    )
    executor.warmup()
    result = serve(requests, scheduler, executor, progress=cfg.progress)
    summary = summarize(result, cfg.window_iterations, cfg.slo.ttft_s, cfg.slo.tpot_s)
    if hasattr(executor, "metrics"):
        summary.update(executor.metrics())
    summary.update(
        {
            "scheduler": cfg.scheduler.policy_class or cfg.scheduler.name,
            "executor": cfg.executor.name,
            "cost_model": cfg.executor.cost_model if cfg.executor.name == "sim" else None,
            "allocation": cfg.cache.allocation,
            "model": cfg.model.name,
            "hardware": cfg.hardware.name,
            "seed": cfg.seed,
        }
    )
    if out_dir is not None:
        extra = None if executor.virtual_clock else (lambda r: _output_row(r, tokenizer))
        write_run(out_dir, cfg, summary, result.requests, extra_rows=extra)
    if verbose:
        print(format_summary(summary, title=f"{summary['scheduler']} ({cfg.executor.name})"))
    return summary


def _output_row(req, tokenizer) -> dict[str, Any]:
    row: dict[str, Any] = {"output_token_ids": req.output_token_ids}
    if tokenizer is not None:
        row["output_text"] = tokenizer.decode(req.output_token_ids)
    return row


def run_experiment(cfg: RunConfig, out_dir: Optional[Path] = None, *, verbose: bool = True) -> dict[str, Any]:
    """Run a single configuration, or every arm of `cfg.experiment` and compare them."""
    arms = cfg.experiment.arms
    if not arms:
        return run_single(cfg, out_dir, verbose=verbose)
    summaries: dict[str, dict[str, Any]] = {}
    for name, overrides in arms.items():
        arm_cfg = with_overrides(cfg, overrides, where=f"experiment.arms.{name}")
        if verbose:
            print(f"\n== arm {name} ==")
        summaries[name] = run_single(arm_cfg, out_dir / name if out_dir else None, verbose=False)
    tables = []
    for i, table in enumerate(cfg.experiment.tables):
        missing = [a for a in table["arms"] if a not in summaries]
        if missing:
            raise ValueError(f"experiment.tables[{i}]: unknown arms {missing}; arms are {list(summaries)}")
        tables.append(comparison_table(table["title"], list(table["arms"]), list(table["metrics"]), summaries))
    text = "\n\n".join(tables)
    if verbose:
        print("\n" + text)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "comparison.md").write_text(text + "\n")
        (out_dir / "comparison.json").write_text(json.dumps(summaries, indent=2) + "\n")
        plot_comparison(out_dir, summaries)
    return summaries


def with_overrides(cfg: RunConfig, overrides: dict[str, Any], where: str = "overrides") -> RunConfig:
    """A copy of `cfg` with a nested partial config typed-merged in (see `merge_overrides`)."""
    return merge_overrides(cfg, overrides, where)


def from_dict(cls, data: dict[str, Any]):
    """Build a (nested) config dataclass from plain dicts."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        ftype = hints[f.name]
        if dataclasses.is_dataclass(ftype) and isinstance(value, dict):
            value = from_dict(ftype, value)
        kwargs[f.name] = value
    return cls(**kwargs)
