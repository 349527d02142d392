"""workload=shared_prefix: groups of requests sharing a long prompt prefix, Zipf-popular.

Each request's prompt is its group's prefix (`workload.shared_prefix.prefix_len` tokens, a
system prompt or few-shot examples) followed by a suffix of its own (`workload.prompt_len`
tokens). Group k of `num_groups` is drawn with weight 1 / (k + 1) ** zipf_s, so group 0 is
the most popular; zipf_s = 0 draws groups uniformly. Arrivals, suffix and output lengths and
sampling seeds come from the synthetic workload's streams; the groups and the prefixes' ids
from one stream of their own, so changing them leaves the rest alone.
"""

from __future__ import annotations

import numpy as np

from cbjax.config import WorkloadConfig
from cbjax.core.request import Request, SamplingParams
from cbjax.workload.synthetic import arrival_times, rng_streams, sample_lengths, sampling_seeds

_GROUP_TAG = 0x707265666978  # "prefix": keeps the groups' stream apart from the others


def zipf_weights(num_groups: int, s: float) -> np.ndarray:
    """Popularity of groups 0..num_groups-1, f64[num_groups] summing to 1: 1 / (k + 1) ** s."""
    w = 1.0 / np.arange(1, num_groups + 1, dtype=np.float64) ** s
    return w / w.sum()


def build_shared_prefix(cfg: WorkloadConfig, seed: int) -> list[Request]:
    """`cfg.num_requests` requests in arrival order, fully determined by `seed`."""
    sp = cfg.shared_prefix
    num = cfg.num_requests
    rngs = rng_streams(seed)
    groups_rng = np.random.default_rng(np.random.SeedSequence([seed, _GROUP_TAG]))
    prefixes = groups_rng.integers(0, cfg.vocab_size, size=(sp.num_groups, sp.prefix_len)).tolist()
    groups = groups_rng.choice(sp.num_groups, size=num, p=zipf_weights(sp.num_groups, sp.zipf_s)).tolist()
    arrivals = arrival_times(cfg.arrival, num, cfg.rate, cfg.cv, rngs["arrivals"]).tolist()
    suffix_lens = sample_lengths(cfg.prompt_len, num, rngs["prompt_len"]).tolist()
    output_lens = sample_lengths(cfg.output_len, num, rngs["output_len"]).tolist()
    suffixes = rngs["token_ids"].integers(0, cfg.vocab_size, size=int(sum(suffix_lens))).tolist()
    seeds = sampling_seeds(num, rngs["sampling_seed"])
    requests = []
    lo = 0
    for i in range(num):
        suffix = suffixes[lo : lo + suffix_lens[i]]
        lo += suffix_lens[i]
        prompt = prefixes[groups[i]] + suffix
        requests.append(
            Request(
                request_id=str(i),
                arrival_s=arrivals[i],
                prompt_len=len(prompt),
                prompt_token_ids=prompt,
                sampling=SamplingParams(
                    max_tokens=cfg.max_tokens if cfg.max_tokens is not None else output_lens[i],
                    ignore_eos=True,
                    seed=seeds[i],
                ),
                target_output_len=output_lens[i],
            )
        )
    return requests
