"""Synthetic workloads: seeded arrival processes, length distributions and prompt token ids."""

from __future__ import annotations

import numpy as np

from cbjax.config import LengthConfig, WorkloadConfig
from cbjax.core.request import Request, SamplingParams

# One independent child stream per quantity, so that changing one distribution leaves the
# others' draws alone. SeedSequence children are keyed by position: append, never reorder.
STREAMS = ("arrivals", "prompt_len", "output_len", "token_ids", "sampling_seed")
_MAX_SEED = 2**31 - 1
_CLIENT_TAG = 0x636C69656E74  # "client": keeps per-client streams apart from single-stream ones


def rng_streams(seed: int) -> dict[str, np.random.Generator]:
    """One generator per name in STREAMS, all derived from `seed`."""
    if seed < 0:
        raise ValueError(f"workload seed must be >= 0, got {seed}")
    children = np.random.SeedSequence(seed).spawn(len(STREAMS))
    return {name: np.random.default_rng(child) for name, child in zip(STREAMS, children)}


def arrival_times(arrival: str, num: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in seconds, f64[num], non-decreasing.

    All but all_at_once are renewal processes started at t=0: the first request arrives one
    inter-arrival gap after 0, not at 0 (uniform: at 1/rate, 2/rate, ...).
    """
    if arrival == "all_at_once":
        return np.zeros(num)
    if arrival == "uniform":
        return np.arange(1, num + 1) / rate
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, size=num)
    elif arrival == "gamma":
        shape = 1.0 / (cv * cv)  # a gamma's CV is 1/sqrt(shape)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=num)
    else:
        raise ValueError(f"workload.arrival: unknown value {arrival!r}")
    return np.cumsum(gaps)


def arrivals_before(arrival: str, duration_s: float, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """The arrivals of a renewal process that fall before `duration_s`, f64[n]."""
    chunk = max(16, int(rate * duration_s * 1.1) + 1)
    parts = [arrival_times(arrival, chunk, rate, cv, rng)]
    while parts[-1][-1] < duration_s:
        parts.append(parts[-1][-1] + arrival_times(arrival, chunk, rate, cv, rng))
    times = np.concatenate(parts)
    return times[times < duration_s]


def _draw(cfg: LengthConfig, num: int, rng: np.random.Generator) -> np.ndarray:
    """`num` draws of the untruncated distribution, rounded, f64[num]."""
    if cfg.dist == "fixed":
        draws = np.full(num, float(cfg.value))
    elif cfg.dist == "uniform":
        draws = rng.integers(cfg.low, cfg.high, size=num, endpoint=True).astype(np.float64)
    elif cfg.dist == "exponential":
        draws = rng.exponential(cfg.mean, size=num)
    elif cfg.dist == "lognormal":
        # Choose mu so that the distribution's mean (not its median) is cfg.mean.
        mu = np.log(cfg.mean) - cfg.sigma**2 / 2
        draws = rng.lognormal(mu, cfg.sigma, size=num)
    else:
        raise ValueError(f"length dist: unknown value {cfg.dist!r}")
    return np.rint(draws)


# resample: rounds of redraws before a distribution that almost never lands in range is an error
_MAX_RESAMPLE_ROUNDS = 1000


def sample_lengths(cfg: LengthConfig, num: int, rng: np.random.Generator) -> np.ndarray:
    """Token lengths, i64[num]: draws rounded to the nearest integer, then clipped to [min, max]
    (`truncation=clip`), or the out-of-range ones redrawn until every one is inside
    (`truncation=resample`: the distribution conditioned on [min, max])."""
    draws = _draw(cfg, num, rng)
    if cfg.truncation == "resample":
        for _ in range(_MAX_RESAMPLE_ROUNDS):
            out = (draws < cfg.min) | (draws > cfg.max)
            if not out.any():
                break
            draws[out] = _draw(cfg, int(out.sum()), rng)
        else:
            raise ValueError(
                f"length truncation=resample: draws of {cfg.dist} (mean {cfg.mean}) almost never fall "
                f"in [{cfg.min}, {cfg.max}]"
            )
    return np.clip(draws, cfg.min, cfg.max).astype(np.int64)


def prompt_seeds(num: int, rng: np.random.Generator) -> list[int]:
    """Per-request seeds of synthetic prompt ids (drawn lazily by `Request.prompt_ids`)."""
    return rng.integers(0, 2**63 - 1, size=num, dtype=np.int64).tolist()


def sampling_seeds(num: int, rng: np.random.Generator) -> list[int]:
    """Per-request sampling seeds in [0, 2**31 - 1)."""
    return rng.integers(0, _MAX_SEED, size=num).tolist()


def build_synthetic(cfg: WorkloadConfig, seed: int) -> list[Request]:
    """`cfg.num_requests` requests in arrival order, fully determined by `seed`; with
    `cfg.clients`, every client's requests (ids numbered in arrival order, ties by client)."""
    if cfg.clients:
        return _build_clients(cfg, seed)
    rngs = rng_streams(seed)
    arrivals = arrival_times(cfg.arrival, cfg.num_requests, cfg.rate, cfg.cv, rngs["arrivals"])
    return _requests(cfg, arrivals, cfg.prompt_len, cfg.output_len, rngs, "default", 0)


def _requests(cfg: WorkloadConfig, arrivals, prompt_cfg, output_cfg, rngs, client_id: str, first_id: int):
    num = len(arrivals)
    arrivals = np.asarray(arrivals, dtype=np.float64).tolist()
    prompt_lens = sample_lengths(prompt_cfg, num, rngs["prompt_len"]).tolist()
    output_lens = sample_lengths(output_cfg, num, rngs["output_len"]).tolist()
    pseeds = prompt_seeds(num, rngs["token_ids"])
    seeds = sampling_seeds(num, rngs["sampling_seed"])
    return [
        synthetic_request(cfg, str(first_id + i), arrivals[i], prompt_lens[i], pseeds[i], output_lens[i], seeds[i],
                          client_id=client_id)  # fmt: skip
        for i in range(num)
    ]


def synthetic_request(
    cfg: WorkloadConfig, request_id: str, arrival_s: float, prompt_len: int, prompt_seed: int, output_len: int,
    seed: int, **fields,
) -> Request:
    """A request of `prompt_len` synthetic token ids (drawn from `prompt_seed`) that means to
    generate `output_len` tokens, sampled with `seed`; `fields` are further `Request` fields.
    Above `cfg.max_tokens` the target stays as drawn: the request stops on length."""
    return Request(
        request_id=request_id,
        arrival_s=arrival_s,
        prompt_len=prompt_len,
        synthetic_prompt=(prompt_seed, cfg.vocab_size),
        sampling=SamplingParams(
            max_tokens=cfg.max_tokens if cfg.max_tokens is not None else output_len, ignore_eos=True, seed=seed
        ),
        target_output_len=output_len,
        **fields,
    )


def _build_clients(cfg: WorkloadConfig, seed: int) -> list[Request]:
    """Each client draws from its own streams, keyed by (seed, its position in the list)."""
    if seed < 0:
        raise ValueError(f"workload seed must be >= 0, got {seed}")
    requests: list[Request] = []
    for j, c in enumerate(cfg.clients):
        children = np.random.SeedSequence([seed, _CLIENT_TAG, j]).spawn(len(STREAMS))
        rngs = {name: np.random.default_rng(child) for name, child in zip(STREAMS, children)}
        arrival = c.arrival or cfg.arrival
        cv = c.cv if c.cv is not None else cfg.cv
        if c.num_requests is not None:
            arrivals = arrival_times(arrival, c.num_requests, c.rate, cv, rngs["arrivals"])
        else:
            arrivals = arrivals_before(arrival, cfg.duration_s, c.rate, cv, rngs["arrivals"])
        prompt_cfg = c.prompt_len or cfg.prompt_len
        output_cfg = c.output_len or cfg.output_len
        requests += _requests(cfg, arrivals, prompt_cfg, output_cfg, rngs, c.client_id, 0)
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep client order
    for i, req in enumerate(requests):
        req.request_id = str(i)
    return requests
