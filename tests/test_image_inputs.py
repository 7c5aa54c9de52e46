"""Input images of the image-to-image families: rank 0's checks (``families.images``) and the
client's upload of ``image=``, with no model loaded.

Each refusal names the image and the problem; an accepted image comes out upright (EXIF), RGB and
re-encoded as PNG, with its size for the batch key.
"""

from __future__ import annotations

import io

import pytest
from PIL import Image

from tilecast.runtime.models.families import images
from tilecast.scheduler.client import _split_uploads


def encoded(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def rgb(width: int = 40, height: int = 24) -> Image.Image:
    image = Image.new("RGB", (width, height), (200, 30, 30))
    image.paste((0, 255, 0), (0, 0, 8, 8))  # a marker in the top-left corner
    return image


def test_an_accepted_image_becomes_an_rgb_png_with_its_size():
    uploads = {"image.0": encoded(rgb(), "JPEG"), "image.1": encoded(Image.new("RGBA", (16, 32), (1, 2, 3, 4)))}
    sizes = images.check_images(uploads, family="f", min_images=1, max_images=2)
    assert sizes == [[40, 24], [16, 32]]
    decoded = images.load_images(uploads)
    assert [im.mode for im in decoded] == ["RGB", "RGB"]
    assert [Image.open(io.BytesIO(uploads[name])).format for name in ("image.0", "image.1")] == ["PNG", "PNG"]
    assert decoded[1].getpixel((0, 0)) == (1, 2, 3)  # alpha dropped, as diffusers' load_image does


def test_exif_orientation_is_honoured():
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    uploads = {"image.0": encoded(rgb(40, 24), "JPEG", exif=exif, quality=100)}
    assert images.check_images(uploads, family="f", min_images=1, max_images=1) == [[24, 40]]
    upright = images.load_images(uploads)[0]
    r, g, b = upright.getpixel((20, 3))  # the top-left marker, turned to the top-right corner
    assert g > 150 and r < 100


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (encoded(Image.new("CMYK", (8, 8)), "JPEG"), "image is a CMYK JPEG; convert it to RGB first"),
        (encoded(Image.new("I;16", (8, 8))), "image has mode I;16 (PNG: 16-bit or float samples)"),
        (
            encoded(rgb(8, 8), "GIF", save_all=True, append_images=[Image.new("RGB", (8, 8))]),
            "image is animated (GIF, 2 frames)",
        ),
        (encoded(rgb())[:60], "image cannot be decoded"),
        (b"not an image at all", "image cannot be decoded: not an image format Pillow reads"),
        (b"", "image is empty"),
        (b"\0" * (images.MAX_IMAGE_BYTES + 1), "image is 20.0 MiB; at most 20 MiB per image"),
        (encoded(Image.new("L", (5000, 4000))), "image is 5000x4000 = 20000000 pixels"),
    ],
    ids=["cmyk", "16-bit", "animated", "truncated", "not-an-image", "empty", "too-many-bytes", "too-many-pixels"],
)
def test_a_bad_image_is_refused_naming_the_problem(data, message):
    with pytest.raises(ValueError) as info:
        images.check_images({"image.0": data}, family="f", min_images=1, max_images=1)
    assert message in str(info.value)


def test_image_counts_and_numbering_are_checked():
    one = encoded(rgb())
    with pytest.raises(ValueError, match="image: f needs an input image"):
        images.check_images({}, family="f", min_images=1, max_images=1)
    with pytest.raises(ValueError, match=r"image: f takes at most 1 input image\(s\); got 2"):
        images.check_images({"image.0": one, "image.1": one}, family="f", min_images=1, max_images=1)
    with pytest.raises(ValueError, match="image: f takes no input image; got 1"):
        images.check_images({"image.0": one}, family="f", min_images=0, max_images=0)
    with pytest.raises(ValueError, match="numbered image.0, image.1"):
        images.check_images({"image.1": one}, family="f", min_images=0, max_images=2)
    with pytest.raises(ValueError, match="image 2 of 2 cannot be decoded"):
        images.check_images({"image.0": one, "image.1": b"junk"}, family="f", min_images=1, max_images=2)
    assert images.check_images({"video": b"x"}, family="f", min_images=0, max_images=0) == []


def test_the_client_uploads_paths_bytes_and_pil_images_in_order(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(encoded(rgb(8, 8)))
    params, names, payloads = _split_uploads({"prompt": "p", "image": [path, str(path), b"raw", rgb(4, 4)]})
    assert params == {"prompt": "p"} and names == ["image.0", "image.1", "image.2", "image.3"]
    assert payloads[0] == payloads[1] == path.read_bytes() and payloads[2] == b"raw"
    assert Image.open(io.BytesIO(payloads[3])).size == (4, 4)
    assert _split_uploads({"image": b"one"})[1] == ["image.0"]
    with pytest.raises(TypeError, match="image must be bytes, a local path or a PIL image"):
        _split_uploads({"image": 3})
