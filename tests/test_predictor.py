"""Length predictors: Kendall's tau, the learned model's training, file round trip, and sjf using it."""

import math
import subprocess
import sys

import numpy as np
import pytest

from conftest import make_requests
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.engine.offline import serve
from cbjax.predictor import (
    LearnedPredictor, MeanPredictor, OraclePredictor, feature_matrix, kendall_tau, prompt_features,
)
from cbjax.predictor.data import correlated_requests, output_lengths
from cbjax.predictor.features import NUM_FEATURES
from cbjax.scheduler import Scheduler
from cbjax.sim import SimExecutor, UnitCost


def test_kendall_tau_by_hand():
    # pairs of [1,2,3,4] vs [1,3,2,4]: 5 concordant, 1 discordant (2,3) -> (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # tau-b with a tie in x: 2 concordant, 0 discordant, sqrt(2 untied x pairs * 3 untied y pairs)
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(2 * 3))
    assert math.isnan(kendall_tau([1, 1], [1, 2]))
    with pytest.raises(ValueError, match="shapes"):
        kendall_tau([1, 2], [1, 2, 3])


def test_no_requests_have_an_empty_feature_matrix():
    """A history with no usable request (a trace read in the wrong format: every line an input
    error) reaches the trainer's own "need at least 2" message, not a numpy error."""
    assert feature_matrix([], 512).shape == (0, NUM_FEATURES)


def test_kendall_tau_matches_the_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 8, 60), rng.integers(0, 8, 60)  # many ties
    pairs = [(i, j) for i in range(60) for j in range(i + 1, 60)]
    s = sum(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]) for i, j in pairs)
    untied_x = sum(x[i] != x[j] for i, j in pairs)
    untied_y = sum(y[i] != y[j] for i, j in pairs)
    assert kendall_tau(x, y, chunk=7) == pytest.approx(s / math.sqrt(untied_x * untied_y))


def test_listmle_loss_by_hand():
    from cbjax.predictor.train import listmle_loss

    # two items, longer first: -log P = -log(e^s1 / (e^s1 + e^s2)) - log(e^s2 / e^s2) = log(1 + e^(s2 - s1))
    loss = listmle_loss(np.array([[2.0, 0.5]], dtype=np.float32))
    assert float(loss) == pytest.approx(math.log1p(math.exp(0.5 - 2.0)), rel=1e-5)


def test_oracle_and_mean_predictors():
    a, b = make_requests([7, 3], max_tokens=5)
    assert OraclePredictor().predict(a) == 5 and OraclePredictor().predict(b) == 3  # min(target, max_tokens)
    mean = MeanPredictor()
    assert mean.predict(a) == 0.0
    a.num_generated, b.num_generated = 5, 3
    mean.observe(a)
    mean.observe(b)
    assert mean.predict(a) == mean.predict(b) == 4.0 and not mean.per_request


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A predictor trained on 800 requests of the explicitly correlated synthetic workload:
    topic t (token ids mostly from the lower or upper half of the vocabulary) and prompt length
    set the output length, log(out) = log(24) + 1.5 t + 0.5 log(prompt_len / 64) + N(0, 0.5^2)."""
    from cbjax.predictor.train import train_predictor

    history = correlated_requests(800, seed=1)
    predictor = train_predictor(feature_matrix(history, 512), output_lengths(history), 512, steps=200)
    path = tmp_path_factory.mktemp("predictor") / "predictor.npz"
    predictor.save(path)
    return predictor, path


def test_learned_predictor_ranks_held_out_requests(trained):
    predictor, _ = trained
    held_out = correlated_requests(600, seed=2)
    features, lengths = feature_matrix(held_out, 512), output_lengths(held_out)
    tau = kendall_tau(predictor.scores(features), lengths)
    tau_prompt_len = kendall_tau(features[:, 0], lengths)
    # the topic, seen only through token-id statistics, carries most of the signal
    assert tau > 0.45 and tau > tau_prompt_len + 0.2, (tau, tau_prompt_len)
    # calibrated lengths are in tokens: within 2x of the truth for most requests
    ratio = predictor.lengths(features) / lengths
    assert np.mean((ratio > 0.5) & (ratio < 2.0)) > 0.6


def test_saved_predictor_round_trips_and_bad_files_are_named(trained, tmp_path):
    predictor, path = trained
    loaded = LearnedPredictor.load(path)
    features = feature_matrix(correlated_requests(50, seed=3), 512)
    np.testing.assert_array_equal(loaded.lengths(features), predictor.lengths(features))
    assert loaded.vocab_size == 512 and loaded.loss == "listmle"
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a predictor")
    with pytest.raises(ValueError, match="not a saved length predictor"):
        LearnedPredictor.load(bad)
    with pytest.raises(ValueError, match="scheduler.predictor_path"):
        LearnedPredictor.load(tmp_path / "missing.npz")


def test_request_without_token_ids_gets_an_imputed_prediction(trained):
    predictor, _ = trained
    (req,) = make_requests([10], prompt_lens=[64])  # length-only, no ids or synthetic seed
    assert np.isnan(feature_matrix([req], 512)[0, 1:]).all()
    assert 1.0 < predictor.predict(req) < 1000.0


def test_predicting_a_seeded_prompt_reads_its_ids_without_keeping_them(trained):
    """A length-only request with a synthetic seed has its ids drawn for the features, as the
    prefix cache does, without holding them on the request: kept, a long trace's prompts
    would all stay in memory for one read each."""
    predictor, _ = trained
    (req,) = make_requests([10], prompt_lens=[64])
    req.synthetic_prompt = (7, 512)
    ids = np.random.default_rng(7).integers(0, 512, size=64).tolist()  # the seeded draw
    expected = float(predictor.lengths(prompt_features(ids, 64, 512)[None, :])[0])
    assert predictor.predict(req) == expected
    assert req.prompt_token_ids is None


def test_sjf_with_the_learned_predictor_beats_fcfs(trained):
    _, path = trained
    latency = {}
    for name, kw in [("fcfs", {}), ("learned", dict(predictor="learned", predictor_path=str(path))), ("oracle", {})]:
        requests = correlated_requests(200, seed=4)
        policy = "fcfs" if name == "fcfs" else "sjf"
        cfg = SchedulerConfig(name=policy, max_num_seqs=8, max_num_batched_tokens=100_000, **kw)
        sched = Scheduler(cfg, CacheConfig(num_pages=4096, page_size=16), 100_000)
        serve(requests, sched, SimExecutor(UnitCost()))
        latency[name] = np.mean([r.finish_s - r.arrival_s for r in requests])
    assert latency["oracle"] < latency["learned"] < 0.8 * latency["fcfs"], latency


def test_sjf_learned_path_never_imports_jax(tmp_path, env_cpu):
    rng = np.random.default_rng(0)
    hidden = 4
    path = tmp_path / "p.npz"
    LearnedPredictor(
        feature_mean=np.zeros(NUM_FEATURES), feature_std=np.ones(NUM_FEATURES),
        w1=rng.normal(size=(NUM_FEATURES, hidden)), b1=np.zeros(hidden), w2=rng.normal(size=hidden),
        b2=np.zeros(()), calibration=np.array([1.0, 3.0]), vocab_size=512,
    ).save(path)  # fmt: skip
    code = (
        "import sys\n"
        "from cbjax.config import SchedulerConfig\n"
        "from cbjax.predictor.data import correlated_requests\n"
        "from cbjax.scheduler import make_policy\n"
        f"p = make_policy(SchedulerConfig(name='sjf', predictor='learned', predictor_path={str(path)!r}))\n"
        "for r in correlated_requests(5, 0): p.push(r)\n"
        "assert len(p) == 5\n"
        "assert 'jax' not in sys.modules, 'the sjf inference path imported jax'\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env_cpu, check=True, timeout=60)


@pytest.mark.parametrize(
    "field, value",
    [("steps", -1), ("steps", 0), ("hidden", 0), ("num_lists", 0), ("list_size", 1), ("learning_rate", -0.01),
     ("learning_rate", float("nan"))],
)  # fmt: skip
def test_training_settings_that_cannot_train_fail_naming_the_setting(field, value):
    """A negative or zero step count, an empty hidden layer, no lists, a list too short to hold
    an order, or a learning rate that is not positive would save an untrained (or inverted)
    predictor without a word."""
    from cbjax.predictor.train import train_predictor

    history = correlated_requests(20, seed=0)
    with pytest.raises(ValueError, match=field):
        train_predictor(feature_matrix(history, 512), output_lengths(history), 512, **{field: value})
