"""benchmarks.budget: one SNR ranking answers every deferral threshold."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.budget import budget, main


def test_budget_by_hand() -> None:
    """Digits' SNRs 1..100: the k deferring 5 % of them is 5.5 (halfway to the next); of the
    group's SNRs (2, 4, 6, 8, 50), two are ≤ 5.5 (40 %); deferring 80 % of the group needs
    k = 8, which defers 8 % of digits. At half the digits (k = 50.5) the whole group is
    deferred, and all of it needs k = 50, which defers half the digits."""
    digits = np.arange(1, 101, dtype=float)
    group = np.array([2.0, 4.0, 6.0, 8.0, 50.0])
    assert budget(digits, group, 0.05, 0.80) == pytest.approx((0.4, 0.08))
    assert budget(digits, group, 0.50, 1.0) == pytest.approx((1.0, 0.5))


def test_thresholds_lie_between_samples() -> None:
    """The k deferring a share lies halfway to the next larger SNR, never on a sample (where the
    served rule and SNR ≤ k may round apart); ties defer together; past the top, the top."""
    from benchmarks.budget import _between

    assert _between(np.arange(1, 101, dtype=float), 0.05) == 5.5
    assert _between(np.array([1.0, 1.0, 2.0, 3.0]), 0.25) == 1.5  # both 1s deferred
    assert _between(np.array([-np.inf, 2.0, 4.0]), 0.3) == -np.inf  # an unreadable upload
    assert _between(np.array([1.0, 2.0]), 1.0) == 2.0


def test_snr_at_most_k_is_the_served_abstain() -> None:
    """The ranking's premise: at every k that is not a sample's own SNR (the budget's thresholds
    lie halfway between samples), SNR ≤ k is the served abstain flag."""
    import torch

    from models.uncertainty.margin import margin_score

    torch.manual_seed(0)
    members = torch.softmax(3 * torch.randn(4000, 10, 10), -1)
    members[:5] = members[:5, :1]  # members that agree exactly: no spread
    snr = margin_score(members, 1.0).snr
    for k in (0.1, 0.5, 1.0, 1.22, 5.0, 14.14, 50.0):
        assert torch.equal(snr <= k, margin_score(members, k).abstain)


def test_runs_on_served_members_and_defers_unreadable_uploads(capsys) -> None:
    """The default (a gate: q) and LeNet-5 (a gate too) give a row each; a blank upload has no
    digit, so the reading defers it at every k (SNR −∞), as the server does."""
    from benchmarks.budget import _suite_ranks
    from models.predictor import Predictor

    main(["cnn4-lle-vgn-doe-mnist", "lenet5-lle-vgn-mnist", "--per-group", "20"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [r.split(" | ")[:2] for r in rows] == [
        ["| cnn4-lle-vgn-doe-mnist", "snr"],
        ["| lenet5-lle-vgn-mnist", "snr"],
    ]
    assert all(r.count("%") == 4 for r in rows)
    p = Predictor.from_dir("models/zoo/cnn4-lle-vgn-doe-mnist")
    images = np.zeros((2, 28, 28), np.uint8)
    images[1, 6:22, 13:15] = 255  # a stroke: a digit to read
    snr = _suite_ranks(p, images, ["snr"])["snr"]
    assert snr[0] == -np.inf and np.isfinite(snr[1])


def test_other_scores_rank_as_rules_over_the_same_answers(capsys) -> None:
    """Every score becomes "deferred ⇔ at most a threshold": SNR and the top probability as
    served, EU and TU negated (the highest deferred first); an upload with no digit is −∞ under
    every score. Two suite draws give two values a cell, and each score a row."""
    import torch

    from benchmarks.budget import _ranks, _suite_ranks
    from models.predictor import Predictor

    p = Predictor.from_dir("models/zoo/cnn4-lle-vgn-doe-mnist")
    images = np.zeros((3, 28, 28), np.uint8)
    images[1, 6:22, 13:15] = 255
    images[2, 6:22, 6:22] = np.eye(16, dtype=np.uint8) * 255  # a diagonal stroke
    scores = ["snr", "eu", "tu", "maxprob"]
    ranks = _suite_ranks(p, images, scores)
    answers = p.predict([torch.from_numpy(im) for im in images[1:]])
    for i, a in enumerate(answers, start=1):
        assert ranks["snr"][i] == a["snr"]
        assert ranks["eu"][i] == -a["eu"] and ranks["tu"][i] == -a["tu"]
        assert ranks["maxprob"][i] == a["probabilities"][0]["probability"]
    assert all(ranks[s][0] == -np.inf for s in scores)
    # the digits' ranking is the served decision's: the same values for the same pixels
    x = torch.stack([p.prepare(torch.from_numpy(im)[None]) for im in images[1:]])
    digits = _ranks(p, x, scores)
    for s in scores:
        assert digits[s] == pytest.approx(ranks[s][1:], rel=1e-9, abs=1e-12)

    main(["cnn4-lle-vgn-doe-mnist", "--per-group", "20", "--seeds", "0", "1", "--scores", *scores])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [r.split(" | ")[1] for r in rows] == scores
    assert all(r.count("%") == 8 and r.count("/") == 4 for r in rows)
