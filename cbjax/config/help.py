"""The --help pages of cbjax, cbjax-serve and cbjax-bench: what each command does, the config
groups it accepts with their options, and each group's main keys (no Hydra here: the CLIs hand
`help_page(command)` to Hydra as hydra.help.template).

Every key named here is a dotted path into the command's schema (RunConfig, ServeConfig,
BenchConfig), and every group is one the command's root config composes; tests/test_help.py
holds the pages to both, so a renamed key or a dropped group fails there.
"""

from __future__ import annotations

import textwrap
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cbjax.config.overhead import config_dir

WIDTH = 100
KEY_COLUMN = 36  # where a key's meaning starts
NBSP = "\u00a0"  # joins an option to its note, so a wrapped line never splits them


@dataclass(frozen=True)
class Group:
    """A config group (GROUP=OPTION picks configs/GROUP/OPTION.yaml), or, with `name` None, the
    keys outside any group."""

    name: Optional[str]
    meaning: str
    keys: tuple[tuple[str, str], ...]  # (dotted key, its meaning in one line)

    def with_keys(self, *keys: tuple[str, str]) -> Group:
        """This group with `keys` listed after its own."""
        return dataclasses.replace(self, keys=self.keys + keys)


@dataclass(frozen=True)
class Page:
    command: str
    root: str  # the root config's name: configs/ROOT.yaml
    about: tuple[str, str]  # what the command does, in two lines
    examples: tuple[tuple[str, str], ...]  # (command line, what it does)
    groups: tuple[Group, ...]
    docs: str


# The config groups the pages list, by name (GROUP=OPTION on the command line).
GROUPS = {group.name: group for group in (
    Group("scheduler", "the batching policy and its limits", (
        ("scheduler.max_num_seqs", "requests running at once (the batch's slots)"),
        ("scheduler.max_num_batched_tokens", "tokens one iteration may process"),
        ("scheduler.chunked_prefill", "true: long prompts in chunks, mixed with decodes"),
        ("scheduler.preemption", "recompute | swap: what a preempted request's KV becomes"),
        ("scheduler.policy_class", "your own policy class, as module:Class"),
    )),
    Group("executor", "what runs each step: sim, the simulator; jax, the real JAX engine", (
        ("executor.cost_model", "sim: a step's time: roofline | profiled | unit"),
        ("executor.profile", "sim, cost_model=profiled: the profile.json to read"),
        ("executor.attention", "jax: the attention kernel (auto picks one per platform)"),
        ("executor.token_buckets", "jax: the token counts the step is compiled for"),
    )),
    Group("workload", "the requests: arrivals and lengths, synthetic or a replayed trace", (
        ("workload.num_requests", "how many requests"),
        ("workload.arrival", "all_at_once | poisson | gamma | uniform"),
        ("workload.rate", "requests per second (poisson, gamma, uniform)"),
        ("workload.prompt_len", "a length distribution: .dist, .value, .low, .high, .mean"),
        ("workload.output_len", "the same, for the output"),
        ("workload.path", "workload=trace: the trace file to replay"),
    )),
    Group("model", "the decoder the engine runs and the cost model charges for", (
        ("model.max_model_len", "the longest prompt plus output a request may have"),
        ("model.path", "model=hf: a local Hugging Face model directory"),
        ("model.dtype", "float32 | bfloat16"),
    )),
    Group("hardware", "the accelerator the roofline cost model charges for", (
        ("hardware.num_devices", "tensor-parallel devices (the figures are per device)"),
        ("hardware.mem_bytes", "device memory in bytes (sizes cache.num_pages=auto)"),
    )),
    Group("overhead", "a serving stack's host costs, added to each simulated step", (
        ("overhead.step_s", "host seconds per iteration"),
        ("overhead.seq_s", "host seconds per scheduled sequence per iteration"),
    )),
    Group("cache", "the paged KV cache", (
        ("cache.num_pages", "KV pages: an int, or auto (what memory leaves; sim's default)"),
        ("cache.page_size", "tokens per page"),
        ("cache.prefix_caching", "true (default): requests share the pages of a common prefix"),
        ("cache.allocation", "paged | reserve_max | reserve_pow2 | reserve_oracle"),
    )),
    Group("cluster", "replicas behind a router; prefill/decode disaggregation", (
        ("cluster.replicas", "replicas behind the router"),
        ("cluster.router", "round_robin | least_loaded | least_kv | prefix_affinity | ..."),
        ("cluster.prefill_replicas", "with cluster.decode_replicas: the P/D pools"),
    )),
    Group("spec", "speculative decoding: drafts verified in the decode's step", (
        ("spec.method", "none | ngram | draft"),
        ("spec.num_tokens", "k: the most drafts per request per step"),
        ("spec.policy", "fixed | batch_size | goodput | module:Class: drafts per step"),
        ("spec.acceptance", "sim: fixed | per_position | trace (an engine's spec_trace.jsonl)"),
        ("spec.acceptance_rate", "sim, acceptance=fixed: each draft's chance to be accepted"),
    )),
    Group("metrics", "extra measures in summary.json", (
        ("metrics.window_s", "[start, end]: summarize only that span of the run"),
        ("metrics.service_weights", "the weights of input and output tokens in client_service"),
    )),
    Group("experiment", "arms (named sets of overrides) run one after another and compared", (
        ("experiment.arms", "the arms; each writes a folder, tables compare them"),
    )),
    Group("logger", "experiment tracking", (
        ("logger.experiment_name", "the MLflow experiment or W&B project"),
        ("logger.tracking_uri", "mlflow: the server (null: a file store beside the run)"),
    )),
    Group("hparams_search", "a Hydra sweeper over policy knobs (a multirun)", (
        ("optimized_metric", "the summary.json key the sweeper optimizes"),
    )),
    Group("server", "where the OpenAI-compatible server listens, how it treats clients", (
        ("server.host", "the address to listen on"),
        ("server.port", "the port (0: a free one, named in the listening line)"),
        ("server.api_key", "clients must send it as a bearer token (null: none)"),
        ("server.max_queue", "waiting requests beyond which a new one gets 429"),
        ("server.engine_process", "true: the JAX engine in a process of its own (executor=jax)"),
    )),
    Group("bench", "where the load goes and how each request is sent", (
        ("bench.url", "the server's OpenAI base URL, ending in /v1"),
        ("bench.concurrency", "null: open loop at arrival times; N: N requests in flight"),
        ("bench.endpoint", "completions | chat"),
        ("bench.prompt", "ids (token ids, exact lengths) | text"),
        ("bench.duration_s", "stop sending after this many seconds"),
    )),
)}  # fmt: skip

# cbjax-serve's executor group: paced to the wall clock, too
SERVE_EXECUTOR = GROUPS["executor"].with_keys(
    ("executor.pace", "sim: realtime (default) keeps to the wall clock; none: at once"),
)

# keys outside any group
SLO_KEYS = (
    ("slo.ttft_s", "TTFT target for goodput_req_s and slo_attainment"),
    ("slo.tpot_s", "TPOT target, likewise"),
)
RUN_KEYS = Group(None, "", (
    ("seed", "seeds the workload and the engine's random weights"),
    *SLO_KEYS,
    ("distributed.num_processes", "multi-host JAX: one process per host"),
))  # fmt: skip
SERVE_KEYS = Group(None, "", (("seed", "seeds the engine's random weights"), *SLO_KEYS))
BENCH_KEYS = Group(None, "", (("seed", "seeds the workload"), *SLO_KEYS))


def _groups(*names: str) -> tuple[Group, ...]:
    return tuple(GROUPS[name] for name in names)


DOCS = "README.md (quickstart), docs/usage.md (configs, workloads, outputs, sweeps)"
PAGES = {
    "cbjax": Page(
        command="cbjax",
        root="config",
        about=(
            "runs a workload of LLM requests through a continuous-batching scheduler, on the simulator",
            "or the real JAX engine; it prints a results table and writes summary.json and requests.jsonl.",
        ),
        examples=(
            ("cbjax scheduler=sjf workload.arrival=poisson workload.rate=8", "one run"),
            ("cbjax experiment=static_vs_continuous", "arms compared in one run"),
            ("cbjax -m scheduler=fcfs,sjf,mlfq", "a sweep: one job per value"),
        ),
        groups=(*_groups("scheduler", "executor", "workload", "model", "hardware", "overhead", "cache", "cluster",
                         "spec", "metrics", "experiment", "logger", "hparams_search"), RUN_KEYS),
        docs=DOCS,
    ),
    "cbjax-serve": Page(
        command="cbjax-serve",
        root="serve",
        about=(
            "serves a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions),",
            "scheduled by cbjax, on the JAX engine or on the simulator paced to the wall clock.",
        ),
        examples=(
            ("cbjax-serve executor=jax model=hf model.path=DIR", "a real checkpoint"),
            ("cbjax-serve model=tiny executor.cost_model=profiled executor.profile=FILE", "paced, profiled"),
        ),
        groups=(GROUPS["server"], SERVE_EXECUTOR,
                *_groups("scheduler", "model", "hardware", "overhead", "cache", "spec", "metrics"), SERVE_KEYS),
        docs="docs/serving.md (cbjax-serve), " + DOCS,
    ),
    "cbjax-bench": Page(
        command="cbjax-bench",
        root="bench",
        about=(
            "sends a cbjax workload to an OpenAI-compatible server (cbjax-serve, vLLM, ...) and reports",
            "the latency, throughput and goodput its client saw, in the files cbjax writes.",
        ),
        examples=(
            ("cbjax-bench bench.url=http://HOST:8000/v1 workload=sharegpt_like", "open loop"),
            ("cbjax-bench bench.concurrency=8 workload.num_requests=200", "closed loop"),
        ),
        groups=(*_groups("bench", "workload"), BENCH_KEYS),
        docs="docs/serving.md (cbjax-bench), " + DOCS,
    ),
}


def help_page(command: str, configs: Optional[Path] = None) -> str:
    """`command`'s --help text; a group's options are the files of configs/GROUP/."""
    page = PAGES[command]
    configs = configs if configs is not None else config_dir()
    defaults = root_defaults(configs / f"{page.root}.yaml")
    lines = [f"{page.command} {page.about[0]}", page.about[1], "", f"Usage: {page.command} [GROUP=OPTION ...] [KEY=VALUE ...]"]
    width = max(len(cmd) for cmd, _ in page.examples)
    lines += [f"  {cmd:<{width}}  # {what}" for cmd, what in page.examples]
    lines += ["", "Config groups (GROUP=OPTION; * the default, or each executor's) and their main keys:"]
    for group in page.groups:
        lines.append("")
        if group.name is None:
            lines.append("Other keys:")
        else:
            options = marked_options(configs, group.name, defaults.get(group.name))
            text = f"{group.name}: {group.meaning}. Options: {', '.join(options)}"
            lines += [line.replace(NBSP, " ") for line in textwrap.wrap(text, WIDTH, subsequent_indent="    ")]
        lines += [f"  {key:<{KEY_COLUMN - 3}} {meaning}" for key, meaning in group.keys]
    lines += ["", f"Every key: {page.command} --cfg job (the composed config). Hydra's flags: {page.command} --hydra-help."]
    lines += textwrap.wrap(f"Docs: {page.docs}.", WIDTH, subsequent_indent="    ")
    return "\n".join(lines)


def group_options(configs: Path, group: str) -> list[str]:
    return sorted(p.stem for p in (configs / group).glob("*.yaml"))


def marked_options(configs: Path, group: str, choice: Optional[str]) -> list[str]:
    """The group's options, the root's choice starred; a choice that follows the executor
    (`defaults/${executor}`) stars each executor's option and names the executor."""
    if choice is not None and choice.startswith("defaults/"):
        chosen = executor_defaults(configs, group)
        return [o + (f"*{NBSP}(executor={'|'.join(chosen[o])})" if o in chosen else "") for o in group_options(configs, group)]
    return [o + ("*" if o == choice else "") for o in group_options(configs, group)]


def executor_defaults(configs: Path, group: str) -> dict[str, list[str]]:
    """{option: the executors it is the default of}: configs/GROUP/defaults/EXECUTOR.yaml names
    its option in its defaults list, as `/GROUP/OPTION@PACKAGE`."""
    import yaml

    out: dict[str, list[str]] = {}
    for path in sorted((configs / group / "defaults").glob("*.yaml")):
        for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults", []):
            target = entry.split("@")[0] if isinstance(entry, str) else ""
            if target.startswith(f"/{group}/"):
                out.setdefault(target.rsplit("/", 1)[1], []).append(path.stem)
    return out


def root_defaults(path: Path) -> dict[str, str]:
    """The group choices a root config's defaults list makes (null ones left out)."""
    import yaml

    entries = (yaml.safe_load(path.read_text()) or {}).get("defaults", [])
    return {k: v for e in entries if isinstance(e, dict) for k, v in e.items() if isinstance(v, str) and "/" not in k}
