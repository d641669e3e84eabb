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
