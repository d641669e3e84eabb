"""VGN layer: closed-form backward (SI Table S2) vs gradcheck and plain autograd."""

import pytest
import torch

from models.uncertainty import VGN, VGNFunction, vgn, vgn_autograd


def random_members(b: int, m: int, c: int, *, sharp: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(b, m, c, generator=g, dtype=torch.float64), dim=-1)


def test_gradcheck_probs_and_k() -> None:
    p = random_members(3, 4, 5).requires_grad_()
    k = (0.3 + torch.rand(5, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda p, k: VGNFunction.apply(p, k, 1e-8), (p, k))


def test_gradcheck_two_members() -> None:
    p = random_members(2, 2, 3, seed=1).requires_grad_()
    k = torch.full((3,), 0.7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p, k: VGNFunction.apply(p, k, 1e-8), (p, k))


@pytest.mark.parametrize(
    ("m", "c", "sharp"), [(2, 3, 1.0), (5, 10, 1.0), (10, 10, 8.0), (20, 100, 15.0)]
)
def test_analytic_equals_autograd(m: int, c: int, sharp: float) -> None:
    """Same forward and same gradients, including near-zero probabilities (sharp softmaxes)."""
    p1 = random_members(8, m, c, sharp=sharp, seed=m).requires_grad_()
    p2 = p1.detach().clone().requires_grad_()
    l1 = torch.randn(c, dtype=torch.float64).requires_grad_()
    l2 = l1.detach().clone().requires_grad_()
    k1, k2 = torch.nn.functional.softplus(l1) + 1e-8, torch.nn.functional.softplus(l2) + 1e-8
    q1, q2 = vgn(p1, k1), vgn_autograd(p2, k2)
    torch.testing.assert_close(q1, q2)
    w = torch.randn_like(q1)
    (q1 * w).sum().backward()
    (q2 * w).sum().backward()
    torch.testing.assert_close(p1.grad, p2.grad)
    torch.testing.assert_close(l1.grad, l2.grad)


def test_mixture_nll_gradient_matches_autograd() -> None:
    """The training objective (NLL of q̄) gives identical gradients either way."""
    p1 = random_members(16, 10, 10, sharp=4.0).requires_grad_()
    p2 = p1.detach().clone().requires_grad_()
    y = torch.randint(0, 10, (16,))
    for p, f in ((p1, vgn), (p2, vgn_autograd)):
        q_bar = f(p, 0.693).mean(dim=1)
        torch.nn.functional.nll_loss(q_bar.log(), y).backward()
    torch.testing.assert_close(p1.grad, p2.grad)


def test_output_is_a_distribution_and_k_learnable() -> None:
    layer = VGN(num_classes=6).double()
    assert layer.k.detach() == pytest.approx(torch.full((6,), 0.6931471805599453 + 1e-8))
    p = random_members(4, 3, 6)
    q = layer(p)
    torch.testing.assert_close(q.sum(-1), torch.ones(4, 3, dtype=torch.float64))
    assert bool((q >= 0).all())
    q.mean(dim=1)[:, 0].sum().backward()
    assert layer.k_logit.grad is not None and bool(layer.k_logit.grad.abs().sum() > 0)


def test_single_member_is_identity_and_finite() -> None:
    """M = 1: spread 0 (never NaN), gate ≈ 1 on supported classes, q = p; gradients finite."""
    p = random_members(4, 1, 5).requires_grad_()
    q = vgn(p, 1.0)
    torch.testing.assert_close(q, p.detach())
    q.sum().backward()
    assert bool(torch.isfinite(p.grad).all())


def test_fixed_k_layer_has_no_parameters() -> None:
    layer = VGN(num_classes=3, k=2.0)
    assert list(layer.parameters()) == []
    assert layer.k.tolist() == [2.0, 2.0, 2.0]


def test_half_precision_is_computed_in_float32() -> None:
    p = random_members(2, 3, 4).half()
    assert vgn(p, 1.0).dtype == torch.float32


def test_rejects_bad_k() -> None:
    with pytest.raises(ValueError, match="k must"):
        VGN(num_classes=3, k=0.0)
    with pytest.raises(ValueError, match="one value per class"):
        VGN(num_classes=3, k=torch.ones(4))


@pytest.mark.parametrize(
    ("m", "c", "k"), [(1, 3, 0.7), (2, 3, 1e-12), (10, 10, 0.69), (20, 100, 3.0)]
)
def test_inference_answers_exactly_what_the_autograd_function_answers(
    m: int, c: int, k: float
) -> None:
    """Without gradients, vgn skips the Function (and the intermediates only backward needs):
    the gated members are bit-identical, and gradients still flow when they are asked for."""
    p = random_members(6, m, c, sharp=5.0, seed=c).float()
    k_t = torch.full((c,), k)
    reference = VGNFunction.apply(p, k_t, 1e-8)
    with torch.inference_mode():
        assert torch.equal(vgn(p, k_t, 1e-8), reference)
    with torch.no_grad():
        assert torch.equal(vgn(p, k_t, 1e-8), reference)
    fast = vgn(p, k_t, 1e-8)  # gradients enabled, but nothing requires one
    assert torch.equal(fast, reference) and fast.grad_fn is None
    assert vgn(p.requires_grad_(), k_t, 1e-8).grad_fn is not None


def test_second_derivative_is_refused_not_wrong() -> None:
    """The closed-form backward reuses intermediates saved without a graph: a gradient of the
    gradient would come out silently wrong, so it raises instead (once_differentiable)."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(3, 4, 5, dtype=torch.float64), -1).requires_grad_()
    k = torch.full((5,), 0.8, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(vgn(probs, k).square().sum(), probs, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()
