"""Training: ``TrainConfig`` and ``train(config, out_dir, on_event, should_stop) -> Path``.

Protocol (SI S3.2): Adam, batch size 128, learning rate 1e-4 for MNIST and 1e-3 otherwise in the
paper, early stopping on the validation loss (min delta 1e-4, patience 5), deterministic seeding,
dataset-specific normalisation. The best-validation-loss weights are restored at the end.

Optional, off by default (the paper uses neither): ``augment`` draws an independent small random
affine transform for every *training* image of every batch (the parameters of
``torchvision.transforms.v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1))``,
bilinear, background fill; see :func:`models.data.random_affine`) from a dedicated
``torch.Generator`` seeded from ``seed`` (and the DDP rank), so runs stay deterministic; validation
and test images are never augmented. ``lr_schedule`` = ``"plateau"`` multiplies the learning rate by
``lr_factor`` when the validation loss has not improved by ``min_delta`` for ``lr_patience`` epochs
(``ReduceLROnPlateau``); ``"cosine"`` anneals it to ``lr * lr_factor`` over ``epochs``
(``CosineAnnealingLR``); ``"onecycle"`` warms up to ``lr`` and anneals to ~0 over all ``epochs``,
stepped per batch (``OneCycleLR``; pair it with a patience that lets it run its course). Early
stopping and best-weight restoring are unchanged by any of them.

Loss (as the paper trains each kind, Section 4). VGN models use ``loss="mixture"``: the negative
log-likelihood of the ensemble *mixture* ``-log q̄_y`` with ``q̄ = mean_m q_m``, so the VGN layer and
its per-class ``k`` are trained end to end through the gated prediction that is served (Section
3.1). Models without a gate default to ``loss="members"``: the members' cross-entropies averaged
(the paper trains DE members independently and "losses were averaged across heads" for LLE), which
keeps the members as diverse as the paper's baselines. ``loss="mixture"`` on a non-VGN model trains
the raw mixture ``-log p̄_y`` (stable: ``logsumexp_m(log_softmax(z_m)) - log M``) instead.

Scale-out: launched under ``torchrun`` (``WORLD_SIZE > 1``) the model is wrapped in
DistributedDataParallel (gloo on CPU, nccl on CUDA) with a ``DistributedSampler``; validation loss is
taken from rank 0 and broadcast so every rank makes the same early-stopping decision, and only
rank 0 writes the checkpoint and emits events.

Layout: :mod:`.loop` holds ``train``, a short loop over epochs; the parts it calls are
:mod:`.config` (``TrainConfig``: the shared :class:`~models.checkpoint.ArchitectureSpec` plus how to
train; ``load_config``), :mod:`.runtime` (device, DDP group, seeding), :mod:`.data` (dataset and
training loader), :mod:`.loss` (``digit_loss``, the digits' loss, shared by :mod:`.step` and
:mod:`.outliers`), :mod:`.step` (augmentation, optimiser and schedules, ``train_step``; and
where ``torch.func.vmap`` wins), :mod:`.validate` (predictions, validation broadcast from rank 0),
:mod:`.stopping` (``EarlyStopping``), :mod:`.events` (``Progress``: start/step/epoch/done events and
the terminal bar) and :mod:`.finalise` (evaluation, ``abstain_k`` calibration, the checkpoint
written once).
"""

from .config import (
    DEFAULT_ARCHITECTURE,
    DEFAULT_TARGET_DEFERRAL,
    LIMITS,
    TrainConfig,
    config_error_message,
    load_config,
    served_config,
)
from .events import EventFn
from .loop import train
from .loss import digit_loss, member_variance, mixture_nll
from .runtime import seed_everything
from .step import augment_batch
from .validate import collect_predictions

__all__ = [
    "DEFAULT_ARCHITECTURE",
    "DEFAULT_TARGET_DEFERRAL",
    "LIMITS",
    "EventFn",
    "TrainConfig",
    "augment_batch",
    "collect_predictions",
    "config_error_message",
    "digit_loss",
    "load_config",
    "member_variance",
    "mixture_nll",
    "seed_everything",
    "served_config",
    "train",
]
