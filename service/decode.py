"""Image payloads → model input, off the event loop.

Reads images from multipart files or JSON base64, enforces the size caps, decodes with
:func:`torchvision.io.decode_image` (PNG, JPEG, GIF, WebP, ... whatever torchvision reads) in a
thread pool for larger payloads, and conforms each to the model's channels and size straight into
the request's shared-memory region (uint8; the engine normalises whole batches on its device).
Every failure is a 4xx naming the image and the problem.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import struct
from concurrent.futures import Executor

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_image

from models.data import conform_image
from service.errors import BadInput, PayloadTooLarge
from service.settings import Settings


def _header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) read from a PNG, GIF or JPEG header without decoding, else None."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        w, h = struct.unpack(">II", data[16:24])
        return w, h
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = struct.unpack("<HH", data[6:10])
        return w, h
    if data[:2] == b"\xff\xd8":
        i = 2
        while i + 9 < len(data):
            if data[i] != 0xFF:
                i += 1
                continue
            marker = data[i + 1]
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                h, w = struct.unpack(">HH", data[i + 5 : i + 9])
                return w, h
            if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
                i += 2
                continue
            (seg_len,) = struct.unpack(">H", data[i + 2 : i + 4])
            i += 2 + seg_len
    return None


def check_image_bytes(data: bytes, index: int, settings: Settings) -> None:
    """Size caps on one encoded image (raises 413 / 400)."""
    if not data:
        raise BadInput(f"image {index} is empty")
    if len(data) > settings.max_image_bytes:
        raise PayloadTooLarge(
            f"image {index} is {len(data)} bytes, over the limit of {settings.max_image_bytes} "
            "bytes (VGE_MAX_IMAGE_BYTES)"
        )
    size = _header_size(data)
    if size is not None and size[0] * size[1] > settings.max_image_pixels:
        raise PayloadTooLarge(
            f"image {index} is {size[0]}x{size[1]} pixels, over the limit of "
            f"{settings.max_image_pixels} pixels (VGE_MAX_IMAGE_PIXELS)"
        )


def _clean(exc: Exception) -> str:
    """torchvision's message without its C++ source location, and without its advice to call
    torchvision's own AVIF/HEIC decoders (a client of this server cannot)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^.*?\.(cpp|h):\d+,\s*", "", text)
    return re.sub(r"\s*For avif and heic.*$", "", text)[:200]


def decode_one(data: bytes, index: int, settings: Settings) -> torch.Tensor:
    """Decode one encoded image to a uint8 (C, H, W) tensor, or raise a 4xx naming the problem."""
    check_image_bytes(data, index, settings)
    try:
        img = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                           mode=ImageReadMode.UNCHANGED)  # fmt: skip
    except (RuntimeError, ValueError) as exc:
        raise BadInput(
            f"image {index} could not be decoded (not an image, or corrupt/truncated): "
            f"{_clean(exc)}"
        ) from None
    if img.ndim == 4:  # animated GIF: first frame
        img = img[0]
    if img.shape[-1] * img.shape[-2] > settings.max_image_pixels:
        raise PayloadTooLarge(
            f"image {index} is {img.shape[-1]}x{img.shape[-2]} pixels, over the limit of "
            f"{settings.max_image_pixels} pixels (VGE_MAX_IMAGE_PIXELS)"
        )
    if img.dtype != torch.uint8:  # 16-bit PNG
        from torchvision.transforms.v2.functional import to_dtype

        img = to_dtype(img, torch.uint8, scale=True)
    return img


def conform_one(
    img: torch.Tensor, index: int, channels: int, size: tuple[int, int]
) -> torch.Tensor:
    """:func:`models.data.conform_image` with its ValueErrors turned into 400s naming the image."""
    try:
        return conform_image(img, channels, size)
    except ValueError as exc:
        raise BadInput(f"image {index} cannot be converted to the model's input: {exc}") from None


def _decode_into(
    data: bytes, index: int, out: np.ndarray, channels: int, size: tuple[int, int],
    settings: Settings,
) -> None:  # fmt: skip
    np.copyto(out, conform_one(decode_one(data, index, settings), index, channels, size).numpy())


#: Payloads up to this many bytes are decoded on the event loop: a thread hop costs more than
#: decoding a few small images (a 28×28 PNG decodes in ~20 µs).
INLINE_DECODE_BYTES = 64 * 1024


async def decode_into(
    blobs: list[bytes],
    out: np.ndarray,
    settings: Settings,
    executor: Executor,
) -> None:
    """Decode ``blobs`` into ``out`` (uint8 ``(n, Cin, H, W)``, an arena region): the model's
    channels and size per image; normalisation happens batched on the engine's device.

    Returns (or raises the first image's error) only once no decode thread writes into ``out``
    any more, even when the request is cancelled meanwhile: the caller frees the region after
    an error, and another request may be given it at once.
    """
    channels, size = int(out.shape[1]), (int(out.shape[2]), int(out.shape[3]))
    if sum(len(b) for b in blobs) <= INLINE_DECODE_BYTES:
        for i, b in enumerate(blobs):
            _decode_into(b, i, out[i], channels, size, settings)
        return
    loop = asyncio.get_running_loop()
    every = asyncio.gather(
        *(
            loop.run_in_executor(executor, _decode_into, b, i, out[i], channels, size, settings)
            for i, b in enumerate(blobs)
        ),
        return_exceptions=True,
    )
    try:
        results = await asyncio.shield(every)
    except asyncio.CancelledError:
        await every  # the threads still write into the region: it is freed only after them
        raise
    for result in results:
        if isinstance(result, BaseException):
            raise result


def check_count(n: int, settings: Settings) -> None:
    """No images → 400; more than ``max_images`` → 413."""
    if n == 0:
        raise BadInput('no images: send multipart files or JSON {"images": ["<base64>", ...]}')
    if n > settings.max_images:
        raise PayloadTooLarge(
            f"too many images: {n} in one request, the limit is {settings.max_images} "
            "(VGE_MAX_IMAGES); split the request"
        )


def b64_images(items: list[str], settings: Settings) -> list[bytes]:
    """Decode base64 strings (optionally ``data:image/...;base64,`` URLs) to bytes."""
    check_count(len(items), settings)
    out = []
    for i, s in enumerate(items):
        if s.startswith("data:"):
            _, _, s = s.partition(",")
        if len(s) > settings.max_image_bytes * 4 // 3 + 8:
            raise PayloadTooLarge(
                f"image {i} is over the limit of {settings.max_image_bytes} bytes "
                "(VGE_MAX_IMAGE_BYTES)"
            )
        try:
            out.append(base64.b64decode(s, validate=True))
        except (binascii.Error, ValueError):
            raise BadInput(f"images[{i}] is not valid base64") from None
    return out


def multipart_images(files: list[tuple[str, bytes]], settings: Settings) -> list[bytes]:
    """The bytes of uploaded ``(filename, bytes)`` files in order, refusing any over
    ``max_image_bytes``."""
    check_count(len(files), settings)
    for i, (filename, data) in enumerate(files):
        if len(data) > settings.max_image_bytes:
            raise PayloadTooLarge(
                f"image {i} ({filename!r}) is over the limit of {settings.max_image_bytes} bytes "
                "(VGE_MAX_IMAGE_BYTES)"
            )
    return [data for _, data in files]


def to_png(data: bytes) -> bytes:
    """Re-encode an image (as stored in the review queue) as PNG, for ImageFolder exports."""
    from torchvision.io import encode_png

    img = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                       mode=ImageReadMode.UNCHANGED)  # fmt: skip
    if img.ndim == 4:
        img = img[0]
    if img.dtype != torch.uint8:
        from torchvision.transforms.v2.functional import to_dtype

        img = to_dtype(img, torch.uint8, scale=True)
    return bytes(encode_png(img).numpy())
