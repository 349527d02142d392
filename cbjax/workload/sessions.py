"""workload=sessions: multi-turn conversations and agent loops, each turn waiting on the last.

`workload.num_sessions` sessions of a `workload.turns` draw of turns each. A session's first
turn arrives by `workload.arrival` at `workload.rate` (sessions per second); each later turn
arrives a `workload.pause` draw after the turn before it ends (`cbjax.engine.followups`): a
person's think time (exponential) or a tool call's heavy tail (lognormal, pareto). A turn's
new input is a `workload.prompt_len` draw and its output a `workload.output_len` draw, which it
generates exactly (ignore_eos). Its prompt is the whole conversation so far followed by its
new input, all of it one seeded token stream per session (the simulator names its pages by
that seed, the engine hashes them), so each turn's prefill can reuse the pages of the
earlier turns' prompts and outputs.

Request ids are "SESSION.TURN", `session_id` "SESSION", both counted from 0. Arrivals, lengths
and sampling seeds come from the synthetic workload's streams; turn counts and pauses from a
stream of their own, so changing them leaves the rest alone.
"""

from __future__ import annotations

import math

import numpy as np

from cbjax.config import PauseConfig, WorkloadConfig
from cbjax.core.request import Request
from cbjax.workload.synthetic import (
    arrival_times, prompt_seeds, rng_streams, sample_lengths, sampling_seeds, synthetic_request,
)  # fmt: skip

_SESSION_TAG = 0x73657373696F6E  # "session": keeps the turns' and pauses' streams apart


def session_streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """The generators of sessions' turn counts and of their pauses, derived from `seed`."""
    turns, pauses = np.random.SeedSequence([seed, _SESSION_TAG]).spawn(2)
    return np.random.default_rng(turns), np.random.default_rng(pauses)


def sample_pauses(cfg: PauseConfig, num: int, rng: np.random.Generator) -> np.ndarray:
    """Pauses in seconds, f64[num], clipped to `cfg.max` when it is set."""
    if cfg.dist == "fixed":
        draws = np.full(num, float(cfg.value))
    elif cfg.dist == "exponential":
        draws = rng.exponential(cfg.mean, size=num)
    elif cfg.dist == "lognormal":
        # mu such that the distribution's mean (not its median) is cfg.mean
        draws = rng.lognormal(math.log(cfg.mean) - cfg.sigma**2 / 2, cfg.sigma, size=num)
    elif cfg.dist == "pareto":
        # Pareto (Lomax + 1) of shape alpha and scale x_m has mean alpha x_m / (alpha - 1)
        scale = cfg.mean * (cfg.alpha - 1) / cfg.alpha
        draws = (rng.pareto(cfg.alpha, size=num) + 1.0) * scale
    else:
        raise ValueError(f"workload.pause.dist: unknown value {cfg.dist!r}")
    return draws if cfg.max is None else np.minimum(draws, cfg.max)


def build_sessions(cfg: WorkloadConfig, seed: int) -> list[Request]:
    """Every turn of `cfg.num_sessions` sessions, fully determined by `seed`: first turns with
    their arrival times, later turns held (`pause_s` set, arrival inf) in session order."""
    rngs = rng_streams(seed)
    turns_rng, pause_rng = session_streams(seed)
    num = cfg.num_sessions
    turns = sample_lengths(cfg.turns, num, turns_rng).tolist()
    total = int(sum(turns))
    arrivals = arrival_times(cfg.arrival, num, cfg.rate, cfg.cv, rngs["arrivals"]).tolist()
    new_lens = sample_lengths(cfg.prompt_len, total, rngs["prompt_len"]).tolist()
    output_lens = sample_lengths(cfg.output_len, total, rngs["output_len"]).tolist()
    pauses = sample_pauses(cfg.pause, total, pause_rng).tolist()
    session_seeds = prompt_seeds(num, rngs["token_ids"])
    seeds = sampling_seeds(total, rngs["sampling_seed"])
    requests, j = [], 0
    for s in range(num):
        for k in range(turns[s]):
            arrival = arrivals[s] if k == 0 else math.inf
            requests.append(
                synthetic_request(
                    cfg, f"{s}.{k}", arrival, new_lens[j], session_seeds[s], output_lens[j], seeds[j],
                    session_id=str(s), turn=k, more_turns=k < turns[s] - 1, pause_s=None if k == 0 else pauses[j],
                )  # fmt: skip
            )
            j += 1
    return requests
