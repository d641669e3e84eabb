"""Property tests (hypothesis): axioms A0/A1, ranges, batch invariance."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.uncertainty import score_ensemble

FLOAT_KEYS = ("vgmu", "snr", "tu", "au", "eu", "mutual_information", "epkl", "epjs", "epce")


@st.composite
def ensembles(draw: st.DrawFn, max_b: int = 4) -> torch.Tensor:
    """Random (B, M, C) member probabilities, including exact zeros and near one-hot members."""
    b = draw(st.integers(1, max_b))
    m = draw(st.integers(2, 6))  # ensemble scores need a spread: M >= 2
    c = draw(st.integers(2, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    sharp = draw(st.sampled_from([0.1, 1.0, 5.0, 30.0]))
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(sharp * torch.randn(b, m, c, generator=g, dtype=torch.float64), dim=-1)
    if draw(st.booleans()):  # exact zeros, renormalised
        p = torch.where(p < 0.05, torch.zeros_like(p), p)
        p = p / p.sum(-1, keepdim=True)
    return p


gate_ks = st.one_of(st.none(), st.floats(1e-3, 50.0))


@settings(max_examples=60, deadline=None)
@given(p=ensembles(), gate_k=gate_ks)
def test_a0_non_negative_and_in_range(p: torch.Tensor, gate_k: float | None) -> None:
    s = score_ensemble(p, gate_k=gate_k)
    for key in FLOAT_KEYS:
        v = getattr(s, key)
        assert bool(torch.isfinite(v).all()), key
        assert bool((v >= 0).all()), key
    for key in ("vgmu", "tu", "au", "eu", "mutual_information"):
        assert bool((getattr(s, key) <= 1 + 1e-12).all()), key
    torch.testing.assert_close(s.tu, s.au + s.eu)
    assert bool((s.epce >= s.epkl).all())


@settings(max_examples=40, deadline=None)
@given(p=ensembles(), m=st.integers(2, 8), gate_k=gate_ks)
def test_a1_identical_members_have_zero_eu(p: torch.Tensor, m: int, gate_k: float | None) -> None:
    identical = p[:, :1].expand(-1, m, -1).contiguous()
    s = score_ensemble(identical, gate_k=gate_k)
    assert bool((s.eu.abs() < 1e-9).all())
    assert bool((s.mutual_information.abs() < 1e-9).all())
    assert bool((s.epkl.abs() < 1e-9).all())
    assert bool((s.epjs.abs() < 1e-9).all())


@settings(max_examples=30, deadline=None)
@given(p=ensembles(max_b=5), gate_k=gate_ks, abstain_k=st.floats(0.0, 5.0))
def test_batch_invariance(p: torch.Tensor, gate_k: float | None, abstain_k: float) -> None:
    """A sample scored alone equals the same sample scored inside a batch."""
    batch = score_ensemble(p, gate_k=gate_k, abstain_k=abstain_k).to_records()
    for i in range(p.shape[0]):
        alone = score_ensemble(p[i : i + 1], gate_k=gate_k, abstain_k=abstain_k).to_records()[0]
        for key, value in alone.items():
            if isinstance(value, float):
                assert abs(batch[i][key] - value) <= 1e-12 + 1e-9 * abs(value), key
            else:
                assert batch[i][key] == value, key
