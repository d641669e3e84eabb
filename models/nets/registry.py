"""Backbone registry (timm-style).

A *backbone* maps an image batch ``(B, Cin, H, W)`` to a feature vector ``(B, F)``. The classifier
head(s) are not part of the backbone: they belong to the ensemble (one head per member for LLE,
SI S3.1 "the classifier head H is replaced by a list of independent classifier heads"). Every
backbone therefore declares what its per-member head looks like through a :class:`HeadSpec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

__all__ = [
    "Backbone",
    "HeadSpec",
    "available_backbones",
    "create_backbone",
    "register_backbone",
]


@dataclass(frozen=True)
class HeadSpec:
    """Shape of the per-member classifier head that follows a backbone.

    ``hidden`` lists the hidden widths between the feature vector and the logits, e.g. ``(84,)`` for
    LeNet-5's ``120 -> 84 -> C`` head (SI S3.1) or ``()`` for the single linear layer that follows the
    ResNet/WRN extra fully connected block. ``activation`` is applied after each hidden layer and is
    followed by dropout with probability ``dropout``. ``subspace`` < 1 gives every member its own
    fixed random share of the features (:class:`models.ensembles.base.BatchedHeads`).
    """

    hidden: tuple[int, ...] = ()
    activation: str = "relu"  # "tanh" | "relu"
    dropout: float = 0.0
    # share of the feature vector each member's first layer reads: a fixed random subset per member
    # (the random subspace method, Ho 1998), so members differ in what they are built from, not
    # only in their initial weights; 1.0 = every member reads every feature
    subspace: float = 1.0
    # > 1: the features are `groups` equal blocks (a branched backbone's towers) and member m
    # reads block m mod groups only (with subspace < 1: a random share of that block)
    groups: int = 1


class Backbone(nn.Module):
    """Base class: subclasses set ``out_features`` and ``head`` and implement ``forward``."""

    out_features: int
    head: HeadSpec = HeadSpec()


_REGISTRY: dict[str, Callable[..., Backbone]] = {}
F = TypeVar("F", bound=Callable[..., Backbone])


def register_backbone(name: str | None = None) -> Callable[[F], F]:
    """Decorator registering a backbone constructor under ``name`` (default: the function name)."""

    def deco(fn: F) -> F:
        key = name or fn.__name__
        if key in _REGISTRY:
            raise ValueError(f"backbone {key!r} is already registered")
        _REGISTRY[key] = fn
        return fn

    return deco


def available_backbones() -> list[str]:
    """Sorted names accepted by :func:`create_backbone`."""
    return sorted(_REGISTRY)


def create_backbone(name: str, **kwargs: Any) -> Backbone:
    """Build the registered backbone ``name`` with keyword arguments ``kwargs``.

    Raises ``ValueError`` naming the known backbones when ``name`` is unknown.
    """
    try:
        fn = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown backbone {name!r}; available: {', '.join(available_backbones())}"
        ) from None
    return fn(**kwargs)
