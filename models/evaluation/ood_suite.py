"""The OOD suite (:mod:`models.data_ood.suite`, docs/ood-suite.md) evaluated per group.

For every group the served rule's abstain rate at the given ``abstain_k`` (paper §3.2: accept
when ``p̄₁ − k·s₁ > p̄₂ + k·s₂``) and, with OOD as the positive class against the in-distribution
split, the AUROC and FPR@95 (:mod:`models.evaluation.ood`, paper §4.6) of VGMU and every baseline
score (1 − max prob, TU/AU/EU, MI, EPKL, EPJS, EPCE: :data:`models.evaluation.UNCERTAINTY_SCORES`).
For the labelled near groups (:func:`models.data_ood.ood_suite_labels`: rotated and shrunk digits)
also the share deferred or answered with the right class. Each group's target is of one kind
(``target_kind``): ``abstain`` (:data:`~models.data_ood.suite.ABSTAIN_TARGETS`: the far groups
and overlaid digits) or ``deferred_or_right``
(:data:`~models.data_ood.suite.DEFERRED_OR_RIGHT_TARGETS`: shrunk digits). Pooled rows: ``far``
(the five far groups) and ``all`` (every group).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from models.data import normalise_uint8
from models.evaluation.ood import ood_metrics
from models.evaluation.scores import UNCERTAINTY_SCORES, score_arrays
from models.prepare import Finding, PrepareMode, prepare_image
from models.uncertainty.scoring import score_members

__all__ = [
    "SUITE_PER_GROUP",
    "card_ood_suite",
    "deferred_or_right",
    "ood_suite_metrics",
    "suite_members",
]

SUITE_PER_GROUP = 500  # images per group evaluated by ``vge evaluate`` and stored in the card


#: The score an image with no digit in it gets (:class:`models.prepare.Finding` other than ok):
#: above any score's range, so it ranks as the most uncertain, as the server answers it (abstain).
NO_DIGIT_SCORE = 1e9


def _arrays(
    p: Tensor,
    q: Tensor | None,
    abstain_k: float,
    names: tuple[str, ...],
    no_digit: np.ndarray | None = None,
):
    """Score arrays, abstain flags and predictions; rows in ``no_digit`` (bool) abstain and
    score :data:`NO_DIGIT_SCORE`, as served."""
    s = score_members(p, q, abstain_k=abstain_k)
    arrays = score_arrays(s, p, q, names)
    abstain = s.abstain.numpy()
    if no_digit is not None and no_digit.any():
        abstain = abstain | no_digit
        for a in arrays.values():
            a[no_digit] = NO_DIGIT_SCORE
    return arrays, abstain, s.prediction.numpy()


@lru_cache(maxsize=2)
def _suite_images(
    n_per_group: int, seed: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The suite's images and the labelled groups' true classes, generated once per process
    (read-only arrays: a few seconds to draw)."""
    from models.data_ood import ood_suite, ood_suite_labels

    images = ood_suite(n_per_group, seed=seed)
    labels = ood_suite_labels(n_per_group, seed=seed)
    for a in (*images.values(), *labels.values()):
        a.setflags(write=False)
    return images, labels


@lru_cache(maxsize=4)
def _suite_readings(
    n_per_group: int, seed: int, prepare: PrepareMode
) -> dict[str, tuple[Tensor, np.ndarray]]:
    """The suite's images as the server reads them under ``prepare``
    (:func:`models.prepare.prepare_image`): per group uint8 ``(N, 1, 28, 28)`` and which held no
    digit (read-only). Read once per process: under ``mnist`` ~1 ms an image, 4.5 s for the
    suite, which every training run's model card needs (a process that trains several models
    read it anew each time)."""
    images, _ = _suite_images(n_per_group, seed)
    out = {}
    for group, imgs in images.items():
        read = [
            prepare_image(torch.from_numpy(np.array(img))[None], prepare, 1, (28, 28))
            for img in imgs
        ]
        x = torch.stack([r.image for r in read])  # (N, 1, 28, 28) uint8
        no_digit = np.array([r.finding != Finding.ok for r in read])
        no_digit.setflags(write=False)
        out[group] = (x, no_digit)
    return out


def suite_members(
    forward: Callable[[Tensor], tuple[Tensor, Tensor | None]],
    normalise: Callable[[Tensor], Tensor],
    prepare: PrepareMode = "mnist",
    n_per_group: int = SUITE_PER_GROUP,
    seed: int = 0,
    batch_size: int = 512,
) -> tuple[
    dict[str, np.ndarray],
    dict[str, tuple[Tensor, Tensor | None]],
    dict[str, np.ndarray],
    dict[str, np.ndarray],
]:
    """The suite's raw images, the model's members on them, which images held no digit and the
    labelled groups' true classes: ``(images, {group: (p, q)}, {group: no_digit}, {group:
    labels})`` (:func:`models.data_ood.ood_suite_labels`). The images are read as the server
    reads an upload under ``prepare`` (once per process, :func:`_suite_readings`), ``normalise``
    maps the uint8 readings ``(N, 1, 28, 28)`` to model inputs and ``forward`` inputs to
    ``(p, q)``."""
    images, labels = _suite_images(n_per_group, seed)
    readings = _suite_readings(n_per_group, seed, prepare)
    members: dict[str, tuple[Tensor, Tensor | None]] = {}
    no_digit: dict[str, np.ndarray] = {}
    for group in images:
        read, no_digit[group] = readings[group]
        x = normalise(read)
        ps, qs = [], []
        for start in range(0, x.shape[0], batch_size):
            p, q = forward(x[start : start + batch_size])
            ps.append(p)
            if q is not None:
                qs.append(q)
        members[group] = (torch.cat(ps), torch.cat(qs) if qs else None)
    return images, members, no_digit, labels


def _target(group: str) -> tuple[float | None, str | None]:
    """A group's target and its kind (``"abstain"``, ``"deferred_or_right"`` or None)."""
    from models.data_ood.suite import ABSTAIN_TARGETS, DEFERRED_OR_RIGHT_TARGETS

    if group in ABSTAIN_TARGETS:
        return ABSTAIN_TARGETS[group], "abstain"
    if group in DEFERRED_OR_RIGHT_TARGETS:
        return DEFERRED_OR_RIGHT_TARGETS[group], "deferred_or_right"
    return None, None


def deferred_or_right(abstain: np.ndarray, prediction: np.ndarray, labels: np.ndarray) -> float:
    """Share of images abstained on (no-digit images included: they abstain as served) or
    answered with their true class ``labels`` (``(n,)``)."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.shape[0] != abstain.shape[0]:
        raise ValueError(f"labels must be ({abstain.shape[0]},); got {labels.shape}")
    return float((np.asarray(abstain, bool) | (np.asarray(prediction) == labels)).mean())


def ood_suite_metrics(
    p_id: Tensor,
    q_id: Tensor | None,
    groups: Mapping[str, tuple[Tensor, Tensor | None]],
    abstain_k: float,
    no_digit: Mapping[str, np.ndarray | None] | None = None,
    labels: Mapping[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """``{"groups": {group: {n, abstain_rate, deferred_or_right, target, target_kind,
    meets_target, no_digit (images the reading found no digit in), predicted (class counts),
    scores {score: {auroc, fpr95}}}}, "far": {...}, "all": {...}}`` (pooled rows without
    target), against the in-distribution members ``p_id``/``q_id``. Images in ``no_digit``
    abstain and rank most uncertain, as served (:data:`NO_DIGIT_SCORE`).

    ``deferred_or_right`` (None without labels) is the share abstained on or answered with the
    true class, for groups whose ``labels`` are one class per image (rotated and shrunk digits;
    not the two classes of overlaid digits). ``target_kind`` says which rate ``target`` applies
    to: ``"abstain"`` (``abstain_rate``), ``"deferred_or_right"`` or None (reported only);
    ``meets_target`` is None without a target or without the labels the target needs."""
    from models.data_ood.suite import FAR_GROUPS

    id_arrays, _, _ = _arrays(p_id, q_id, abstain_k, UNCERTAINTY_SCORES)
    n_classes = p_id.shape[-1]
    per: dict[str, Any] = {}
    pooled: dict[str, list] = {"far": [], "all": []}
    for group, (p, q) in groups.items():
        found = None if no_digit is None else no_digit.get(group)
        arrays, abstain, pred = _arrays(p, q, abstain_k, UNCERTAINTY_SCORES, found)
        target, kind = _target(group)
        rate = float(abstain.mean())
        y = None if labels is None else labels.get(group)
        right = None if y is None or np.ndim(y) != 1 else deferred_or_right(abstain, pred, y)
        measured = rate if kind == "abstain" else right
        per[group] = {
            "n": int(abstain.size),
            "abstain_rate": rate,
            "deferred_or_right": right,
            "target": target,
            "target_kind": kind,
            "meets_target": (
                None if target is None or measured is None else bool(measured >= target)
            ),
            "no_digit": 0 if found is None else int(found.sum()),
            "predicted": np.bincount(pred, minlength=n_classes).tolist(),
            "scores": ood_metrics(id_arrays, arrays),
        }
        for key in ("far", "all") if group in FAR_GROUPS else ("all",):
            pooled[key].append((arrays, abstain))
    out: dict[str, Any] = {"abstain_k": float(abstain_k), "groups": per}
    for key, parts in pooled.items():
        if not parts:
            continue
        arrays = {n: np.concatenate([a[n] for a, _ in parts]) for n in UNCERTAINTY_SCORES}
        abstain = np.concatenate([ab for _, ab in parts])
        out[key] = {
            "n": int(abstain.size),
            "abstain_rate": float(abstain.mean()),
            "scores": ood_metrics(id_arrays, arrays),
        }
    return out


@torch.no_grad()
def card_ood_suite(
    model: torch.nn.Module,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    input_size: tuple[int, int],
    p_id: Tensor,
    q_id: Tensor | None,
    abstain_k: float,
    device: torch.device | str = "cpu",
    n_per_group: int = SUITE_PER_GROUP,
) -> dict[str, Any] | None:
    """:func:`ood_suite_metrics` of a freshly trained ``model`` (what the model card stores) on
    ``n_per_group`` images of each group, its inputs normalised with the dataset's
    ``mean``/``std`` as the served path does; ``None`` for models that do not take 1-channel
    28×28 images, and for ``n_per_group`` 0 (``TrainConfig.ood_suite_per_group``)."""
    if len(mean) != 1 or tuple(input_size) != (28, 28) or n_per_group == 0:
        return None
    was_training = model.training
    model.eval()

    def forward(x: Tensor) -> tuple[Tensor, Tensor | None]:
        out = model(x.to(device))
        return out.p.float().cpu(), None if out.q is None else out.q.float().cpu()

    def normalise(x: Tensor) -> Tensor:
        return normalise_uint8(x, mean, std)

    try:
        _, members, no_digit, labels = suite_members(forward, normalise, "mnist", n_per_group)
    finally:
        model.train(was_training)
    return ood_suite_metrics(p_id, q_id, members, abstain_k, no_digit, labels)


def validation_outliers(model_dir: str, n: int = 2000, seed: int | None = None) -> dict[str, Any]:
    """What the outlier-exposure recipe was chosen on, never the suite: the validation digits
    and a fresh draw of the *training* outlier families
    (:func:`models.data_ood.outlier_exposure_set`), through the served path at the card's
    calibrated k. Returns accuracy, deferral and accepted accuracy on the validation digits, the
    abstain rate per outlier family, VGMU's AUROC digits vs outliers, and the draw's seed.

    The draw must not be the one the model trained on (a family's first images are the same for
    any ``n``): ``seed`` None takes 1, or 2 for a model trained with seed 1. A seed equal to the
    training seed is refused.
    """
    from models.data import bundled_split, load_bundled_mnist, normalise_uint8
    from models.data_ood import OUTLIER_FAMILIES, outlier_exposure_set
    from models.evaluation.ood import ood_auroc
    from models.predictor import Predictor

    pred = Predictor.from_dir(model_dir, device="cpu")
    k = float(pred.card.abstain_calibration["abstain_k"])
    config = pred.card.training.get("config") if isinstance(pred.card.training, dict) else None
    trained_on = config.get("seed") if isinstance(config, dict) else None
    if seed is None:
        seed = 2 if trained_on == 1 else 1
    if seed == trained_on:
        raise ValueError(f"outlier seed {seed} is the draw {model_dir} was trained on")

    def run(images: np.ndarray):
        read = [pred.read(torch.from_numpy(img).unsqueeze(0)) for img in images]
        x = normalise_uint8(torch.stack([r.image for r in read]), pred.card.mean, pred.card.std)
        out = pred.forward(x)
        s = score_members(out.p, out.q, abstain_k=k)
        no_digit = torch.tensor([r.finding != Finding.ok for r in read])
        return replace(s, abstain=s.abstain | no_digit) if no_digit.any() else s

    images, labels = load_bundled_mnist()
    val = bundled_split()["val"]
    s_id = run(images[val])
    correct = s_id.prediction.numpy() == labels[val]
    accepted = ~s_id.abstain.numpy()
    outliers, family = outlier_exposure_set(n, seed=seed)
    s_ood = run(outliers)
    abstain = s_ood.abstain.numpy()
    return {
        "abstain_k": k,
        "val_accuracy": float(correct.mean()),
        "val_deferral": float(1 - accepted.mean()),
        "val_accepted_accuracy": float(correct[accepted].mean()),
        "outlier_abstain": {
            name: float(abstain[family == i].mean()) for i, name in enumerate(OUTLIER_FAMILIES)
        },
        "outlier_abstain_all": float(abstain.mean()),
        "vgmu_auroc": ood_auroc(s_id.vgmu.double().numpy(), s_ood.vgmu.double().numpy()),
        "outlier_seed": seed,
    }


if __name__ == "__main__":  # python -m models.evaluation.ood_suite MODEL_DIR [MODEL_DIR ...]
    import sys

    for d in sys.argv[1:]:
        print(d, json.dumps(validation_outliers(d), indent=1))
