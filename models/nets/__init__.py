"""Backbones: LeNet-5 (MNIST), ResNet-18 and WideResNet-28-10 (SVHN, CIFAR) as in SI S3.1, and
the small BatchNorm CNN of the shipped default model (``cnn4``)."""

from . import cnn, lenet, resnet, wideresnet  # noqa: F401  (registers the backbones)
from .registry import (
    Backbone,
    HeadSpec,
    available_backbones,
    create_backbone,
    register_backbone,
)

__all__ = ["Backbone", "HeadSpec", "available_backbones", "create_backbone", "register_backbone"]
