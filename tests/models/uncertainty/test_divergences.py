"""EPKL closed form vs pairwise, EPCE identity, EPJS and MI by hand."""

import math

import pytest
import torch

from models.uncertainty import (
    entropy_decomposition,
    epce,
    epjs,
    epkl,
    epkl_pairwise,
    mutual_information,
)


def members(b: int, m: int, c: int, seed: int = 0, sharp: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(b, m, c, generator=g, dtype=torch.float64), -1)


@pytest.mark.parametrize(("m", "c"), [(2, 2), (3, 5), (10, 10), (25, 100)])
def test_closed_form_epkl_equals_pairwise(m: int, c: int) -> None:
    p = members(6, m, c, seed=m)
    p[0, 0] = 0.0  # exact zeros stay finite thanks to the floor
    p[0, 0, 0] = 1.0
    torch.testing.assert_close(epkl(p), epkl_pairwise(p), rtol=1e-9, atol=1e-9)


def test_epce_is_epkl_plus_au_in_bits() -> None:
    p = members(5, 7, 4)
    au_bits = entropy_decomposition(p).au * math.log2(4)
    torch.testing.assert_close(epce(p), epkl(p) + au_bits, rtol=1e-7, atol=1e-7)


def test_two_member_values_by_hand() -> None:
    """Two members over two classes, every term worked out with math.log2."""
    p = torch.tensor([[[0.5, 0.5], [0.25, 0.75]]], dtype=torch.float64)
    kl12 = 0.5 * math.log2(0.5 / 0.25) + 0.5 * math.log2(0.5 / 0.75)
    kl21 = 0.25 * math.log2(0.25 / 0.5) + 0.75 * math.log2(0.75 / 0.5)
    assert float(epkl(p)) == pytest.approx((kl12 + kl21) / 2, rel=1e-12)
    mid = (0.375, 0.625)

    def h2(x: tuple[float, float]) -> float:
        return -sum(v * math.log2(v) for v in x)

    js = h2(mid) - 0.5 * (h2((0.5, 0.5)) + h2((0.25, 0.75)))
    assert float(epjs(p)) == pytest.approx(js, rel=1e-12)
    mi = h2(mid) - 0.5 * (h2((0.5, 0.5)) + h2((0.25, 0.75)))  # C = 2: log C units = bits
    assert float(mutual_information(p)) == pytest.approx(mi, rel=1e-12)


def test_epjs_chunking_does_not_change_the_value() -> None:
    p = members(3, 9, 6)
    torch.testing.assert_close(epjs(p), epjs(p, chunk_elements=1))


def test_epjs_is_bounded_by_one_bit() -> None:
    p = torch.eye(4, dtype=torch.float64).unsqueeze(0)  # four one-hot members
    assert float(epjs(p)) == pytest.approx(1.0, abs=1e-6)
