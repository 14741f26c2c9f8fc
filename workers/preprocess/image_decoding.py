"""Images a client sent, decoded in the preprocessing processes (never in the front end's
event loop nor beside the model): Pillow with an allow-list of formats and the limits checked before any pixel is decoded. Every failure
is the client's (`InputError`, naming the item), and fails its own request only."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from infinity.shared.protocol import ImageInfo
from workers.preprocess import InputError

# Formats decoded; others (EPS shells out to Ghostscript, for one) are refused unread.
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
MIN_SIDE = 3  # pixels; smaller images are refused, as infinity refuses them


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int


def decode_image(data: bytes, item: str, limits: ImageLimits) -> tuple[Image.Image, ImageInfo]:
    """An RGB image from the bytes of an image file: its first frame, fully decoded, turned
    upright as its EXIF orientation says (as transformers' `load_image` does); and what
    the file was."""
    if len(data) > limits.max_bytes:
        raise InputError(f"{item} is larger than {limits.max_bytes} bytes, the most this server takes of one item")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > limits.max_pixels:
                raise InputError(f"{item} is {width}x{height} pixels, more than the {limits.max_pixels} this "
                                 "server decodes")
            if min(width, height) < MIN_SIDE:
                raise InputError(f"{item} is {width}x{height} pixels, too small: the minimum is "
                                 f"{MIN_SIDE}x{MIN_SIDE}")
            image.load()  # opening reads the header only; a truncated file fails here
            info = ImageInfo(width, height, (image.format or "").lower(), _bit_depth(image))
            return ImageOps.exif_transpose(image).convert("RGB"), info
    except InputError:
        raise
    except UnidentifiedImageError:
        raise InputError(f"{item} is not an image in a format this server reads ({', '.join(FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InputError(f"{item} declares more pixels than this server decodes") from None
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's ways of saying a file is damaged
        raise InputError(f"{item} could not be decoded as an image ({exc})") from None


def _bit_depth(image: Image.Image) -> int:
    """Bits per pixel of the image as stored (a palette image's index, 8)."""
    bands = len(image.getbands())
    per_band = 1 if image.mode == "1" else 16 if image.mode.startswith("I;16") else 32 if image.mode in ("I", "F") else 8
    return bands * per_band
