"""Train an output-length predictor on a workload's history and report Kendall's tau on held-out requests.

    python experiments/train_length_predictor.py --correlated 3000 --out predictor.npz
    python experiments/train_length_predictor.py workload=trace workload.path=TRACE.csv --out p.npz
    cbjax scheduler=sjf scheduler.predictor=learned scheduler.predictor_path=predictor.npz

Positional arguments are Hydra overrides of the run config (its workload and seed are used);
`--correlated N` instead uses N synthetic requests whose output length depends on the prompt
by construction (see `cbjax.predictor.data.correlated_requests`). Held-out requests are a
seeded random split. The printed baseline ranks by prompt length alone.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from cbjax.predictor import feature_matrix, kendall_tau
from cbjax.predictor.data import correlated_requests, output_lengths
from cbjax.predictor.train import LOSSES, train_predictor
from cbjax.report.files import unwritable


def load_history(overrides: list[str], correlated: int, seed: int):
    """(requests, vocab_size) of the history to learn from."""
    if correlated:
        return correlated_requests(correlated, seed), 512
    from hydra import compose, initialize_config_dir

    from cbjax.app.cli import CONFIG_DIR, to_run_config
    from cbjax.workload import build_workload

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=overrides))
    return build_workload(cfg.workload, cfg.seed), cfg.workload.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. workload=trace workload.path=FILE")
    ap.add_argument("--correlated", type=int, default=0, metavar="N", help="use N correlated synthetic requests")
    ap.add_argument("--holdout", type=float, default=0.2, help="held-out fraction")
    ap.add_argument("--loss", choices=LOSSES, default="listmle")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="length_predictor.npz")
    args = ap.parse_args()
    if not 0 < args.holdout < 1:
        ap.error(f"--holdout must be in (0, 1), got {args.holdout}")
    if problem := unwritable(Path(args.out).resolve().parent):  # found now, not after training
        ap.error(f"--out: {problem}")

    requests, vocab_size = load_history(args.overrides, args.correlated, args.seed)
    requests = [r for r in requests if r.input_error is None and r.prompt_len >= 1]
    t0 = time.perf_counter()
    features = feature_matrix(requests, vocab_size)
    lengths = output_lengths(requests)
    order = np.random.default_rng(args.seed).permutation(len(requests))
    num_test = max(1, int(round(args.holdout * len(requests))))
    test, train = order[:num_test], order[num_test:]
    if len(train) < 2:
        ap.error(f"{len(requests)} requests leave {len(train)} to train on; need at least 2")
    t1 = time.perf_counter()
    try:
        predictor = train_predictor(
            features[train], lengths[train], vocab_size, loss=args.loss, steps=args.steps, seed=args.seed
        )
    except ValueError as e:  # a setting that cannot train, named (--steps)
        ap.error(str(e))
    t2 = time.perf_counter()
    predictor.save(args.out)

    def row(name: str, train_scores, test_scores) -> str:
        taus = kendall_tau(train_scores, lengths[train]), kendall_tau(test_scores, lengths[test])
        return f"{name:28}{taus[0]:8.3f}{taus[1]:10.3f}"

    print(f"requests: {len(train)} train, {len(test)} held out (features {t1 - t0:.1f}s, training {t2 - t1:.1f}s)")
    print(f"{'Kendall tau':28}{'train':>8}{'held-out':>10}")
    print(row(f"learned ({args.loss})", predictor.scores(features[train]), predictor.scores(features[test])))
    print(row("prompt length only", features[train, 0], features[test, 0]))
    print(f"saved: {args.out}")


if __name__ == "__main__":
    main()
