"""The predictor interface, the oracle and the running mean, and `make_predictor` from a config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from cbjax.core.request import Request

if TYPE_CHECKING:
    from cbjax.config import SchedulerConfig


class Predictor(Protocol):
    # False: every request gets the same prediction at a given time (rank them fcfs).
    per_request: bool

    def predict(self, request: Request) -> float:
        """Predicted total output length in tokens, from what is known at arrival."""

    def observe(self, request: Request) -> None:
        """A request finished: its `num_generated` is its true output length."""


class OraclePredictor:
    """The true output length of a length-only request; max_tokens when the model decides."""

    per_request = True

    def predict(self, request: Request) -> float:
        # max_output_len is set when the scheduler accepts the request: min(target, max_tokens,
        # room left under max_model_len); stop_length() is the same before acceptance.
        return float(request.max_output_len or request.stop_length())

    def observe(self, request: Request) -> None:
        pass


class MeanPredictor:
    """The running mean of finished requests' output lengths (0 until the first one finishes)."""

    per_request = False

    def __init__(self) -> None:
        self.num_observed = 0
        self.total = 0

    def predict(self, request: Request) -> float:
        return self.total / self.num_observed if self.num_observed else 0.0

    def observe(self, request: Request) -> None:
        self.num_observed += 1
        self.total += request.num_generated


def make_predictor(cfg: "SchedulerConfig") -> Predictor:
    if cfg.predictor == "oracle":
        return OraclePredictor()
    if cfg.predictor == "mean":
        return MeanPredictor()
    if cfg.predictor == "learned":
        from cbjax.predictor.learned import LearnedPredictor

        if not cfg.predictor_path:
            raise ValueError("scheduler.predictor_path is required for predictor=learned")
        return LearnedPredictor.load(cfg.predictor_path)
    raise ValueError(f"scheduler.predictor: unknown value {cfg.predictor!r}; choose oracle, mean or learned")
