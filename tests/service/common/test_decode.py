"""service.common.decode: images decoded in the thread pool are all written before the request's region
can be freed, even when one of them fails."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import pytest
import torch
from torchvision.io import decode_image, encode_png

from service.common.decode import INLINE_DECODE_BYTES, conform_one, decode_into, decode_one
from service.common.errors import BadInput
from service.common.settings import Settings


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


def _pil_bytes(img, fmt: str, **kw) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("mode", "kw", "chunk"),
    [("RGB", {}, b"VP8 "), ("L", {"lossless": True}, b"VP8L"), ("RGBA", {}, b"VP8X")],
)
def test_webp_size_is_read_from_each_kind_of_header(mode: str, kw: dict, chunk: bytes) -> None:
    """A WebP's size comes from its header, as PNG's, GIF's and JPEG's do: a 10 KB lossless WebP
    can claim 16383×16383 (805 MB decoded), and 64 of them in one request killed a front end."""
    from PIL import Image

    from service.common.decode import check_image_bytes, read_header
    from service.common.errors import PayloadTooLarge

    data = _pil_bytes(Image.new(mode, (300, 200)), "WEBP", **kw)
    assert data[12:16] == chunk
    assert read_header(data) == ("webp", 300, 200, 1, 0)
    with pytest.raises(PayloadTooLarge, match="300x200 pixels, over the limit of 59999"):
        check_image_bytes(data, 0, Settings(max_image_pixels=59_999))
    assert check_image_bytes(data, 0, Settings(max_image_pixels=60_000)) is not None


def test_a_gif_is_sized_by_every_frame_it_decodes() -> None:
    """Every frame of a GIF decodes to the whole canvas: 1000 one-pixel frames on a 4096×4096
    canvas are a 23 KB file and 50 GB decoded. The header walk counts the frames the decoder
    writes."""
    from PIL import Image

    from service.common.decode import check_image_bytes, read_header
    from service.common.errors import PayloadTooLarge

    frames = [Image.new("L", (40, 30), c) for c in (0, 60, 120, 180, 240)]
    data = _pil_bytes(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    decoded = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert read_header(data) == ("gif", 40, 30, decoded.shape[0], 0) and decoded.shape[0] == 5
    with pytest.raises(PayloadTooLarge, match="40x30 pixels in 5 frames"):
        check_image_bytes(data, 0, Settings(max_image_pixels=5 * 1200 - 1))
    img = decode_one(data, 0, Settings(max_image_pixels=5 * 1200))  # the first frame is served
    assert img.shape == (3, 30, 40) and int(img.max()) == 0

    # Hand-built: frames of one pixel each on a big canvas (what a GIF bomb looks like).
    bomb = _gif((1000, 1000), [(1, 1)] * 200)
    assert read_header(bomb) == ("gif", 1000, 1000, 200, 0)
    with pytest.raises(PayloadTooLarge, match="in 200 frames"):
        decode_one(bomb, 0, Settings())


def _gif(canvas: tuple[int, int], frames: list[tuple[int, int]], tail: bytes = b"\x3b") -> bytes:
    """A GIF with a 2-colour table, each frame's descriptor of the given size and one LZW code."""
    import struct

    out = bytearray(b"GIF89a" + struct.pack("<HH", *canvas) + b"\x80\x00\x00" + bytes(6))
    for i, (w, h) in enumerate(frames):
        out += b"\x21\xf9\x04\x00\x00\x00\x00\x00"  # graphic control extension
        out += b"\x2c" + struct.pack("<HHHH", i % 2, 0, w, h) + b"\x00\x02\x02\x44\x01\x00"
    return bytes(out + tail)


def test_a_gif_is_sized_by_its_largest_frame_and_walked_within_bounds() -> None:
    """The decoder writes each frame at the larger of the canvas and the frame: a 1×1 canvas with
    3000×3000 frames passed as one pixel (40 such frames took 2.6 s and 338 MB to decode). A
    block no GIF holds ends the walk with the frames before it (the decoder decodes those, then
    fails), and a walk over too many data sub-blocks is refused instead of holding the
    interpreter."""
    from service.common.decode import GIF_MAX_SUB_BLOCKS, check_image_bytes, read_header
    from service.common.errors import PayloadTooLarge

    small_canvas = _gif((1, 1), [(1, 1), (3000, 3000)])
    assert read_header(small_canvas) == ("gif", 3000, 3000, 2, 0)
    with pytest.raises(PayloadTooLarge, match="3000x3000 pixels in 2 frames"):
        check_image_bytes(small_canvas, 0, Settings())
    junk = _gif((100, 100), [(1, 1)] * 3, tail=b"\x99" + _gif((1, 1), [(4000, 4000)] * 9)[13:])
    assert read_header(junk) == ("gif", 100, 100, 3, 0)
    many = bytearray(_gif((1, 1), [(1, 1)], tail=b""))
    many += b"\x21\xfe" + b"\x01x" * (GIF_MAX_SUB_BLOCKS + 1) + b"\x00\x3b"  # comment blocks
    with pytest.raises(BadInput, match="image 0 is not decoded: a GIF of over 200000 data blocks"):
        check_image_bytes(bytes(many), 0, Settings())


def test_a_cmyk_jpeg_decodes_to_its_picture_not_its_inks() -> None:
    """A CMYK JPEG decoded UNCHANGED gives four inverted ink channels, which were read as RGBA:
    the digit came out a blank white image. It is decoded to RGB instead."""
    from pathlib import Path

    from PIL import Image

    from service.common.decode import read_header

    digit = Image.open(Path(__file__).parents[3] / "examples" / "digit-7.png").convert("L")
    cmyk = _pil_bytes(digit.convert("CMYK"), "JPEG", quality=95)
    rgb = _pil_bytes(digit.convert("RGB"), "JPEG", quality=95)
    assert read_header(cmyk).components == 4 and read_header(rgb).components == 3
    got = conform_one(decode_one(cmyk, 0, Settings()), 0, 1, (28, 28)).float()
    want = conform_one(decode_one(rgb, 0, Settings()), 0, 1, (28, 28)).float()
    assert (got - want).abs().mean() < 2.0, (got - want).abs().mean()
    assert float(got.mean()) < 100  # a dark digit on black, not all white
    from service.common.decode import to_png  # what a review export writes for it

    exported = decode_image(torch.frombuffer(bytearray(to_png(cmyk)), dtype=torch.uint8))
    assert exported.shape[0] == 3 and float(exported.float().mean()) < 100


@pytest.mark.parametrize("mode,fmt", [("RGBA", "WEBP"), ("LA", "PNG"), ("RGBA", "PNG")])
def test_an_export_of_a_transparent_image_is_flattened_onto_white(mode: str, fmt: str) -> None:
    """A review export (to_png) of an image with alpha: PNG of 1 or 3 channels, the colour over
    white as the reading sees it (a transparent WebP raised in encode_png, which broke the
    export and every training job on reviews)."""
    from PIL import Image

    from service.common.decode import to_png

    img = Image.new(mode, (8, 6), (0, 0) if mode == "LA" else (0, 0, 0, 0))  # transparent
    img.putpixel((2, 3), (40, 255) if mode == "LA" else (40, 40, 40, 255))  # one opaque pixel
    data = _pil_bytes(img, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    exported = decode_image(torch.frombuffer(bytearray(to_png(data)), dtype=torch.uint8))
    assert exported.shape == (1 if mode == "LA" else 3, 6, 8)
    assert int(exported[:, 3, 2].max()) == 40 and int(exported[:, 0, 0].min()) == 255


def test_a_failed_decode_does_not_keep_its_image_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The error raised for an image carries no traceback into the decoder's frame, where the
    decoded tensor lived: a request's failed images must not hold their memory while the others
    decode (with the traceback kept, 64 decompression bombs held 64 decoded images at once)."""
    import weakref

    import service.common.decode as decode

    refs: list[weakref.ref] = []

    def refuse_after_decoding(img, index, prepare, channels, size):
        refs.append(weakref.ref(img))
        raise BadInput("refused after decoding")

    monkeypatch.setattr(decode, "prepare_one", refuse_after_decoding)
    _check_released(decode, refs)

    def refuse_while_handling(img, index, prepare, channels, size):  # as prepare_one: in except
        refs.append(weakref.ref(img))
        try:
            raise ValueError("not convertible")
        except ValueError:
            raise BadInput("refused while handling another error") from None

    refs.clear()
    monkeypatch.setattr(decode, "prepare_one", refuse_while_handling)
    _check_released(decode, refs)


def _check_released(decode, refs) -> None:  # noqa: ANN001
    """Decode one image through ``decode._decode_into`` (whose conform step refuses it) and
    check that the decoded tensor is gone once the error is raised."""
    import gc

    with pytest.raises(BadInput) as err:
        decode._decode_into(partial(decode.decode_one, _noise_png(7), 0, Settings()), 0,
                            np.zeros((1, 28, 28), np.uint8), np.zeros(1, np.uint8), "mnist", 1,
                            (28, 28))  # fmt: skip
    gc.collect()
    assert refs and refs[0]() is None, "the decoded image is still referenced"
    assert err.value.__traceback__ is not None  # only _decode_into's own frame
    assert err.value.__context__ is None


def test_images_that_decode_large_are_not_decoded_on_the_event_loop() -> None:
    """A blank 2048×2048 PNG is a few KB: small by bytes, 4 M pixels decoded. Decoding it inline
    stalled the front end's event loop; only payloads small both ways are decoded there."""
    from service.common.decode import _decode_inline

    blank = bytes(encode_png(torch.zeros((1, 2048, 2048), dtype=torch.uint8)).numpy())
    digit = bytes(encode_png(torch.zeros((1, 28, 28), dtype=torch.uint8)).numpy())
    assert len(blank) < INLINE_DECODE_BYTES
    inline = partial(_decode_inline, settings=Settings())
    assert inline([blank]) is None and inline([digit] * 64) is not None
    assert inline([_noise_png(i) for i in range(2)]) is None  # over the byte bound
    # reading pictures of digits (prepare=mnist) costs more per pixel: a few 28×28 digits inline,
    # a 100×100 photo in the decode threads
    photo = bytes(encode_png(torch.zeros((1, 100, 100), dtype=torch.uint8)).numpy())
    assert inline([digit] * 4, prepare="mnist") is not None
    assert inline([digit] * 5, prepare="mnist") is None
    assert inline([photo], prepare="mnist") is None and inline([photo]) is not None


def test_a_jpeg_is_sized_past_bytes_between_its_segments() -> None:
    """Decoders skip stray bytes between JPEG segments, so the size check must find the frame
    header past them too (it does so with a search for the next marker, not byte by byte)."""
    from PIL import Image

    from service.common.decode import check_image_bytes, read_header
    from service.common.errors import PayloadTooLarge

    jpeg = _pil_bytes(Image.new("L", (300, 200)), "JPEG")
    padded = jpeg[:2] + b"\0" * 1_000_000 + jpeg[2:]
    assert read_header(padded) == ("jpeg", 300, 200, 1, 1)
    with pytest.raises(PayloadTooLarge, match="300x200 pixels"):
        check_image_bytes(padded, 0, Settings(max_image_pixels=59_999))


def test_a_palette_png_decodes_to_its_colours_not_its_indices(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Found by review (2026-11-29): a palette PNG decoded UNCHANGED gives its palette *indices*
    as gray levels: a black digit on white (indices 1 and 0) read as blank, other palettes as
    wrong digits. Decoded to its colours now, by the server and by the training data path alike:
    the same reading as the grayscale PNG of the same picture, with and without transparency."""
    import io

    from PIL import Image

    from models.data import _read_image, load_bundled_mnist
    from models.prepare import Finding, canonicalise

    digit = load_bundled_mnist()[0][-1]
    page = np.where(np.kron(digit, np.ones((3, 3), np.uint8)) > 127, 0, 255).astype(np.uint8)
    gray = io.BytesIO()
    Image.fromarray(page).save(gray, "PNG")
    expected = canonicalise(decode_one(gray.getvalue(), 0, Settings()))
    assert expected.finding == Finding.ok
    for transparent in (False, True):
        pal = Image.fromarray((page == 0).astype(np.uint8), mode="P")  # index 0 page, 1 ink
        pal.putpalette([255, 255, 255, 0, 0, 0])
        buf = io.BytesIO()
        pal.save(buf, "PNG", **({"transparency": 0} if transparent else {}))  # page see-through
        data = buf.getvalue()
        assert data[25] == 3  # IHDR colour type: palette
        for decoded in (decode_one(data, 0, Settings()), _read_image(_write(tmp_path, data))):
            got = canonicalise(decoded)
            assert got.finding == Finding.ok and torch.equal(got.image, expected.image)


def test_transparency_is_read_from_the_chunks_not_from_any_bytes() -> None:
    """A palette whose colours spell "tRNS" (or "IDAT") is no transparency: the bytes were
    searched, not the chunks walked, and such a PNG was decoded as RGB_ALPHA (garbage)."""
    import io

    from PIL import Image
    from torchvision.io import ImageReadMode

    from models.data import image_read_mode, png_has_alpha

    for colour in (b"tRN", b"IDA"):  # with the next entry's first byte: "tRNS", "IDAT"
        pal = Image.fromarray(np.eye(8, dtype=np.uint8), mode="P")
        pal.putpalette([255, 255, 255, *colour, ord("S") if colour == b"tRN" else ord("T"), 0, 0])
        buf = io.BytesIO()
        pal.save(buf, "PNG")
        data = buf.getvalue()
        assert (b"tRNS" in data or b"IDAT" in data[:60]) and not png_has_alpha(data)
        assert image_read_mode(data) == ImageReadMode.RGB
        buf = io.BytesIO()
        pal.save(buf, "PNG", transparency=0)
        assert png_has_alpha(buf.getvalue())
        assert image_read_mode(buf.getvalue()) == ImageReadMode.RGB_ALPHA


def _write(folder, data: bytes):  # type: ignore[no-untyped-def]
    path = folder / f"{len(list(folder.iterdir()))}.png"
    path.write_bytes(data)
    return path
