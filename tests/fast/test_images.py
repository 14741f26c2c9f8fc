"""Decoding client images: every mode and format the tests generate gives what
transformers' `load_image` gives (first frame, EXIF orientation applied, RGB), and every
kind of bad image, data: URI or oversize item is a client error naming the item."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from workers.preprocess.image_decoding import ImageLimits, decode_image
from workers.preprocess.media import data_uri_bytes
from workers.preprocess import InputError

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=40_000_000)


def _image(mode: str, size: tuple[int, int] = (37, 23)) -> Image.Image:
    rng = np.random.default_rng(0)
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65535, size[::-1], dtype=np.uint16))  # mode I;16
    rgba = Image.fromarray(rng.integers(0, 256, (*size[::-1], 4), dtype=np.uint8), "RGBA")
    return rgba.convert(mode) if mode != "P" else rgba.convert("RGB").quantize(16)


def _encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _reference(data: bytes) -> np.ndarray:
    """What transformers' image loading makes of the file."""
    return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))


CASES = [("PNG", mode) for mode in ("RGB", "L", "LA", "P", "RGBA", "I;16")] + [
    ("JPEG", "RGB"), ("JPEG", "L"), ("JPEG", "CMYK"), ("WEBP", "RGB"), ("WEBP", "RGBA"), ("GIF", "P"), ("GIF", "L"),
    ("BMP", "RGB"), ("TIFF", "RGB"), ("TIFF", "CMYK")]


@pytest.mark.parametrize(("fmt", "mode"), CASES)
def test_every_mode_and_format_decodes_as_transformers_loads_it(fmt, mode):
    data = _encoded(_image(mode), fmt)
    decoded, info = decode_image(data, "input[0]", LIMITS)
    assert decoded.mode == "RGB" and decoded.size == (37, 23)
    assert (info.width, info.height, info.format) == (37, 23, fmt.lower())
    np.testing.assert_array_equal(np.asarray(decoded), _reference(data))


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees clockwise
    data = _encoded(_image("RGB"), "JPEG", exif=exif)
    decoded, _ = decode_image(data, "input[0]", LIMITS)
    assert decoded.size == (23, 37)
    np.testing.assert_array_equal(np.asarray(decoded), _reference(data))


def test_an_animation_gives_its_first_frame():
    frames = [_image("RGB").quantize(8), Image.new("P", (37, 23), 3)]
    data = _encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    np.testing.assert_array_equal(np.asarray(decode_image(data, "input[0]", LIMITS)[0]),
                                  np.asarray(frames[0].convert("RGB")))


def _bomb() -> bytes:
    """A 12000x12000 1-bit PNG: a few KB that would decode to 144 megapixels."""
    return _encoded(Image.new("1", (12000, 12000)), "PNG", optimize=True)


@pytest.mark.parametrize(("data", "reason"), [
    (_encoded(Image.new("RGB", (1, 1)), "PNG"), "too small"),
    (_encoded(_image("RGB", (90, 90)), "PNG")[:2000], "could not be decoded"),
    (_encoded(_image("RGB", (90, 90)), "JPEG")[:1000], "could not be decoded"),
    (b"just some text, no image", "not an image in a format"),
    (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not an image in a format"),
    (_encoded(_image("RGB", (400, 400)), "PNG"), "more than the 10000 this server decodes"),
])
def test_bad_images_are_the_clients(data, reason):
    with pytest.raises(InputError, match=reason) as caught:
        decode_image(data, "input[2]", ImageLimits(max_bytes=1 << 20, max_pixels=10_000))
    assert str(caught.value).startswith("input[2]")


def test_a_decompression_bomb_is_refused_before_it_is_decoded():
    data = _bomb()
    assert len(data) < 64 * 1024
    with pytest.raises(InputError, match="input\\[0\\]"):
        decode_image(data, "input[0]", LIMITS)


def test_an_image_over_the_byte_cap_is_refused():
    data = _encoded(_image("RGB", (200, 200)), "PNG")
    with pytest.raises(InputError, match="larger than 1000 bytes"):
        decode_image(data, "input[0]", ImageLimits(max_bytes=1000, max_pixels=40_000_000))


def test_data_uris():
    data = _encoded(_image("RGB"), "PNG")
    payload = base64.b64encode(data).decode()
    assert data_uri_bytes(f"data:image/png;base64,{payload}", "input[0]", 1 << 20) == data
    assert data_uri_bytes(f"data:image/webp;name=a.webp;base64,{payload}", "input[0]", 1 << 20) == data
    for uri, reason in [
        (f"data:text/plain;base64,{payload}", "not image/\\*"),
        (f"data:;base64,{payload}", "of type 'none'"),
        (f"data:image/png,{payload}", "not a base64 data: URI"),
        ("https//example.com/a.png", "not a base64 data: URI"),
        ("data:image/png;base64,iVBOR*w0KGgo=", "base64 is not valid"),
        (f"data:image/png;base64,{payload[:-1]}", "base64 is not valid"),
        (f"data:image/png;base64,{payload}", "more than 100 bytes"),
    ]:
        with pytest.raises(InputError, match=reason):
            data_uri_bytes(uri, "input[0]", 100 if "more than" in reason else 1 << 20)
