"""Image inputs of the image-to-image families: upload names, checks, canonical form.

A request's input images travel as uploads named ``image.0``, ``image.1``, ... (``upload_names``;
the client, ``tilecast generate --image-path`` and ``POST /v1/images/edits`` all write them so).
Rank 0 checks each in ``check_images`` before the request is queued, so every refusal names the
image and the problem and nothing bad reaches the ranks:

- at most ``MAX_IMAGE_BYTES`` per image and ``MAX_IMAGE_PIXELS`` pixels (Pillow's decompression-bomb
  guard at the same bound);
- a format Pillow reads (PNG, JPEG, WebP, BMP, GIF, TIFF, ...); a single frame (an animated GIF /
  WebP / APNG is refused, not silently cut to its first frame);
- 8-bit colour: RGB, RGBA, L, LA or palette. CMYK (print separations: the colours would shift) and
  16-bit / float modes (precision would be cut) are refused with the conversion to make.

Each accepted image is turned upright by its EXIF orientation, converted to RGB (diffusers'
``load_image`` does the same two steps), and re-encoded as PNG into the same upload, so the ranks
decode one known form. Its size (after the EXIF turn) is returned: what the batch key holds. A
family whose model reads transparency (Qwen-Image-Layered decomposes an RGBA image) asks for
``mode="RGBA"``: the alpha channel is kept, and an image without one gets an opaque one.
"""

from __future__ import annotations

import hashlib
import io
import re
from typing import Any

MAX_IMAGE_BYTES = 20 * 2**20
"""Largest encoded input image (20 MiB)."""
MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest input image in pixels (width x height)."""
IMAGE_UPLOAD = "image"
"""The upload field of input images; upload ``image.N`` is the N-th image of a request."""
_ACCEPTED_MODES = {"RGB", "RGBA", "L", "LA", "P", "PA", "1"}
_UPLOAD_NAME = re.compile(r"image\.(\d+)")


def upload_names(count: int) -> list[str]:
    """The upload names of ``count`` input images, in order."""
    return [f"{IMAGE_UPLOAD}.{index}" for index in range(count)]


def image_uploads(uploads: dict[str, Any]) -> list[str]:
    """The names of the input images among ``uploads``, in order (``ValueError`` if numbering has gaps)."""
    indices = sorted(int(m.group(1)) for name in uploads if (m := _UPLOAD_NAME.fullmatch(name)))
    if indices != list(range(len(indices))):
        raise ValueError(f"image uploads must be numbered image.0, image.1, ...; got indices {indices}")
    return upload_names(len(indices))


def _describe(index: int, count: int) -> str:
    return "image" if count == 1 else f"image {index + 1} of {count}"


def decode_image(data: bytes, label: str = "image", mode: str = "RGB"):
    """Decode and check one input image; returns an upright ``PIL.Image`` in ``mode`` (``RGB`` or
    ``RGBA``; see the module docstring)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise ValueError(f"{label} is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{label} is {len(data) / 2**20:.1f} MiB; at most {MAX_IMAGE_BYTES / 2**20:g} MiB per image")
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ValueError(
                f"{label} is {width}x{height} = {width * height} pixels; at most {MAX_IMAGE_PIXELS} (4096x4096)"
            )
        if getattr(image, "n_frames", 1) > 1:
            raise ValueError(
                f"{label} is animated ({image.format}, {image.n_frames} frames); send a single still image"
            )
        if image.mode == "CMYK":
            raise ValueError(f"{label} is a CMYK {image.format}; convert it to RGB first")
        if image.mode not in _ACCEPTED_MODES:
            raise ValueError(
                f"{label} has mode {image.mode} ({image.format}: 16-bit or float samples); "
                "send 8-bit RGB, RGBA or grayscale"
            )
        image.load()  # decodes: a truncated or corrupt file fails here
    except ValueError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError) as exc:
        reason = "not an image format Pillow reads" if isinstance(exc, UnidentifiedImageError) else str(exc)
        raise ValueError(f"{label} cannot be decoded: {reason}") from None
    return ImageOps.exif_transpose(image).convert(mode)


def check_images(
    uploads: dict[str, bytes], *, family: str, min_images: int, max_images: int, mode: str = "RGB"
) -> list[list[int]]:
    """Rank 0: check the request's input images (``uploads``, changed in place to canonical PNGs in
    ``mode``); returns their ``[width, height]`` sizes. ``ValueError`` naming the image and the problem."""
    names = image_uploads(uploads)
    if len(names) < min_images:
        needed = "an input image" if min_images == 1 else f"at least {min_images} input images"
        raise ValueError(
            f"image: {family} needs {needed} (image=... on the client, --image-path, "
            "or the image part of /v1/images/edits)"
        )
    if len(names) > max_images:
        taken = "takes no input image" if max_images == 0 else f"takes at most {max_images} input image(s)"
        raise ValueError(f"image: {family} {taken}; got {len(names)}")
    sizes = []
    for index, name in enumerate(names):
        image = decode_image(uploads[name], _describe(index, len(names)), mode)
        uploads[name] = png_bytes(image)
        sizes.append(list(image.size))
    return sizes


def digest(data: bytes) -> str:
    """A canonical image's SHA-256 (hex): equal digests, equal input pixels."""
    return hashlib.sha256(data).hexdigest()


def png_bytes(image) -> bytes:
    """A PIL image as PNG (fast zlib level: these are rank-to-rank copies, not archives)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def example_image(width: int = 48, height: int = 32) -> bytes:
    """A deterministic RGB gradient PNG (the health check's and the tests' input image)."""
    from PIL import Image

    image = Image.new("RGB", (width, height))
    image.putdata(
        [
            (x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), 128)
            for y in range(height)
            for x in range(width)
        ]
    )
    return png_bytes(image)


def load_images(uploads: dict[str, bytes], mode: str = "RGB") -> list:
    """On a rank: the request's checked input images as ``PIL.Image`` objects in ``mode``, in order."""
    from PIL import Image

    return [Image.open(io.BytesIO(uploads[name])).convert(mode) for name in image_uploads(uploads)]
