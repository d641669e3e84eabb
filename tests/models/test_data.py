"""Data: the bundled MNIST split, normalisation, fingerprint, ImageFolder, no downloads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.data import (
    BUNDLED_MNIST_SHA256,
    HOLDOUT_MNIST_SHA256,
    bundled_mnist_path,
    bundled_split,
    denormalise_uint8,
    load_bundled_mnist,
    load_dataset,
    load_holdout_mnist,
    normalise_uint8,
)


def test_bundled_file_is_the_attributed_copy():
    import hashlib

    assert hashlib.sha256(bundled_mnist_path().read_bytes()).hexdigest() == BUNDLED_MNIST_SHA256
    readme = (bundled_mnist_path().parent / "README.md").read_text()
    assert "CC BY-SA 3.0" in readme and "Juan Cazala" in readme and BUNDLED_MNIST_SHA256 in readme
    images, labels = load_bundled_mnist()
    assert images.shape == (8000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (8000,) and set(np.unique(labels)) == set(range(10))


def test_holdout_digits_are_outside_the_bundle():
    """The 2,000 held-out digits share no image with the 8k bundle (so with no split of it)."""
    readme = (bundled_mnist_path().parent / "README.md").read_text()
    assert HOLDOUT_MNIST_SHA256 in readme
    images, labels = load_holdout_mnist()
    assert images.shape == (2000, 28, 28) and images.dtype == np.uint8
    assert np.bincount(labels).tolist() == [211, 243, 206, 194, 169, 178, 189, 207, 188, 215]
    bundled, _ = load_bundled_mnist()
    seen = {img.tobytes() for img in bundled}
    assert not any(img.tobytes() in seen for img in images)
    assert len({img.tobytes() for img in images}) == 2000


def test_split_is_fixed_disjoint_and_stratified():
    s1, s2 = bundled_split(), bundled_split()
    for k in ("train", "val", "test"):
        np.testing.assert_array_equal(s1[k], s2[k])
    assert [len(s1[k]) for k in ("train", "val", "test")] == [5600, 800, 1600]
    allidx = np.concatenate([s1["train"], s1["val"], s1["test"]])
    assert len(np.unique(allidx)) == 8000
    _, labels = load_bundled_mnist()
    full = np.bincount(labels, minlength=10) / len(labels)
    for k in ("train", "val", "test"):
        frac = np.bincount(labels[s1[k]], minlength=10) / len(s1[k])
        assert np.abs(frac - full).max() < 0.005


def test_bundle_metadata_and_normalisation():
    b = load_dataset("mnist-bundled")
    assert (len(b.train), len(b.val), len(b.test)) == (5600, 800, 1600)
    assert b.in_channels == 1 and b.input_size == (28, 28) and b.num_classes == 10
    assert 0.12 < b.mean[0] < 0.14 and 0.29 < b.std[0] < 0.33
    assert len(b.fingerprint) == 64 and b.fingerprint == load_dataset("mnist-bundled").fingerprint
    x = torch.stack([b.train[i][0] for i in range(len(b.train))])
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1) < 1e-3  # train stats
    images, _ = load_bundled_mnist()
    idx = int(bundled_split()["test"][0])
    ref = (torch.from_numpy(images[idx]).float() / 255 - b.mean[0]) / b.std[0]
    torch.testing.assert_close(b.test[0][0][0], ref)
    assert b.test[0][1] == int(load_bundled_mnist()[1][idx])
    small = load_dataset("mnist-bundled", max_train_samples=100)
    assert len(small.train) == 100 and small.fingerprint == b.fingerprint


def test_normalise_uint8():
    img = torch.tensor([[[0, 255], [51, 102]]], dtype=torch.uint8)
    out = normalise_uint8(img, [0.5], [0.25])
    torch.testing.assert_close(out, (img.float() / 255 - 0.5) / 0.25)
    every = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16)  # each pixel value, back
    assert torch.equal(
        denormalise_uint8(normalise_uint8(every, [0.1307], [0.3081]), [0.1307], [0.3081]), every
    )


@pytest.mark.parametrize(
    ("shape", "mean", "std"),
    [
        ((1, 16, 16), [0.1307], [0.3081]),
        ((4, 3, 16, 16), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ],
)
def test_normalise_uint8_is_bit_identical_to_torchvision(shape, mean, std):
    """The engine's normalisation is torchvision's ``to_dtype(scale=True)`` + ``normalize`` spelled
    in torch (models/data.py says why): every uint8 level, every channel, bit for bit."""
    from torchvision.transforms.v2 import functional as TF

    levels = torch.arange(256, dtype=torch.uint8).repeat(math.prod(shape) // 256 + 1)
    img = levels[torch.randperm(len(levels), generator=torch.Generator().manual_seed(0))]
    img = img[: math.prod(shape)].reshape(shape)
    want = TF.normalize(TF.to_dtype(img, torch.float32, scale=True), mean, std)
    assert torch.equal(normalise_uint8(img, mean, std), want)


def test_unknown_and_missing_datasets_do_not_download(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="allow_download"):
        load_dataset("MNIST", data_root=tmp_path)
    assert not any(tmp_path.rglob("*.gz"))
    with pytest.raises(ValueError, match="does not exist"):
        load_dataset(f"imagefolder:{tmp_path / 'nope'}")


def test_imagefolder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(10):
            arr = rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / cls / f"{i}.png")
    b = load_dataset(f"imagefolder:{tmp_path}", image_size=16)
    assert b.class_names == ["cat", "dog"] and b.in_channels == 3 and b.input_size == (16, 16)
    assert len(b.train) + len(b.val) + len(b.test) == 20
    assert len(b.test) == 4
    x, y = b.train[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y in (0, 1)
    assert len(b.mean) == 3 and all(0.3 < m < 0.7 for m in b.mean)
    assert b.fingerprint == load_dataset(f"imagefolder:{tmp_path}", image_size=16).fingerprint


def _write_pngs(root, files: dict[str, int], rgb: bool = False, size=(28, 28)) -> None:
    """``files``: class folder name -> number of random PNGs to write under it."""
    from PIL import Image

    rng = np.random.default_rng(1)
    for cls, n in files.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            shape = (*size, 3) if rgb else size
            Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8)).save(
                root / cls / f"{i}.png"
            )


def test_imagefolder_added_to_bundled_mnist(tmp_path):
    from PIL import Image

    from models.data import parse_imagefolder
    from models.prepare import canonicalise

    folder = tmp_path / "reviewed"
    _write_pngs(folder, {"3": 2})
    _write_pngs(folder, {"7": 1}, rgb=True, size=(40, 36))  # RGB, another size: conformed
    name = f"imagefolder:{folder}+mnist-bundled"
    assert parse_imagefolder(name) == (str(folder), True)
    assert parse_imagefolder(f"imagefolder:{folder}") == (str(folder), False)
    base = load_dataset("mnist-bundled")
    b = load_dataset(name)
    assert len(b.train) == len(base.train) + 3
    assert (b.class_names, b.in_channels, b.input_size) == (base.class_names, 1, (28, 28))
    assert (b.mean, b.std) == (base.mean, base.std) and b.name == name
    assert b.extra["added_train"] == 3 and b.extra["added_by_class"]["3"] == 2
    # the bundled training images first, unchanged; the folder's after, labelled by class name
    x, y = b.train.tensors
    torch.testing.assert_close(x[: len(base.train)], base.train.tensors[0], rtol=0, atol=0)
    assert y[-3:].tolist() == [3, 3, 7]
    with Image.open(folder / "7" / "0.png") as im:
        img = torch.from_numpy(np.array(im)).permute(2, 0, 1)  # RGB (3, 40, 36)
    # read as the server reads an upload: the same canonical digit (models.prepare)
    ref = normalise_uint8(canonicalise(img).image, base.mean, base.std)
    torch.testing.assert_close(x[-1], ref)
    # validation and test are the bundled ones
    for split in ("val", "test"):
        a, c = getattr(b, split).tensors, getattr(base, split).tensors
        assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    assert b.fingerprint != base.fingerprint
    assert load_dataset(name).fingerprint == b.fingerprint
    small = load_dataset(name, max_train_samples=100)  # truncates the bundled part only
    assert len(small.train) == 103 and small.fingerprint == b.fingerprint


def test_data_roots_do_not_follow_symbolic_links_out(tmp_path):
    """A class folder or image that is a symbolic link out of the data root is not read (issue
    36): a training job on reviews cannot be made to read /etc or another job's files."""
    from PIL import Image

    outside = tmp_path / "outside"
    outside.mkdir()
    Image.fromarray(np.full((28, 28), 255, np.uint8)).save(outside / "secret.png")
    folder = tmp_path / "reviewed"
    _write_pngs(folder, {"3": 1})
    (folder / "3" / "link.png").symlink_to(outside / "secret.png")
    (folder / "5").symlink_to(outside, target_is_directory=True)
    b = load_dataset(f"imagefolder:{folder}+mnist-bundled")
    assert b.extra["added_train"] == 1 and b.extra["added_by_class"]["5"] == 0
    plain = tmp_path / "plain"
    _write_pngs(plain, {"a": 10, "b": 10})
    (plain / "a" / "link.png").symlink_to(outside / "secret.png")
    bundle = load_dataset(f"imagefolder:{plain}")
    assert len(bundle.train) + len(bundle.val) + len(bundle.test) == 20


def test_imagefolder_added_to_bundled_mnist_rejects_bad_folders(tmp_path):
    _write_pngs(tmp_path / "bad", {"3": 1, "cat": 1})
    with pytest.raises(ValueError, match="'cat'"):
        load_dataset(f"imagefolder:{tmp_path / 'bad'}+mnist-bundled")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images"):
        load_dataset(f"imagefolder:{tmp_path / 'empty'}+mnist-bundled")
    (tmp_path / "empty" / "5").mkdir()  # a class folder without images is still no images
    with pytest.raises(ValueError, match="no images"):
        load_dataset(f"imagefolder:{tmp_path / 'empty'}+mnist-bundled")
    with pytest.raises(ValueError, match="does not exist"):
        load_dataset(f"imagefolder:{tmp_path / 'missing'}+mnist-bundled")
    _write_pngs(tmp_path / "ok", {"1": 1})
    with pytest.raises(ValueError, match="image_size"):
        load_dataset(f"imagefolder:{tmp_path / 'ok'}+mnist-bundled", image_size=32)
    (tmp_path / "ok" / "1" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="broken.png"):
        load_dataset(f"imagefolder:{tmp_path / 'ok'}+mnist-bundled")


def test_rgb_conforms_to_the_same_gray_levels_as_grayscale_and_as_pil():
    """A gray image sent as RGB gives exactly the grayscale pixels (torchvision's uint8
    rgb_to_grayscale made every level v >= 1 into v - 1), and colour becomes PIL's "L" luma exactly."""
    from PIL import Image

    from models.prepare import conform_image

    gray = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16)
    assert torch.equal(conform_image(gray.expand(3, -1, -1), 1, (16, 16)), gray)
    rgba = torch.cat([gray.expand(3, -1, -1), torch.full_like(gray, 7)])  # alpha dropped
    assert torch.equal(conform_image(rgba, 1, (16, 16)), gray)
    rgb = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 20, 20), dtype=np.uint8))
    pil = np.array(Image.fromarray(rgb.permute(1, 2, 0).numpy(), "RGB").convert("L"))
    assert np.array_equal(conform_image(rgb, 1, (20, 20))[0].numpy(), pil)
