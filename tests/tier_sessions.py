"""Multi-turn sessions built by hand for the host KV tier's tests: turn t's prompt is turn t-1's
prompt plus new token ids, so a later turn's prefix is real ids the cache can hit."""

from __future__ import annotations

import numpy as np

from cbjax.core.request import Request, SamplingParams

# The hand-computed case (tests/test_host_tier.py, tests/test_host_tier_engine.py): sessions
# A, B and C of three turns of 8, 12 and 16 prompt tokens (4 new a turn), 2 output tokens each,
# run one at a time in this order, 10 s apart (each takes 2 one-second steps).
HAND_ORDER = ("A0", "A1", "B0", "B1", "C0", "C1", "A2", "B2", "C2")
HAND_PAGE_SIZE = 4
HAND_DEVICE_PAGES = 7  # 6 usable
HAND_HOST_PAGES = 8


def hand_sessions() -> list[Request]:
    """The hand-computed case's nine requests, in `HAND_ORDER`."""
    base = {"A": 100, "B": 200, "C": 300}  # distinct ids: sessions share nothing
    reqs = []
    for i, name in enumerate(HAND_ORDER):
        session, turn = name[0], int(name[1])
        ids = list(range(base[session], base[session] + 8 + 4 * turn))
        reqs.append(Request(
            name, 10.0 * i, len(ids), prompt_token_ids=ids, sampling=SamplingParams(max_tokens=2, ignore_eos=True),
            session_id=session, turn=turn, more_turns=turn < 2,
        ))  # fmt: skip
    return reqs


def random_sessions(
    num_sessions: int, num_turns: int, seed: int, vocab: int, first=(4, 20), new=(2, 12), out=(1, 12),
    round_s: float = 1000.0,
) -> list[Request]:
    """`num_sessions` sessions of `num_turns` turns with random lengths: every session's turn t
    arrives at t * `round_s` (plus a few ms of jitter), after every turn t-1 ended when a round
    takes less than `round_s`, and turn t's prompt is turn t-1's plus new random ids."""
    rng = np.random.default_rng(seed)
    reqs = []
    for s in range(num_sessions):
        ids: list[int] = []
        for t in range(num_turns):
            ids = ids + rng.integers(0, vocab, int(rng.integers(*(first if t == 0 else new)))).tolist()
            sampling = SamplingParams(max_tokens=int(rng.integers(*out)), ignore_eos=True)
            reqs.append(Request(
                f"s{s}t{t}", t * round_s + 1e-3 * s, len(ids), prompt_token_ids=list(ids), sampling=sampling,
                session_id=f"s{s}", turn=t, more_turns=t < num_turns - 1,
            ))  # fmt: skip
    return reqs


def fresh(req: Request) -> Request:
    """A new request with the same inputs and none of the scheduler's state."""
    return Request(
        req.request_id, req.arrival_s, req.prompt_len, list(req.prompt_token_ids), req.sampling,
        session_id=req.session_id, turn=req.turn, more_turns=req.more_turns,
    )  # fmt: skip
