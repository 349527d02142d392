"""A trained length predictor: a small MLP over prompt features, saved as .npz, run with numpy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cbjax.predictor.features import NUM_FEATURES, prompt_features, request_token_ids
from cbjax.core.request import Request

_ARRAYS = ("feature_mean", "feature_std", "w1", "b1", "w2", "b2", "calibration")


@dataclass
class LearnedPredictor:
    """score = w2 . tanh(w1 . z + b1) + b2 over standardized features z; higher means longer.

    A ranking loss fixes only the order of scores, so `calibration` (a, b) maps a score to a
    length: log(output_len) ~ a * score + b, fitted on the training set by least squares.
    Missing token statistics (a request with neither ids nor a synthetic seed) are imputed
    with the training mean.
    """

    feature_mean: np.ndarray  # f64[NUM_FEATURES]
    feature_std: np.ndarray  # f64[NUM_FEATURES]
    w1: np.ndarray  # f64[NUM_FEATURES, hidden]
    b1: np.ndarray  # f64[hidden]
    w2: np.ndarray  # f64[hidden]
    b2: np.ndarray  # f64[]
    calibration: np.ndarray  # f64[2]: a, b
    vocab_size: int
    loss: str = "listmle"

    per_request = True

    def __post_init__(self) -> None:
        hidden = self.b1.shape[0]
        expected = {
            "feature_mean": (NUM_FEATURES,), "feature_std": (NUM_FEATURES,), "w1": (NUM_FEATURES, hidden),
            "b1": (hidden,), "w2": (hidden,), "b2": (), "calibration": (2,),
        }  # fmt: skip
        for key, shape in expected.items():
            if np.shape(getattr(self, key)) != shape:
                raise ValueError(f"length predictor: {key} has shape {np.shape(getattr(self, key))}, expected {shape}")

    # ---- inference ----
    def scores(self, features: np.ndarray) -> np.ndarray:
        """features: f64[n, NUM_FEATURES] (NaN: unknown) -> f64[n] ranking scores."""
        x = np.where(np.isnan(features), self.feature_mean, features)
        z = (x - self.feature_mean) / self.feature_std
        return np.tanh(z @ self.w1 + self.b1) @ self.w2 + self.b2

    def lengths(self, features: np.ndarray) -> np.ndarray:
        """f64[n] predicted output lengths in tokens."""
        a, b = self.calibration
        return np.exp(np.clip(a * self.scores(features) + b, -20.0, 20.0))

    def predict(self, request: Request) -> float:
        x = prompt_features(request_token_ids(request), request.prompt_len, self.vocab_size)
        return float(self.lengths(x[None, :])[0])

    def observe(self, request: Request) -> None:
        pass

    # ---- files ----
    def save(self, path) -> None:
        """Write exactly `path` (np.savez alone would append .npz)."""
        with open(path, "wb") as f:
            arrays = {k: getattr(self, k) for k in _ARRAYS}
            np.savez(f, **arrays, vocab_size=np.int64(self.vocab_size), loss=np.str_(self.loss))

    @classmethod
    def load(cls, path) -> "LearnedPredictor":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"scheduler.predictor_path: {str(path)!r} is not a file")
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: np.asarray(data[k], dtype=np.float64) for k in _ARRAYS}
                return cls(**arrays, vocab_size=int(data["vocab_size"]), loss=str(data["loss"]))
        except (KeyError, OSError, ValueError) as e:
            raise ValueError(f"scheduler.predictor_path: {path} is not a saved length predictor: {e}") from e
