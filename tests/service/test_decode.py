"""service.decode: images decoded in the thread pool are all written before the request's region
can be freed, even when one of them fails."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torchvision.io import encode_png

from service.decode import INLINE_DECODE_BYTES, conform_one, decode_into, decode_one
from service.errors import BadInput
from service.settings import Settings


def _noise_png(seed: int, side: int = 300) -> bytes:
    """A PNG that barely compresses (random pixels), so a few exceed the inline-decode size."""
    g = torch.Generator().manual_seed(seed)
    img = torch.randint(0, 256, (1, side, side), dtype=torch.uint8, generator=g)
    return bytes(encode_png(img).numpy())


def test_a_failing_image_is_raised_only_after_every_other_image_is_written() -> None:
    settings = Settings()
    good = [_noise_png(i) for i in range(1, 6)]
    blobs = [b"not an image", *good]
    assert sum(map(len, blobs)) > INLINE_DECODE_BYTES  # the thread-pool path
    out = np.zeros((len(blobs), 1, 28, 28), dtype=np.uint8)
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(BadInput, match="image 0 could not be decoded"):
            asyncio.run(decode_into(blobs, out, settings, pool))
        written = out.copy()  # what the region holds when the caller would free it
    for i, png in enumerate(good, start=1):
        expected = conform_one(decode_one(png, i, settings), i, 1, (28, 28)).numpy()
        assert np.array_equal(written[i], expected), f"image {i} was still being written"


def test_every_image_decodes_into_its_own_row() -> None:
    settings = Settings()
    blobs = [_noise_png(i) for i in range(4)]
    out = np.zeros((4, 1, 28, 28), dtype=np.uint8)
    with ThreadPoolExecutor(2) as pool:
        asyncio.run(decode_into(blobs, out, settings, pool))
    for i, png in enumerate(blobs):
        assert np.array_equal(
            out[i], conform_one(decode_one(png, i, settings), i, 1, (28, 28)).numpy()
        )


def test_an_unsupported_format_names_the_formats_a_client_can_send() -> None:
    """A BMP is refused with the formats that decode, not torchvision's advice to call its own
    AVIF/HEIC decoders (nothing a client of the server can do)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (8, 8)).save(buf, "BMP")
    with pytest.raises(BadInput, match="image 0 could not be decoded") as err:
        decode_one(buf.getvalue(), 0, Settings())
    assert "jpeg, png, webp and gif" in str(err.value)
    assert "decode_avif" not in str(err.value)
