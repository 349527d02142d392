"""Build a run from a RunConfig, serve it, and write its outputs; experiments compare arms."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional

from cbjax.config import RunConfig
from cbjax.app.config_merge import merge_overrides
from cbjax.engine.offline import serve
from cbjax.report.metrics import request_row, spec_summary, summarize
from cbjax.report.files import RequestLog, atomic_write_text
from cbjax.core.stop import StopFlag
from cbjax.report.plots import plot_comparison
from cbjax.report.reproduction import check_entries, evaluate, format_rows, write_reproduction
from cbjax.report.reasons import format_reasons
from cbjax.report.tables import check_tables, comparison_table, format_summary, write_run
from cbjax.scheduler.core import Scheduler
from cbjax.report.service import ServiceLog, client_ids, service_series, service_summary, write_service_series
from cbjax.sim.pricing import build_scheduler
from cbjax.workload import build_workload
from cbjax.workload.trace import encode_text_prompts

log = logging.getLogger("cbjax")


def resolve_model(cfg: RunConfig) -> RunConfig:
    """With model.path set, `cfg` with the model's fields read from the checkpoint's config.json,
    so the scheduler, the cost model and the executor all see the real model."""
    if not cfg.model.path:
        return cfg
    from cbjax.model.hf import load_config

    return dataclasses.replace(cfg, model=load_config(cfg.model))


def resolve(cfg: RunConfig) -> RunConfig:
    """`cfg` with what depends on the model and hardware resolved: the checkpoint's fields
    (`resolve_model`) and `cache.num_pages=auto` sized from memory (`auto_num_pages`)."""
    cfg = resolve_model(cfg)
    if cfg.cache.num_pages != "auto":
        return cfg
    from cbjax.cache.sizing import auto_num_pages

    from cbjax.config.spec import separate_draft_model

    cache = cfg.cache
    draft = separate_draft_model(cfg.spec)
    num_pages = auto_num_pages(cfg.model, cfg.hardware, cache.page_size, cache.memory_utilization, draft)
    return dataclasses.replace(cfg, cache=dataclasses.replace(cache, num_pages=num_pages))


def build_executor(cfg: RunConfig, devices=None):
    """The run's executor; `devices`: the engine's own devices (a cluster replica's)."""
    cfg = resolve(cfg)
    if cfg.distributed.enabled:  # before jax starts its backends
        from cbjax.runtime.distributed import initialize

        initialize(cfg.distributed)
    if cfg.executor.name == "sim":
        from cbjax.sim import SimExecutor, make_cost_model
        from cbjax.sim.acceptance import make_acceptance

        cost = make_cost_model(
            cfg.executor.cost_model, cfg.model, cfg.hardware,
            scheduler=cfg.scheduler, cache=cfg.cache, executor=cfg.executor, overhead=cfg.overhead, spec=cfg.spec,
        )  # fmt: skip
        # the profiled model predicts this engine, which plans a step ahead with async_scheduling
        # (while speculating, each step waits for the accepted drafts)
        pipelined = cfg.executor.cost_model == "profiled" and cfg.executor.async_scheduling and not cfg.spec.enabled
        return SimExecutor(cost, pipelined=pipelined, acceptance=make_acceptance(cfg.spec, cfg.seed))
    if cfg.executor.name == "jax":
        from cbjax.runtime.executor import JaxExecutor

        llama = None
        if cfg.model.path:
            from cbjax.model.hf import load_model

            llama = load_model(cfg.model)
        draft = None
        if cfg.spec.method == "draft" and cfg.spec.draft_model is not None:
            from cbjax.config.spec import load_draft_model

            draft = load_draft_model(cfg.spec.draft_model)
        return JaxExecutor(
            cfg.model, cfg.cache, cfg.scheduler, cfg.executor, seed=cfg.seed, llama=llama, devices=devices,
            progress=cfg.progress, spec=cfg.spec, draft_model=draft,
        )  # fmt: skip
    raise ValueError(f"executor.name: unknown executor {cfg.executor.name!r}")


def run_single(
    cfg: RunConfig, out_dir: Optional[Path] = None, *, verbose: bool = True, stop: Optional[StopFlag] = None
) -> dict[str, Any]:
    """Serve the configured workload once; write summary.json, requests.jsonl, config.yaml.

    Rows stream to requests.jsonl.partial as requests finish. Once `stop` is set the run
    aborts what is unfinished and still writes all three files, with `interrupted: true`.
    With `cluster.replicas` > 1 or P/D pools the run is a cluster's (`run_cluster`)."""
    _warn_unread(cfg)
    if cfg.cluster.enabled:
        return run_cluster(cfg, out_dir, verbose=verbose, stop=stop)
    cfg = resolve(cfg)
    tokenizer = None
    if cfg.model.path:
        from cbjax.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.path)
    requests = build_workload(cfg.workload, cfg.seed, tokenizer)
    encode_text_prompts(requests, tokenizer, where=f"model {cfg.model.name!r}")
    executor = build_executor(cfg)
    scheduler = build_scheduler(cfg, executor)
    extra = None if executor.virtual_clock else (lambda r: _output_row(r, tokenizer))
    live = None
    if out_dir is not None:
        live = RequestLog(out_dir / "requests.jsonl", lambda r: {**request_row(r), **(extra(r) if extra else {})})
    # the engine compiles its sampler only if a request samples
    executor.warmup(sampling=any(r.sampling.temperature > 0 for r in requests))
    service_log = ServiceLog()
    try:
        result = serve(
            requests,
            scheduler,
            executor,
            progress=cfg.progress,
            stop=stop,
            on_finish=live.write if live else None,
            tick=live.tick if live else None,
            on_step=service_log.on_step,
            pace=cfg.executor.pace,
        )
    finally:
        executor.close()  # multi-host: the other processes stop stepping
    summary = build_summary(cfg, result, service_log, executor)
    if verbose:  # before the files: the console keeps the summary when the folder can't take them
        log.info(_with_reasons(format_summary(summary, title=f"{summary['scheduler']} ({cfg.executor.name})"), result))
    write_outputs(cfg, out_dir, result, service_log, executor, extra_rows=extra, summary=summary)
    if live is not None:
        live.close()
    return summary


def run_cluster(
    cfg: RunConfig, out_dir: Optional[Path] = None, *, verbose: bool = True, stop: Optional[StopFlag] = None
) -> dict[str, Any]:
    """`run_single` for a cluster (`cbjax.cluster`): the same three files, each row with its
    replica(s) and KV transfer time, summary.json with the `replicas` list. The simulator's
    cluster runs on a virtual clock (`ClusterSim`), the engine's on the wall clock
    (`ClusterEngine`), its replicas' executors each in a process of its own (`cluster.backend`).
    A replica that failed ends the run: the files are written, then its error is raised."""
    cfg = resolve_model(cfg)  # each pool sizes its own KV pool
    tokenizer = None
    if cfg.model.path:
        from cbjax.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.path)
    requests = build_workload(cfg.workload, cfg.seed, tokenizer)
    encode_text_prompts(requests, tokenizer, where=f"model {cfg.model.name!r}")
    cluster, shutdown = build_cluster(cfg)
    try:
        return _serve_cluster(cfg, cluster, requests, tokenizer, out_dir, verbose, stop)
    finally:
        shutdown()  # replica processes, Ray actors (and Ray, if the run started it) end with the run


def _serve_cluster(cfg, cluster, requests, tokenizer, out_dir, verbose, stop) -> dict[str, Any]:
    from cbjax.cluster.pools import sized

    extra = None if cfg.executor.name == "sim" else (lambda r: _output_row(r, tokenizer))

    def rows(r):
        return {**cluster.row_extras(r), **(extra(r) if extra else {})}

    live = None
    if out_dir is not None:
        live = RequestLog(out_dir / "requests.jsonl", lambda r: {**request_row(r), **rows(r)})
    result = cluster.serve(requests, stop=stop, on_finish=live.write if live else None)
    # `hardware` and `num_pages` are the run's, `num_pages=auto` resolved as a lone run resolves
    # it; each pool's own are in the `replicas` list
    summary = build_summary(sized(cfg), result, cluster.service_log, cluster.replicas[0].executor)
    summary.update(cluster.summary_fields(result))
    if verbose:  # before the files, as run_single
        title = f"{summary['scheduler']} ({cfg.executor.name}, {len(cluster.replicas)} replicas)"
        log.info(_with_reasons(format_summary(summary, title=title), result))
    write_outputs(
        cfg, out_dir, result, cluster.service_log, cluster.replicas[0].executor, extra_rows=rows,
        summary=summary,
    )  # fmt: skip
    if live is not None:
        live.close()
    if cluster.failure is not None:
        raise cluster.failure
    return summary


def _warn_unread(cfg: RunConfig) -> None:
    """Warn of a setting this run will not read, which a researcher may think it does. Not an
    error: a sweep over cost models may share one profile among its arms."""
    ex, oh = cfg.executor, cfg.overhead
    if ex.name == "sim" and ex.profile and ex.cost_model != "profiled":
        log.warning("executor.profile=%s is not read: executor.cost_model is %s, not profiled", ex.profile, ex.cost_model)
    if ex.name == "sim" and ex.cost_model == "unit" and (oh.step_s or oh.seq_s or oh.page_s or oh.copy_latency_s):
        log.warning("overhead=%s is not read: executor.cost_model=unit prices every step alike", oh.name)


def _with_reasons(table: str, result) -> str:
    """The run's table, and under it why requests were rejected or failed, if any were."""
    reasons = format_reasons(result.requests)
    return f"{table}\n\n{reasons}" if reasons else table


def build_cluster(cfg: RunConfig):
    """The cluster driver for `cfg` and the call that tears it down: simulated, or engine
    replicas on disjoint devices, each in a child process (`cluster.backend=processes`), in a
    Ray actor (`ray`) or all in this process (`inline`)."""
    if cfg.executor.name != "jax":
        from cbjax.cluster import ClusterSim

        return ClusterSim(cfg, build_executor), lambda: None
    from cbjax.cluster.engine import ClusterEngine, check_engine_supported
    from cbjax.cluster.router import make_router

    check_engine_supported(cfg)  # before any replica starts
    make_router(cfg.cluster.router, cfg.cluster.router_args)  # its arguments too (the cluster builds its own)
    backend = cfg.cluster.backend
    if backend == "inline":
        return ClusterEngine(cfg, cluster_executors(cfg)), lambda: None
    if backend == "processes":
        from cbjax.cluster.processes import ProcessReplicas

        replicas = ProcessReplicas(build_executor, cfg)
    else:
        try:
            from cbjax.cluster.ray_actors import RayReplicas
        except ModuleNotFoundError as err:
            raise ValueError(f"cluster.backend=ray needs Ray: pip install 'cbjax[ray]' ({err})") from None
        replicas = RayReplicas(build_executor)
    try:
        return ClusterEngine(cfg, replicas), replicas.shutdown
    except BaseException:
        replicas.shutdown()
        raise


def cluster_executors(cfg: RunConfig):
    """`make_executor` for an engine cluster in this process (`cluster.backend=inline`):
    replica i's executor on its own devices of this process's
    (`cbjax.runtime.mesh.replica_devices`), built in replica order."""
    from cbjax.cluster.pools import replica_configs
    from cbjax.runtime.mesh import replica_devices

    device_sets = iter(replica_devices([rcfg.executor.mesh.tensor for _, rcfg in replica_configs(cfg)]))
    return lambda rcfg: build_executor(rcfg, devices=next(device_sets))


def write_outputs(
    cfg: RunConfig, out_dir: Optional[Path], result, service_log: ServiceLog, executor, *, extra_rows=None,
    summary: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """summary.json, requests.jsonl, config.yaml and client_service.csv for a served run (offline
    or online), written to `out_dir` when it is set; returns the summary (`build_summary`'s,
    unless one is given)."""
    if summary is None:
        summary = build_summary(cfg, result, service_log, executor)
    if out_dir is not None:
        clients = client_ids(result.requests)
        write_service_series(out_dir, service_series(service_log, clients, cfg.metrics, result.makespan_s))
        write_run(out_dir, cfg, summary, result.requests, extra_rows=extra_rows)
    return summary


def build_summary(cfg: RunConfig, result, service_log: ServiceLog, executor) -> dict[str, Any]:
    """summary.json's fields for a finished (or interrupted) run."""
    summary = summarize(result, cfg.window_iterations, cfg.slo.ttft_s, cfg.slo.tpot_s)
    summary["interrupted"] = result.interrupted
    if "kv_host_pages_stored" in summary:  # a host KV tier's pages moved, in bytes each way
        page_bytes = cfg.cache.page_size * cfg.model.kv_bytes_per_token
        summary["kv_host_bytes_stored"] = summary["kv_host_pages_stored"] * page_bytes
        summary["kv_host_bytes_loaded"] = summary["kv_host_pages_loaded"] * page_bytes
    if cfg.spec.enabled:
        summary.update(spec_summary(result))
    summary.update(executor.metrics())
    summary.update(service_summary(result, service_log, cfg.metrics, cfg.slo))
    summary.update(
        {
            "scheduler": cfg.scheduler.policy_class or cfg.scheduler.name,
            "executor": cfg.executor.name,
            "cost_model": cfg.executor.cost_model if cfg.executor.name == "sim" else None,
            "allocation": cfg.cache.allocation,
            "num_pages": cfg.cache.num_pages,
            "page_size": cfg.cache.page_size,
            "model": cfg.model.name,
            "hardware": cfg.hardware.name,
            "overhead": cfg.overhead.name if cfg.executor.name == "sim" else None,
            # what a profiled simulator predicts: the engine as its profile ran it
            "profile_pinning": profile_pinning(cfg),
            "seed": cfg.seed,
        }
    )
    return summary


def profile_pinning(cfg: RunConfig) -> Optional[dict[str, Any]]:
    """The pinning of the engine a profiled simulator run predicts ({"cores", "cpus"}, from its
    profile); None for any other run, or a profile taken unpinned."""
    if cfg.executor.name != "sim" or cfg.executor.cost_model != "profiled":
        return None
    from cbjax.sim.profiled import load_profile

    profile = load_profile(cfg.executor.profile, cfg.model, cfg.cache.page_size, cfg.scheduler.max_num_seqs)
    return profile.get("pinning")


def summary_keys(cfg: RunConfig) -> set[str]:
    """The keys summary.json has for `cfg` in the simulator: those of a run of no requests."""
    from cbjax.sim import SimExecutor
    from cbjax.sim.cost import UnitCost

    cfg = resolve_model(cfg)
    executor = SimExecutor(UnitCost())
    cache = dataclasses.replace(cfg.cache, num_pages=16, num_swap_pages=None)  # no request needs a page
    if cfg.cluster.enabled:
        from cbjax.cluster import ClusterSim

        cluster = ClusterSim(dataclasses.replace(cfg, cache=cache), lambda _: SimExecutor(UnitCost()))
        result = cluster.serve([])
        return set(build_summary(cfg, result, cluster.service_log, executor)) | set(cluster.summary_fields(result))
    scheduler = Scheduler(cfg.scheduler, cache, cfg.model.max_model_len, validate=executor.validate)
    service_log = ServiceLog()
    result = serve([], scheduler, executor, on_step=service_log.on_step)
    return set(build_summary(cfg, result, service_log, executor))


def _output_row(req, tokenizer) -> dict[str, Any]:
    row: dict[str, Any] = {"output_token_ids": req.output_token_ids}
    if tokenizer is not None:
        row["output_text"] = tokenizer.decode(req.output_token_ids)
    return row


def run_experiment(
    cfg: RunConfig, out_dir: Optional[Path] = None, *, verbose: bool = True, stop: Optional[StopFlag] = None
) -> dict[str, Any]:
    """Run a single configuration, or every arm of `cfg.experiment` and compare them.

    Once `stop` is set, the arm being served saves its partial run and no further arm starts;
    the comparison covers the arms that finished and names the missing ones."""
    arms = cfg.experiment.arms
    if not arms:
        if cfg.experiment.reproduction:
            raise ValueError("experiment.reproduction: compares arms, and experiment.arms is empty")
        return run_single(cfg, out_dir, verbose=verbose, stop=stop)
    arm_cfgs = {name: with_overrides(cfg, o, where=f"experiment.arms.{name}") for name, o in arms.items()}
    entries, table_cfgs = cfg.experiment.reproduction, cfg.experiment.tables
    keys = {name: summary_keys(arm_cfg) for name, arm_cfg in arm_cfgs.items()} if entries or table_cfgs else {}
    if entries:
        check_entries(entries, keys)
    # before any arm runs: a misspelled arm or metric would otherwise fail (or show "-") at the end
    check_tables(table_cfgs, arms, {n: keys.get(n) if c.executor.name == "sim" else None for n, c in arm_cfgs.items()})
    summaries: dict[str, dict[str, Any]] = {}
    for name, arm_cfg in arm_cfgs.items():
        if stop is not None and stop.is_set():
            break
        if verbose:
            log.info("\n== arm %s ==", name)
        summary = run_single(arm_cfg, out_dir / name if out_dir else None, verbose=False, stop=stop)
        if not summary["interrupted"]:
            summaries[name] = summary
    missing = [name for name in arms if name not in summaries]
    tables = []
    for table in table_cfgs:
        if all(a in summaries for a in table["arms"]):
            tables.append(comparison_table(table["title"], list(table["arms"]), list(table["metrics"]), summaries))
    if missing:
        tables.append(f"Interrupted: arms {', '.join(missing)} are missing (finished: {', '.join(summaries) or 'none'}).")
    rows = evaluate(entries, summaries) if not missing else []
    if rows:
        tables.append("### Reproduction: paper vs ours\n\n" + format_rows(rows))
    text = "\n\n".join(tables)
    if verbose:
        log.info("\n" + text)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "comparison.md", text + "\n")
        atomic_write_text(out_dir / "comparison.json", json.dumps(summaries, indent=2) + "\n")
        if summaries:
            plot_comparison(out_dir, summaries)
        if rows:
            write_reproduction(out_dir, rows)
    return summaries


def with_overrides(cfg: RunConfig, overrides: dict[str, Any], where: str = "overrides") -> RunConfig:
    """A copy of `cfg` with a nested partial config typed-merged in (see `merge_overrides`)."""
    return merge_overrides(cfg, overrides, where)

