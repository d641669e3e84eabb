"""The OOD suite (models/data_ood/suite.py) is deterministic and shares no source with the
outlier-exposure set used in training (models/data_ood/outliers.py); see docs/ood-suite.md."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from models.data_ood import outliers, render, suite
from models.data_ood.suite import OOD_GROUPS, SAMPLE_PER_GROUP, load_ood_sample, ood_suite


def test_same_seed_same_bytes_and_the_committed_sample_is_seed_0() -> None:
    a = ood_suite(SAMPLE_PER_GROUP, seed=0)
    sample = load_ood_sample()
    for g in OOD_GROUPS:
        assert a[g].dtype == np.uint8 and a[g].shape == (SAMPLE_PER_GROUP, 28, 28)
        assert a[g].tobytes() == sample[g].tobytes(), g
    b = ood_suite(8, seed=1)
    assert all(b[g].tobytes() == ood_suite(8, seed=1, groups=[g])[g].tobytes() for g in OOD_GROUPS)
    assert all(b[g].tobytes() != a[g][:8].tobytes() for g in OOD_GROUPS)


def test_groups_are_what_they_say() -> None:
    s = load_ood_sample()
    assert all((img == img.flat[0]).all() for img in s["blank"])
    assert s["noise"].std(axis=(1, 2)).min() > 10
    assert s["inverted_digits"].mean() > 150 and s["letters"].mean() < 100
    with pytest.raises(ValueError, match="unknown OOD group"):
        ood_suite(1, groups=["digits"])


def test_training_outliers_share_no_source_with_the_suite() -> None:
    assert not set(outliers.OUTLIER_FONTS) & set(suite.SUITE_FONTS)
    assert not set(outliers.OUTLIER_PHOTOS) & set(suite.SUITE_PHOTOS)
    assert outliers.OUTLIER_TAG != suite.SUITE_TAG
    symbols = set(suite.SUITE_CHARS) - set(suite.LATIN)
    assert not symbols & set(outliers.OUTLIER_CHARS)
    assert not set(suite.DIGIT_LOOKALIKES) & (set(suite.SUITE_CHARS) | set(outliers.OUTLIER_CHARS))
    suite_makers = {render.uniform_noise, render.gaussian_noise, render.blank, render.stripes}
    suite_makers |= {render.checkerboard, render.gradient}
    assert not suite_makers & {fn for _, fn in outliers.OUTLIER_FAMILIES.values()}
    # and no image is shared: none of the committed sample is among 3,000 training outliers
    train, family = outliers.outlier_exposure_set(3000, seed=0)
    assert set(np.unique(family)) == set(range(len(outliers.OUTLIER_FAMILIES)))
    seen = {hashlib.sha256(x.tobytes()).digest() for x in train}
    sample = load_ood_sample()
    assert not any(
        hashlib.sha256(x.tobytes()).digest() in seen for g in OOD_GROUPS for x in sample[g]
    )
    again, _ = outliers.outlier_exposure_set(3000, seed=0)
    assert again.tobytes() == train.tobytes()


def test_choice_outliers_are_never_the_draw_a_model_trained_on() -> None:
    """validation_outliers picks a draw other than the card's training seed (the OE model was
    trained on seed 1's outliers) and refuses that seed when asked for it."""
    import pytest

    from models.evaluation.ood_suite import validation_outliers
    from models.zoo import zoo_model_dir

    oe = zoo_model_dir("cnn4-lle-vgn-oe-mnist")
    with pytest.raises(ValueError, match="trained on"):
        validation_outliers(str(oe), seed=1)
    assert validation_outliers(str(oe), n=64)["outlier_seed"] == 2


def _test_split() -> tuple[np.ndarray, np.ndarray]:
    from models.data import bundled_split, load_bundled_mnist

    images, labels = load_bundled_mnist()
    test = bundled_split()["test"]
    return images[test], labels[test]


def _stream(group: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([suite.SUITE_TAG, seed, OOD_GROUPS.index(group)])


def test_new_near_groups_are_appended_so_older_groups_keep_their_streams() -> None:
    assert OOD_GROUPS[:7] == (*suite.FAR_GROUPS, "rotated_digits", "inverted_digits")
    assert OOD_GROUPS[7:] == ("overlaid_digits", "shrunk_digits")
    assert set(suite.LABELLED_GROUPS) <= set(suite.NEAR_GROUPS)
    assert suite.DEFERRED_OR_RIGHT_TARGETS == {"shrunk_digits": 0.98}
    assert suite.ABSTAIN_TARGETS["overlaid_digits"] == 0.80
    assert not set(suite.ABSTAIN_TARGETS) & set(suite.DEFERRED_OR_RIGHT_TARGETS)


def test_overlaid_digits_are_two_test_digits_of_different_classes() -> None:
    groups = ["overlaid_digits"]
    a = ood_suite(60, seed=3, groups=groups)["overlaid_digits"]
    assert a.tobytes() == ood_suite(60, seed=3, groups=groups)["overlaid_digits"].tobytes()
    assert a.tobytes() != ood_suite(60, seed=4, groups=groups)["overlaid_digits"].tobytes()
    pairs = suite.ood_suite_labels(60, seed=3, groups=groups)["overlaid_digits"]
    assert pairs.shape == (60, 2) and (pairs[:, 0] != pairs[:, 1]).all()
    # reconstruct the draw: the first digit is the test split's permutation, the pixelwise max
    # holds both digits, and the partner's class is the second label
    images, labels = _test_split()
    first = _stream("overlaid_digits", 3).permutation(labels.size)[:60]
    assert (labels[first] == pairs[:, 0]).all()
    assert (a >= images[first]).all() and a.dtype == np.uint8 and a.shape == (60, 28, 28)
    assert (a.astype(int) > images[first]).any(axis=(1, 2)).mean() > 0.9  # a partner on top


def test_shrunk_digits_are_small_whole_and_labelled_by_their_draw() -> None:
    from PIL import Image

    a = ood_suite(50, seed=2, groups=["shrunk_digits"])["shrunk_digits"]
    assert a.tobytes() == ood_suite(50, seed=2, groups=["shrunk_digits"])["shrunk_digits"].tobytes()
    assert a.dtype == np.uint8 and a.shape == (50, 28, 28)
    for img in a:
        rows, cols = np.nonzero(img)
        assert rows.max() - rows.min() + 1 <= 0.5 * 28 and cols.max() - cols.min() + 1 <= 0.5 * 28
    # the same draw, step by step: the labels are the source digits' and so are the images
    images, labels = _test_split()
    rng = _stream("shrunk_digits", 2)
    pick = rng.permutation(labels.size)[:50]
    y = suite.ood_suite_labels(50, seed=2, groups=["shrunk_digits", "letters"])
    assert list(y) == ["shrunk_digits"] and (y["shrunk_digits"] == labels[pick]).all()
    for img, src in zip(a, images[pick], strict=True):
        side = round(28 * rng.uniform(0.35, 0.50))
        assert 0.35 * 28 - 0.5 <= side <= 0.5 * 28
        top, left = rng.integers(0, 28 - side + 1, size=2)
        small = np.asarray(Image.fromarray(src).resize((side, side), Image.BILINEAR))
        assert (img[top : top + side, left : left + side] == small).all()
        img = img.copy()
        img[top : top + side, left : left + side] = 0
        assert not img.any()  # nothing outside the placed digit


def test_rotated_digit_labels_are_the_turned_digits_classes() -> None:
    images, labels = _test_split()
    rng = _stream("rotated_digits", 0)
    pick = rng.permutation(labels.size)[:40]
    turns = rng.integers(1, 4, size=40)
    y = suite.ood_suite_labels(40, seed=0)["rotated_digits"]
    assert (y == labels[pick]).all()
    sample = load_ood_sample()["rotated_digits"]
    for img, k, i in zip(sample, turns, pick, strict=True):
        assert (np.rot90(img, -int(k)) == images[i]).all()
    with pytest.raises(ValueError, match="unknown OOD group"):
        suite.ood_suite_labels(1, groups=["digits"])
