"""Output-length predictors for length-aware scheduling: oracle, running mean and learned (numpy).

Nothing here imports jax; training lives in `cbjax.predictor.train`, imported explicitly.
"""

from cbjax.predictor.base import MeanPredictor, OraclePredictor, Predictor, make_predictor
from cbjax.predictor.features import NUM_FEATURES, feature_matrix, prompt_features
from cbjax.predictor.learned import LearnedPredictor
from cbjax.predictor.metrics import kendall_tau

__all__ = [
    "NUM_FEATURES", "LearnedPredictor", "MeanPredictor", "OraclePredictor", "Predictor",
    "feature_matrix", "kendall_tau", "make_predictor", "prompt_features",
]  # fmt: skip
