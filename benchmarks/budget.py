"""One deferral budget for digits and non-digits: how many letters and overlaid digits a model
defers for a given share of deferred digits, and the share of digits it must defer to reach
issue 33's letters (90 %) and overlays (80 %) targets.

    python -m benchmarks.budget NAME|DIR ... [--per-group 500] [--seeds 0 [1 2]] [--deferral 0.045]
                                             [--scores snr [eu tu maxprob]]

The served rule defers an image when ``p1 − k·s1 ≤ p2 + k·s2`` (paper Section 3.2), i.e. when its
SNR ``(p1 − p2) / (s1 + s2)`` is at most ``k`` (up to float rounding at equality, which the
thresholds avoid: :func:`budget`): one SNR ranking of the test digits and the suite's
images therefore answers every ``k`` at once. ``--deferral`` picks the ``k`` that defers that
share of the 1,600 test digits (the calibrated ``k`` aims at 4.5 % on the validation digits).
The SNR of the served decision (``Predictor.score_columns``: the model's served members); suite
images answered as an upload is (``Predictor.predict``), and one in which the reading finds no
digit is deferred at every ``k``, as the server answers it (its SNR counts as −∞). Printed only: how the default model's README
compares recipes whose calibrated ``k`` moved.

``--scores`` ranks by other served scores too, each as a rule "defer the images scoring worst"
at the same share of digits: ``eu`` and ``tu`` (paper Section 3.3, defer the highest) and
``maxprob`` (the mean's top probability, defer the lowest; the softmax-margin baseline). The
served rule is ``snr``; the others say whether a different rule over the same members would
meet the targets — i.e. whether the limit is the rule or the ranking the members give.
``--seeds`` draws the suite afresh for each seed (seed 0 is the one every card reports).
"""

from __future__ import annotations

import argparse
from collections.abc import Sized
from typing import cast

import numpy as np
import torch

from benchmarks.peers import model_dir
from models.data import load_dataset
from models.data_ood.suite import ood_suite
from models.predictor import Predictor
from models.serving import ScoreColumns

#: issue 33's deferral targets of the two groups whose budget competes with the digits'
TARGETS = {"letters": 0.90, "overlaid_digits": 0.80}

#: The rankings ``--scores`` offers, each as a served answer's key and its sign: every score is
#: turned into an SNR-like one (deferred ⇔ at most a threshold) by that sign.
SCORES = {"snr": ("snr", 1.0), "eu": ("eu", -1.0), "tu": ("tu", -1.0), "maxprob": ("p1", 1.0)}


def budget(
    digits: np.ndarray, group: np.ndarray, deferral: float, target: float
) -> tuple[float, float]:
    """``(share of group deferred at the k that defers `deferral` of digits, share of digits
    deferred at the k that defers `target` of the group)``, from SNRs (deferred ⇔ SNR ≤ k).

    The first k lies halfway between the digit that reaches the share and the next larger one
    (as :func:`models.evaluation.calibration.calibrate_abstain_k` places the served k), so that no
    digit sits on it: exactly at a sample's own SNR the served rule ``p̄1 − k s1 ≤ p̄2 + k s2``
    and ``SNR ≤ k`` can disagree by float rounding (and the SNR's ``+ ε``). The second is the
    group's own sample that reaches the target: the least k that does, which a digit equals only
    by chance."""
    k = _between(digits, deferral)
    need = np.quantile(group, target, method="inverted_cdf")
    return float((group <= k).mean()), float((digits <= need).mean())


def _between(values: np.ndarray, share: float) -> float:
    """A threshold under which exactly the lowest ``share`` of ``values`` (rounded up to whole
    samples) lie: halfway from the last of them to the next larger value (+∞ past the top)."""
    ordered = np.sort(values)
    n = max(1, int(np.ceil(share * len(ordered) - 1e-9)))  # samples to defer (inverted_cdf)
    last = ordered[n - 1]
    above = ordered[ordered > last]
    return float(last if not above.size or not np.isfinite(last) else (last + above[0]) / 2)


def _column(columns: ScoreColumns, key: str) -> np.ndarray:
    """A served column, or the mean's top probability for ``p1``."""
    return columns.top_probabilities[:, 0] if key == "p1" else columns.column(key)


def _ranks(predictor: Predictor, x: torch.Tensor, scores: list[str]) -> dict[str, np.ndarray]:
    """Each of ``scores`` as an SNR-like ranking (deferred ⇔ at most a threshold) of the served
    decision (the model's served members and rule), ``(B,)`` each; ``x`` normalised
    ``(B, Cin, H, W)``."""
    columns = predictor.score_columns(predictor.forward(x), predictor.options(top_k=1))
    return {s: SCORES[s][1] * _column(columns, SCORES[s][0]) for s in scores}


def _suite_ranks(
    predictor: Predictor, images: np.ndarray, scores: list[str]
) -> dict[str, np.ndarray]:
    """:func:`_ranks` of uint8 ``(n, H, W)`` uploads answered as served
    (:meth:`Predictor.predict`): −∞ where the reading finds no digit (deferred at every
    threshold, as the server answers it)."""
    answers = predictor.predict([torch.from_numpy(im) for im in images])
    ok = np.array([a["input_check"] == "ok" for a in answers])

    def value(a: dict, key: str) -> float:
        return float(a["probabilities"][0]["probability"] if key == "p1" else a[key])

    return {
        s: np.where(ok, SCORES[s][1] * np.array([value(a, SCORES[s][0]) for a in answers]), -np.inf)
        for s in scores
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="zoo names or trained directories")
    ap.add_argument("--per-group", type=int, default=500)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="suite draws")
    ap.add_argument("--deferral", type=float, default=0.045)
    ap.add_argument("--scores", nargs="+", choices=list(SCORES), default=["snr"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    suites = {seed: ood_suite(args.per_group, seed, list(TARGETS)) for seed in args.seeds}
    test = load_dataset("mnist-bundled").test
    digits = torch.stack([test[i][0] for i in range(len(cast(Sized, test)))])  # (1600, 1, 28, 28)
    seeds = "/".join(map(str, args.seeds))
    head = " | ".join(
        f"{g} deferred at {args.deferral:.1%} of digits | digits deferred for {t:.0%} of {g}"
        for g, t in TARGETS.items()
    )
    print(f"suite seeds {seeds}: one value per seed")
    print(f"| model | score | {head} |\n|---|---|{'---|' * 2 * len(TARGETS)}")
    for name in args.models:
        predictor = Predictor.from_dir(model_dir(name))
        ranks_digits = _ranks(predictor, digits, args.scores)
        ranks_suite = {
            (seed, g): _suite_ranks(predictor, suite[g], args.scores)
            for seed, suite in suites.items()
            for g in TARGETS
        }
        for score in args.scores:
            cells = []
            for group, target in TARGETS.items():
                pairs = [
                    budget(ranks_digits[score], ranks_suite[seed, group][score],
                           args.deferral, target)
                    for seed in args.seeds
                ]  # fmt: skip
                cells += ["/".join(f"{got:.1%}" for got, _ in pairs),
                          "/".join(f"{need:.1%}" for _, need in pairs)]  # fmt: skip
            print(f"| {name} | {score} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
