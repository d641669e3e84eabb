"""One deferral budget for digits and non-digits: how many letters and overlaid digits a model
defers for a given share of deferred digits, and the share of digits it must defer to reach
issue 33's letters (90 %) and overlays (80 %) targets.

    python -m benchmarks.budget NAME|DIR ... [--per-group 500] [--seed 0] [--deferral 0.045]

The served rule defers an image when ``p1 − k·s1 ≤ p2 + k·s2`` (paper Section 3.2), i.e. when its
SNR ``(p1 − p2) / (s1 + s2)`` is at most ``k``: one SNR ranking of the test digits and the suite's
images therefore answers every ``k`` at once. ``--deferral`` picks the ``k`` that defers that
share of the 1,600 test digits (the calibrated ``k`` aims at 4.5 % on the validation digits).
The SNR of the served decision (``Predictor.score_columns``: the model's served members); suite
images answered as an upload is (``Predictor.predict``), and one in which the reading finds no
digit is deferred at every ``k``, as the server answers it (its SNR counts as −∞). Printed only: how the default model's README
compares recipes whose calibrated ``k`` moved.
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

#: issue 33's deferral targets of the two groups whose budget competes with the digits'
TARGETS = {"letters": 0.90, "overlaid_digits": 0.80}


def budget(
    digits: np.ndarray, group: np.ndarray, deferral: float, target: float
) -> tuple[float, float]:
    """``(share of group deferred at the k that defers `deferral` of digits, share of digits
    deferred at the k that defers `target` of the group)``, from SNRs (deferred ⇔ SNR ≤ k)."""
    k = np.quantile(digits, deferral, method="inverted_cdf")
    need = np.quantile(group, target, method="inverted_cdf")
    return float((group <= k).mean()), float((digits <= need).mean())


def _snr(predictor: Predictor, x: torch.Tensor) -> np.ndarray:
    """SNR of the served decision (the model's served members and rule), ``(B,)``; ``x``
    normalised ``(B, Cin, H, W)``."""
    return predictor.score_columns(predictor.forward(x), predictor.options()).column("snr")


def _suite_snr(predictor: Predictor, images: np.ndarray) -> np.ndarray:
    """SNR of uint8 ``(n, H, W)`` uploads answered as served (:meth:`Predictor.predict`): −∞
    where the reading finds no digit, which the server defers at every ``k``."""
    answers = predictor.predict([torch.from_numpy(im) for im in images])
    return np.array([a["snr"] if a["input_check"] == "ok" else -np.inf for a in answers])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="zoo names or trained directories")
    ap.add_argument("--per-group", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deferral", type=float, default=0.045)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    suite = ood_suite(args.per_group, args.seed, list(TARGETS))
    test = load_dataset("mnist-bundled").test
    digits = torch.stack([test[i][0] for i in range(len(cast(Sized, test)))])  # (1600, 1, 28, 28)
    head = " | ".join(
        f"{g} deferred at {args.deferral:.1%} of digits | digits deferred for {t:.0%} of {g}"
        for g, t in TARGETS.items()
    )
    print(f"| model | {head} |\n|---|{'---|' * 2 * len(TARGETS)}")
    for name in args.models:
        predictor = Predictor.from_dir(model_dir(name))
        snr_digits = _snr(predictor, digits)
        cells = []
        for group, target in TARGETS.items():
            got, need = budget(
                snr_digits, _suite_snr(predictor, suite[group]), args.deferral, target
            )
            cells += [f"{got:.1%}", f"{need:.1%}"]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
