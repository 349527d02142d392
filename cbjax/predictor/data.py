"""Training histories: finished requests' prompts and output lengths, and a synthetic one with a known link."""

from __future__ import annotations

import numpy as np

from cbjax.core.request import Request, SamplingParams


def output_lengths(requests: list[Request]) -> np.ndarray:
    """i64[n]: each request's output length, for histories of length-only or finished requests."""
    return np.array([r.num_generated if r.is_finished else r.stop_length() for r in requests], dtype=np.int64)


def correlated_requests(num: int, seed: int, vocab_size: int = 512) -> list[Request]:
    """Length-only requests whose output length depends on the prompt, by construction.

    Each prompt has a topic t in {0, 1} (a fair coin). Topic 0 draws 80% of its token ids from
    the lower half of the vocabulary, topic 1 from the upper half; the other 20% are uniform.
    Prompt lengths are uniform in [16, 256]. Then, with e ~ N(0, 0.5^2):

        log(output_len) = log(24) + 1.5 * t + 0.5 * log(prompt_len / 64) + e

    so topic 1 asks for about 4.5x longer answers, and longer prompts for somewhat longer ones.
    """
    rng = np.random.default_rng(seed)
    topic = rng.integers(0, 2, size=num)
    prompt_lens = rng.integers(16, 256, size=num, endpoint=True)
    noise = rng.normal(0.0, 0.5, size=num)
    log_out = np.log(24.0) + 1.5 * topic + 0.5 * np.log(prompt_lens / 64.0) + noise
    output_lens = np.clip(np.rint(np.exp(log_out)), 1, 4096).astype(np.int64)
    half = vocab_size // 2
    requests = []
    for i in range(num):
        n = int(prompt_lens[i])
        low = half * int(topic[i])
        ids = rng.integers(low, low + half, size=n)
        uniform = rng.random(n) < 0.2
        ids[uniform] = rng.integers(0, vocab_size, size=int(uniform.sum()))
        out = int(output_lens[i])
        requests.append(
            Request(
                request_id=str(i),
                arrival_s=0.0,
                prompt_len=n,
                prompt_token_ids=ids.tolist(),
                sampling=SamplingParams(max_tokens=out, ignore_eos=True),
                target_output_len=out,
            )
        )
    return requests
