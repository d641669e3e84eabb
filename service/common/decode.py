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
from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_image
from torchvision.io import image as _tv_image

from models.data import image_read_mode
from models.prepare import Finding, PrepareMode, conform_image, prepare_image
from service.common.errors import BadInput, PayloadTooLarge
from service.common.settings import Settings


def _decode_op() -> Callable[[torch.Tensor, ImageReadMode, bool], torch.Tensor]:
    """``decode_image(data, mode, apply_exif_orientation)``: torchvision's decoding op called
    directly when its image extension is loaded. :func:`torchvision.io.decode_image` wraps that
    op in a usage log, an extension check and a ``warnings.warn`` of its deprecation (filtered
    out, but looked up through the warning filters on every image: ~4 µs of the ~20 µs an MNIST
    digit takes); without the extension, the wrapper (whose check raises torchvision's error)."""
    if _tv_image._has_image_ops():
        op = torch.ops.image.decode_image
        return lambda data, mode, exif: op(data, mode.value, exif)
    return lambda data, mode, exif: decode_image(data, mode=mode, apply_exif_orientation=exif)


_DECODE = _decode_op()


class ImageHeader(NamedTuple):
    """What an image's header says it decodes to, read without decoding it."""

    format: str  # "png" | "gif" | "jpeg" | "webp"
    width: int  # GIF: the larger of the canvas and its largest frame
    height: int
    frames: int = 1  # GIF: every frame is decoded, each to the full canvas
    components: int = 0  # JPEG: colour components (4: CMYK/YCCK); 0 where not read

    @property
    def pixels(self) -> int:
        """Pixels the decoder will write: ``frames × width × height``."""
        return self.frames * self.width * self.height


#: Data sub-blocks a GIF's header walk reads at most. A legitimate 8 MiB GIF holds ~33,000 (255
#: bytes each); one of 1-byte sub-blocks holds millions and held the interpreter 0.5 s per image.
GIF_MAX_SUB_BLOCKS = 200_000


class _GifWalk(NamedTuple):
    frames: int
    width: int  # the widest of the canvas and every frame
    height: int


def _gif_walk(data: bytes) -> _GifWalk | None:
    """Frames in a GIF and the largest frame, walking its blocks (GIF89a spec §§ 17–27). The
    decoder writes every frame at the larger of the canvas and the frame's own size (giflib keeps
    each frame's buffer too): a 1×1 canvas can hold 4096×4096 frames. A block a GIF may not hold
    ends the walk (the decoder stops there too, after the frames before it); a file cut short
    counts the frames it holds. None past :data:`GIF_MAX_SUB_BLOCKS`."""
    budget = GIF_MAX_SUB_BLOCKS
    n = len(data)

    def skip_sub_blocks(i: int) -> int:
        nonlocal budget
        while i < n and data[i]:
            i += data[i] + 1
            budget -= 1
            if budget < 0:
                return n + 1
        return i + 1

    width, height = struct.unpack("<HH", data[6:10])
    i, frames = 13, 0
    if data[10] & 0x80:  # global colour table
        i += 3 << ((data[10] & 7) + 1)
    while i < n:
        block = data[i]
        if block == 0x21:  # extension: label, then sub-blocks
            i = skip_sub_blocks(i + 2)
        elif block == 0x2C and i + 10 <= n:  # image descriptor, local colour table, LZW, data
            frames += 1
            w, h = struct.unpack("<HH", data[i + 5 : i + 9])
            width, height = max(width, w), max(height, h)
            packed = data[i + 9]
            i += 10 + ((3 << ((packed & 7) + 1)) if packed & 0x80 else 0)
            i = skip_sub_blocks(i + 1)
        else:  # the trailer, a descriptor cut short, or a block no GIF holds
            break
        if budget < 0:
            return None
    return _GifWalk(max(frames, 1), width, height)


def read_header(data: bytes) -> ImageHeader | None:
    """The format, size and (GIF) frame count of a PNG, GIF, JPEG or WebP, the formats
    :func:`torchvision.io.decode_image` decodes, from their headers; None for anything else, or a
    header too short or malformed to say (the decoder refuses those). ``ValueError`` for a GIF
    too costly to walk (:data:`GIF_MAX_SUB_BLOCKS`)."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        w, h = struct.unpack(">II", data[16:24])
        return ImageHeader("png", w, h)
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 13:
        walk = _gif_walk(data)
        if walk is None:
            raise ValueError(f"a GIF of over {GIF_MAX_SUB_BLOCKS} data blocks; re-encode it")
        return ImageHeader("gif", walk.width, walk.height, walk.frames)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP" and len(data) >= 30:
        chunk = data[12:16]
        if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":  # lossy: key frame header
            w, h = struct.unpack("<HH", data[26:30])
            return ImageHeader("webp", w & 0x3FFF, h & 0x3FFF)
        if chunk == b"VP8L" and data[20] == 0x2F:  # lossless: 14-bit width-1, height-1
            (bits,) = struct.unpack("<I", data[21:25])
            return ImageHeader("webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
        if chunk == b"VP8X":  # extended: 24-bit canvas width-1, height-1
            w = int.from_bytes(data[24:27], "little") + 1
            h = int.from_bytes(data[27:30], "little") + 1
            return ImageHeader("webp", w, h)
        return None
    if data[:2] == b"\xff\xd8":
        i = 2
        while i + 9 < len(data):
            if data[i] != 0xFF:  # bytes between segments (decoders skip them): to the next marker
                i = data.find(b"\xff", i)  # in C: 8 MB of filler took 0.6 s byte by byte
                if i < 0:
                    break
                continue
            marker = data[i + 1]
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # start of frame
                h, w = struct.unpack(">HH", data[i + 5 : i + 9])
                return ImageHeader("jpeg", w, h, components=data[i + 9])
            if marker in (0xD8, 0x01, 0xFF) or 0xD0 <= marker <= 0xD7:
                i += 1 if marker == 0xFF else 2  # fill byte, or a marker without a length
                continue
            (seg_len,) = struct.unpack(">H", data[i + 2 : i + 4])
            i += 2 + seg_len
    return None


def check_image_bytes(data: bytes, index: int, settings: Settings) -> ImageHeader | None:
    """Size caps on one encoded image, before decoding it (raises 413 / 400).

    The pixel cap applies to what the decoder would write: every frame of a GIF is decoded to
    the whole canvas, so a 4 KB GIF of 200 one-pixel frames on a 1000×1000 canvas decodes to
    600 MB, and a 10 KB lossless WebP can claim 16383×16383. Returns the header read.
    """
    if not data:
        raise BadInput(f"image {index} is empty")
    if len(data) > settings.max_image_bytes:
        raise PayloadTooLarge(
            f"image {index} is {len(data)} bytes, over the limit of {settings.max_image_bytes} "
            "bytes (VGE_MAX_IMAGE_BYTES)"
        )
    try:
        header = read_header(data)
    except ValueError as exc:
        raise BadInput(f"image {index} is not decoded: {exc}") from None
    if header is not None and header.pixels > settings.max_image_pixels:
        frames = f" in {header.frames} frames" if header.frames > 1 else ""
        raise PayloadTooLarge(
            f"image {index} is {header.width}x{header.height} pixels{frames}, over the limit of "
            f"{settings.max_image_pixels} decoded pixels (VGE_MAX_IMAGE_PIXELS)"
        )
    return header


def _clean(exc: Exception) -> str:
    """torchvision's message without its C++ source location, and without its advice to call
    torchvision's own AVIF/HEIC decoders (a client of this server cannot)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^.*?\.(cpp|h):\d+,\s*", "", text)
    return re.sub(r"\s*For avif and heic.*$", "", text)[:200]


def read_mode(header: ImageHeader | None, data: bytes) -> ImageReadMode:
    """UNCHANGED (gray stays gray, alpha is dropped later), except for CMYK/YCCK JPEGs: those
    decode UNCHANGED to four inverted ink channels, which would be read as RGBA (a digit came out
    all white); the decoder's own conversion to RGB is the picture. And palette PNGs (``data``):
    their colours, not their indices (:func:`models.data.image_read_mode`, which the training
    data path reads files with too)."""
    if header is not None and header.format == "jpeg" and header.components == 4:
        return ImageReadMode.RGB
    return image_read_mode(data)


def decode_one(data: bytes, index: int, settings: Settings) -> torch.Tensor:
    """Decode one encoded image to a uint8 (C, H, W) tensor, or raise a 4xx naming the problem."""
    return _decode(data, check_image_bytes(data, index, settings), index, settings.max_image_pixels)


def _decode(
    data: bytes, header: ImageHeader | None, index: int, max_pixels: int | None
) -> torch.Tensor:
    """Decode an image whose ``header`` was checked: uint8 (C, H, W), the first frame of an
    animation; ``max_pixels`` (None: no cap) catches a header that under-stated its size."""
    try:
        mode = read_mode(header, data)
        img = _DECODE(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode, True)
    except (RuntimeError, ValueError) as exc:
        raise BadInput(
            f"image {index} could not be decoded (not an image, or corrupt/truncated): "
            f"{_clean(exc)}"
        ) from None
    if max_pixels is not None and img.numel() // img.shape[-3] > max_pixels:
        raise PayloadTooLarge(
            f"image {index} is {img.shape[-1]}x{img.shape[-2]} pixels, over the limit of "
            f"{max_pixels} decoded pixels (VGE_MAX_IMAGE_PIXELS)"
        )
    if img.ndim == 4:  # animated GIF: first frame
        img = img[0]
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


def prepare_one(
    img: torch.Tensor, index: int, prepare: PrepareMode, channels: int, size: tuple[int, int]
) -> tuple[torch.Tensor, Finding]:
    """:func:`models.prepare.prepare_image` (``mnist``: the canonical digit; ``none``: channels
    and size only) with its ValueErrors turned into 400s naming the image."""
    try:
        image, finding = prepare_image(img, prepare, channels, size)
    except ValueError as exc:
        raise BadInput(f"image {index} cannot be converted to the model's input: {exc}") from None
    return image, finding


def _decode_into(
    decode: Callable[[], torch.Tensor], index: int, out: np.ndarray, findings: np.ndarray,
    prepare: PrepareMode, channels: int, size: tuple[int, int],
) -> None:  # fmt: skip
    """Write image ``index``, as ``decode()`` gives it, prepared for the model into ``out`` and
    what its preparation found into ``findings[index]``."""
    try:
        image, finding = prepare_one(decode(), index, prepare, channels, size)
        np.copyto(out, image.numpy())
        findings[index] = finding
    except (BadInput, PayloadTooLarge) as exc:
        # Without its traceback and context: they would keep decode_one's frame, and the decoded
        # image in it, alive for as long as the request's other images take to decode.
        exc.__context__ = None
        raise exc.with_traceback(None) from None


#: Payloads up to this many bytes, and this many decoded pixels, are decoded on the event loop:
#: a thread hop costs more than decoding a few small images (a 28×28 PNG decodes in ~20 µs). The
#: pixel bound keeps images that compress well but decode large (a blank 4096×4096 PNG is 50 KB)
#: off the loop, where they stalled every other request of the front end.
INLINE_DECODE_BYTES = 64 * 1024
INLINE_DECODE_PIXELS = 256 * 256
#: With ``prepare=mnist`` the bound is a few MNIST-sized images: reading a picture of a digit
#: costs ~0.6 ms at 28×28 and ~1–6 ms for a 100–300 px photo (docs/benchmarks.md), an MNIST digit
#: ~20 µs; larger pictures are read in the decode threads, not on the event loop.
INLINE_PREPARE_PIXELS = 4 * 28 * 28


def _decode_inline(
    blobs: list[bytes], settings: Settings, prepare: PrepareMode = "none"
) -> list[ImageHeader | None] | None:
    """The checked headers of ``blobs`` (:func:`check_image_bytes`) when they are small enough,
    encoded and decoded, to decode on the event loop; None otherwise (the decode threads check
    them). Small payloads are cheap to check here, and so are checked once."""
    if sum(len(b) for b in blobs) > INLINE_DECODE_BYTES:
        return None
    headers = [check_image_bytes(b, i, settings) for i, b in enumerate(blobs)]
    bound = INLINE_PREPARE_PIXELS if prepare == "mnist" else INLINE_DECODE_PIXELS
    if sum(h.pixels for h in headers if h is not None) > bound:
        return None
    return headers


async def decode_into(
    blobs: list[bytes],
    out: np.ndarray,
    settings: Settings,
    executor: Executor,
    prepare: PrepareMode = "none",
) -> np.ndarray:
    """Decode ``blobs`` into ``out`` (uint8 ``(n, Cin, H, W)``, an arena region), each prepared
    for the model (``prepare``, :func:`models.prepare.prepare_image`); normalisation happens
    batched on the engine's device. Returns what each image's preparation found (uint8 ``(n,)``
    of :class:`models.prepare.Finding`).

    Returns (or raises the first image's error) only once no decode thread writes into ``out``
    any more, even when the request is cancelled meanwhile: the caller frees the region after
    an error, and another request may be given it at once.
    """
    channels, size = int(out.shape[1]), (int(out.shape[2]), int(out.shape[3]))
    findings = np.zeros(len(blobs), np.uint8)
    headers = _decode_inline(blobs, settings, prepare)
    if headers is not None:
        cap = settings.max_image_pixels
        for i, (b, header) in enumerate(zip(blobs, headers, strict=True)):
            _decode_into(
                partial(_decode, b, header, i, cap), i, out[i], findings, prepare, channels, size
            )
        return findings
    loop = asyncio.get_running_loop()
    every = asyncio.gather(
        *(
            loop.run_in_executor(
                executor,
                _decode_into,
                partial(decode_one, b, i, settings),
                i,
                out[i],
                findings,
                prepare,
                channels,
                size,
            )  # fmt: skip
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
    return findings


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
    """Re-encode an image (as stored in the review queue) as PNG, for ImageFolder exports; an
    alpha channel is flattened onto white, as the default reading (``prepare=mnist``,
    :func:`models.prepare.canonicalise`) does, so a training job on the export reads what the
    server read: the ImageFolder loader would drop the alpha instead (a black digit on a
    transparent page came out black on black). PNG here takes 1 or 3 channels: a transparent
    WebP broke the export and every training job on reviews."""
    from torchvision.io import encode_png

    from models.prepare import over_white

    return bytes(encode_png(over_white(_decode(data, read_header(data), 0, None))).numpy())
