"""The Qwen image-edit families: Qwen-Image-Edit (``tiny/qwen-image-edit``) and Qwen-Image-Edit-2509 /
2511 and FireRed-Image-Edit 1.0 / 1.1 (``tiny/qwen-image-edit-2511``, ``QwenImageEditPlusPipeline``).

Routing, the request rules (defaults, output size, refusals, batch keys) and the torchvision refusal
run everywhere: they need no weights. What loads a checkpoint needs torchvision (a ``Qwen2VLProcessor``
loads only with it under transformers 5) and skips without it (``tests.harness.TORCHVISION_REASON``):
merged Edit batches against singletons, the vision tower's part, Edit Plus' multi-image calls and why
it is served singleton, and serving through the ZeroMQ client, HTTP and the ``openai`` SDK.

Cost (one CPU thread): every input image is encoded by the VAE at about 1024 x 1024 pixels whatever
the output size (diffusers' rule), ~2.5-4 s per image on the tiny VAE; everything else here is small
(32 x 32 outputs, two steps).
"""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import torch
from PIL import Image

from tests.harness import (
    DYNAMIC_BATCHING,
    http_server_config,
    in_process_server,
    make_context,
    skip_without_required_modules,
)
from tilecast.client import Client
from tilecast.runtime.config import UnsupportedSettingError
from tilecast.runtime.models.families import images
from tilecast.runtime.models.families.common import I2IParams
from tilecast.runtime.models.families.qwen_image_edit import (
    QwenImageEditI2IPipeline as Edit,
)
from tilecast.runtime.models.families.qwen_image_edit import (
    QwenImageEditPlusI2IPipeline as EditPlus,
)
from tilecast.runtime.models.families.qwen_image_edit import (
    calculate_dimensions,
)
from tilecast.runtime.pipeline import WorkItem
from tilecast.runtime.registry import diffusers_classes, resolve_pipeline

pytestmark = pytest.mark.timeout(600)

BATCH_TOL = 1e-4
"""Max abs difference between a request's merged and singleton fp32 output (measured ~8e-7)."""
SMALL = dict(width=32, height=32, num_inference_steps=2)
"""A request's output size and steps (one step gives NaN: Qwen-Image's shift_terminal schedule divides 0 by 0
with a single sigma); the input image's 1024 x 1024 VAE copy is the cost."""


def png(width: int = 48, height: int = 32, seed: int = 0) -> bytes:
    """A deterministic test picture: a colour gradient, ``seed`` in the blue channel, a white square."""
    image = Image.new("RGB", (width, height))
    blue = (seed * 67) % 256
    image.putdata(
        [
            (x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), blue)
            for y in range(height)
            for x in range(width)
        ]
    )
    image.paste((255, 255, 255), (width // 4, height // 4, width // 2, height // 2))
    return images.png_bytes(image)


def uploads(*pictures: bytes) -> dict[str, bytes]:
    return dict(zip(images.upload_names(len(pictures)), pictures))


def bare(cls, tmp_path):
    """A family instance without weights: what rank 0 runs before queueing (``prepare``, ``batch_key``)."""
    pipe = SimpleNamespace(transformer=SimpleNamespace(dtype=torch.float32), scheduler=SimpleNamespace(config={}))
    return cls(pipe, make_context(tmp_path))


# ---- routing (no weights, no torchvision) -----------------------------------------------------


@pytest.mark.parametrize(
    ("model_id", "cls"),
    [
        ("Qwen/Qwen-Image-Edit", Edit),
        ("Qwen/Qwen-Image-Edit-2509", EditPlus),
        ("Qwen/Qwen-Image-Edit-2511", EditPlus),
        ("FireRedTeam/FireRed-Image-Edit-1.0", EditPlus),
        ("FireRedTeam/FireRed-Image-Edit-1.1", EditPlus),
    ],
)
def test_released_ids_route_to_their_family(model_id, cls, tmp_path):
    assert resolve_pipeline(str(tmp_path), model_id=model_id) is cls
    renamed = tmp_path / model_id.rpartition("/")[2]  # a directory of another pipeline class, named as released
    renamed.mkdir()
    (renamed / "model_index.json").write_text(json.dumps({"_class_name": "SomeRenamedPipeline"}))
    assert resolve_pipeline(str(renamed)) is cls


def test_builtin_names_and_diffusers_classes_route_without_torchvision():
    assert resolve_pipeline("tiny/qwen-image-edit") is Edit
    assert resolve_pipeline("tiny/qwen-image-edit-2511") is EditPlus
    served = diffusers_classes()
    assert served["QwenImageEditPipeline"] == (Edit,) and served["QwenImageEditPlusPipeline"] == (EditPlus,)
    # Where torchvision is installed, a fresh interpreter that cannot import it still routes every
    # model (these families included) and refuses to load an edit checkpoint naming it. (Without
    # torchvision, which is CI, the in-process tests here show the same.)
    skip_without_required_modules(Edit)
    code = (
        "import sys\n"
        "sys.modules['torchvision'] = None  # import torchvision fails; find_spec says it is absent\n"
        "from tilecast.runtime.registry import pipelines, resolve_pipeline\n"
        "from tilecast.runtime.models.families.qwen_image_edit import QwenImageEditI2IPipeline as Edit\n"
        "assert len(pipelines()) > 5 and resolve_pipeline('tiny/qwen-image-edit') is Edit\n"
        "assert list(Edit.missing_modules()) == ['torchvision']\n"
        "from tilecast.runtime.registry import ensure_builtin_checkpoint\n"
        "try:\n"
        "    ensure_builtin_checkpoint('tiny/qwen-image-edit')\n"
        "except ValueError as exc:\n"
        "    assert 'qwen-image-edit needs torchvision' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('built without torchvision')\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=120)


def test_load_without_torchvision_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(Edit, "missing_modules", classmethod(lambda cls: {"torchvision": "ModuleNotFoundError: x"}))
    ctx = make_context(tmp_path, cache_dir=tmp_path)
    with pytest.raises(UnsupportedSettingError, match=r"qwen-image-edit needs torchvision \(torchvision: Module"):
        Edit.load("tiny/qwen-image-edit", ctx)
    with pytest.raises(UnsupportedSettingError, match="needs torchvision"):
        Edit.ensure_builtin(tmp_path)
    assert not (tmp_path / "models").exists()  # refused before anything was built


# ---- requests: defaults, sizes, refusals, batch keys (no weights) ------------------------------


def test_defaults_follow_the_model_cards(tmp_path):
    """Qwen-Image-Edit: 50 steps; Edit-2509 / 2511 and FireRed: 40 steps (FireRed's inference.py);
    all true_cfg_scale 4.0 with negative_prompt " "."""
    for cls, steps in ((Edit, 50), (EditPlus, 40)):
        pipe = bare(cls, tmp_path)
        p = pipe.prepare(I2IParams(prompt="x"), uploads(png()))
        assert (p.num_inference_steps, p.guidance_scale) == (steps, 4.0), cls
        kwargs = pipe.call_kwargs(p)
        assert kwargs["true_cfg_scale"] == 4.0 and kwargs["guidance_scale"] is None
        assert "max_sequence_length" not in kwargs  # the edit pipelines read none (refused below)
        assert pipe.negative_prompts([WorkItem(job_id="j", params=p)]) == {"negative_prompt": [" "]}
        assert (pipe.task, pipe.upload_fields, pipe.min_images) == ("i2i", ("image",), 1)
    assert (Edit.max_images, EditPlus.max_images, Edit.max_batch_size, EditPlus.max_batch_size) == (1, 3, 16, 1)


def test_output_size_is_diffusers_rule(tmp_path):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions as edit_rule
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions as plus_rule

    for width, height in ((48, 32), (1000, 1000), (640, 1920), (4096, 256), (33, 97)):
        ours = calculate_dimensions(1024 * 1024, width / height)
        assert ours == edit_rule(1024 * 1024, width / height)[:2] == plus_rule(1024 * 1024, width / height)
    edit, plus = bare(Edit, tmp_path), bare(EditPlus, tmp_path)
    p = edit.prepare(I2IParams(prompt="x"), uploads(png(48, 32)))
    assert (p.width, p.height, p.image_sizes) == (1248, 832, [[48, 32]])  # the first image's aspect ratio
    p = plus.prepare(I2IParams(prompt="x"), uploads(png(48, 32), png(32, 64)))
    assert (p.width, p.height) == (736, 1440)  # Edit Plus: the last image's
    p = edit.prepare(I2IParams(prompt="x", width=64), uploads(png(48, 32)))
    assert (p.width, p.height) == (64, 832)  # a side the request sets is kept (diffusers: height or computed)


@pytest.mark.parametrize(
    ("cls", "fields", "pictures", "message"),
    [
        (Edit, {}, (), "image: qwen-image-edit needs an input image"),
        (Edit, {}, (png(), png()), "image: qwen-image-edit takes at most 1 input image(s); got 2"),
        (EditPlus, {}, (png(),) * 4, "image: qwen-image-edit-plus takes at most 3 input image(s); got 4"),
        (Edit, {}, (b"\x89PNG\r\n\x1a\nbroken",), "image cannot be decoded"),
        (Edit, {}, (png(4000, 64),), "image: qwen-image-edit resizes a 4000x64 input to 8096x128 pixels"),
        (EditPlus, {}, (png(), png(64, 4000)), "image 2 of 2: qwen-image-edit-plus resizes a 64x4000 input"),
        (Edit, {"max_sequence_length": 64}, (png(),), "max_sequence_length cannot be used by qwen-image-edit"),
        (Edit, {"guidance_scale": 1.0, "negative_prompt": "x"}, (png(),), "negative_prompt cannot be used by"),
        (Edit, {"width": 40}, (png(),), "width must be a multiple of 16"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(cls, fields, pictures, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        bare(cls, tmp_path).prepare(I2IParams(prompt="x", **fields), uploads(*pictures))


def test_edit_requests_merge_only_with_images_of_the_same_size(tmp_path):
    pipe = bare(Edit, tmp_path)

    def key(picture: bytes, **fields):
        return pipe.batch_key(pipe.prepare(I2IParams(prompt="p", **SMALL, **fields), uploads(picture)))

    assert key(png(48, 32, seed=1)) == key(png(48, 32, seed=2), seed=9)  # other pixels: one diffusers call
    assert key(png(48, 32)) != key(png(32, 48))  # diffusers sizes a whole call from its first image
    assert key(png(48, 32)) != key(png(96, 64))  # same aspect ratio, other size: kept apart (resized alike)


# ---- on the tiny checkpoints (torchvision) --------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tiny_cache, tmp_path_factory):
    """cls -> (pipeline, ctx), loaded once per module; skips where torchvision is missing."""
    cache: dict = {}

    def get(cls):
        skip_without_required_modules(cls)
        if cls not in cache:
            ctx = make_context(tmp_path_factory.mktemp(cls.family), dtype="float32")
            cache[cls] = (cls.load(cls.builtin_name, ctx), ctx)
        return cache[cls]

    return get


def _item(pipe, job_id: str, prompt: str, seed: int, *pictures: bytes, **fields) -> WorkItem:
    files = uploads(*pictures)
    params = pipe.prepare(I2IParams(prompt=prompt, seed=seed, return_tensor=True, **{**SMALL, **fields}), files)
    return WorkItem(job_id=job_id, params=params, uploads=files)


def test_edit_merged_batch_pairs_each_image_with_its_prompt(loaded):
    """Two requests with different images (same size) in one ``QwenImageEditPipeline`` call: each
    output equals the request's singleton, so image i went with prompt i."""
    pipe, ctx = loaded(Edit)
    a = _item(pipe, "a", "make it red", 1, png(seed=1))
    b = _item(pipe, "b", "a much longer instruction: paint the square blue", 2, png(seed=2))
    assert pipe.batch_key(a.params) == pipe.batch_key(b.params)
    merged = pipe.run([a, b], ctx)
    assert [out.info["batch_size"] for out in merged] == [2, 2]
    for item, out in zip((a, b), merged):
        alone = pipe.run([item], ctx)[0].tensors["image"]
        diff = (out.tensors["image"] - alone).abs().max().item()
        assert diff <= BATCH_TOL, f"{item.job_id}: merged differs from its singleton by {diff:.3g}"
    assert (merged[0].tensors["image"] - merged[1].tensors["image"]).abs().max() > 0.01


def test_the_vision_tower_reads_the_input_image(loaded):
    """The prompt embedding depends on the input image (its tokens replace ``<|image_pad|>``), not
    only the VAE latents: the tiny text encoder runs Qwen2.5-VL's vision path."""
    pipe, _ = loaded(Edit)
    diffusers_pipe = pipe.pipe
    first, second = (Image.open(io.BytesIO(png(seed=seed))).convert("RGB") for seed in (1, 2))
    with torch.inference_mode():
        embeds = [diffusers_pipe.encode_prompt(prompt="make it red", image=[im])[0] for im in (first, second)]
        inputs = diffusers_pipe.processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[first])
    assert embeds[0].shape == embeds[1].shape and (embeds[0] - embeds[1]).abs().max() > 1e-3
    pad = diffusers_pipe.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert 1 < inputs["input_ids"][0].count(pad) <= 4  # a few merged patches (max_pixels 56 x 56)


def test_edit_plus_uses_every_input_image_and_is_served_singleton(loaded):
    """Picture 1 and Picture 2 both shape the output; diffusers refuses a second prompt in one call,
    which is why the family serves one request per call (``max_batch_size = 1``)."""
    pipe, ctx = loaded(EditPlus)
    one = pipe.run([_item(pipe, "one", "combine them", 3, png(seed=1))], ctx)[0].tensors["image"]
    two = pipe.run([_item(pipe, "two", "combine them", 3, png(seed=1), png(32, 32, seed=5))], ctx)[0]
    assert tuple(two.tensors["image"].shape) == (3, 32, 32) and two.info["batch_size"] == 1
    assert (one - two.tensors["image"]).abs().max() > 1e-3
    items = [_item(pipe, name, name, seed, png(seed=1)) for name, seed in (("a", 1), ("b", 2))]
    assert pipe.batch_key(items[0].params) == pipe.batch_key(items[1].params)  # only the batch size keeps them apart
    picture = images.load_images(items[0].uploads)
    with pytest.raises(ValueError, match="only supports batch_size=1"), torch.inference_mode():
        pipe.pipe(image=picture, prompt=["a", "b"], negative_prompt=[" ", " "], true_cfg_scale=4.0, **SMALL)


# ---- served (torchvision) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def edit_server(tiny_cache, tmp_path_factory):
    """An in-process ``tiny/qwen-image-edit`` server with dynamic batching and the HTTP front end."""
    skip_without_required_modules(Edit)
    config = http_server_config(
        "tiny/qwen-image-edit", tmp_path_factory.mktemp("out"), **DYNAMIC_BATCHING, enable_batching_metrics=True
    )
    with in_process_server(config) as server:
        yield server


def test_served_through_the_client_merges_edits_of_same_size_images(edit_server):
    with Client(edit_server.endpoint, timeout=180.0) as client:
        requests = [dict(prompt=f"edit {i}", seed=i, image=png(seed=i), return_tensor=True, **SMALL) for i in (1, 2)]
        with ThreadPoolExecutor(max_workers=2) as pool:
            pair = [f.result() for f in [pool.submit(client.generate, timeout=180.0, **r) for r in requests]]
        alone = client.generate(timeout=180.0, **requests[1])
    assert [r.info["batch_size"] for r in pair] == [2, 2] and alone.info["batch_size"] == 1
    for result in (*pair, alone):
        assert result.job.state == "completed" and result.files[0].mime == "image/png"
        assert Image.open(io.BytesIO(result.files[0].data)).size == (32, 32)
    assert (pair[1].tensor("image") - alone.tensor("image")).abs().max().item() <= BATCH_TOL


def test_openai_sdk_images_edit(edit_server):
    import openai

    sdk = openai.OpenAI(base_url=f"{edit_server.http_url}/v1", api_key="unused", max_retries=0, timeout=180)
    edited = sdk.images.edit(
        image=("in.png", png(seed=3), "image/png"),
        prompt="turn the square red",
        size="32x32",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 4},
    )
    picture = Image.open(io.BytesIO(base64.b64decode(edited.data[0].b64_json)))
    assert picture.size == (32, 32) and picture.format == "PNG"


def _good_edit(url: str) -> None:
    reply = httpx.post(
        f"{url}/v1/images/edits",
        files={"image": ("in.png", png(), "image/png")},
        data={"prompt": "ok", "size": "32x32", "num_inference_steps": "2", "response_format": "b64_json"},
        timeout=180,
    )
    assert reply.status_code == 200, reply.text
    assert base64.b64decode(reply.json()["data"][0]["b64_json"]).startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("files", "status", "message"),
    [
        ({}, 400, "image is required"),
        ([("image[]", ("a.png", png(), "image/png")), ("image[]", ("b.png", png(), "image/png"))], 400, "at most 1"),
        ({"image": ("big.png", b"\x89PNG" + b"\0" * (images.MAX_IMAGE_BYTES + 1), "image/png")}, 413, "20 MiB"),
        ({"image": ("bad.png", png()[:60], "image/png")}, 400, "image cannot be decoded"),
    ],
    ids=["missing-image", "two-images", "over-20-MiB", "corrupt-png"],
)
def test_edits_multipart_errors_then_a_good_request(edit_server, files, status, message):
    url = edit_server.http_url
    data = {"prompt": "p", "size": "32x32", "num_inference_steps": "2"}
    if not files:  # a multipart form with no file part at all
        files = {"note": (None, "no image here")}
    reply = httpx.post(f"{url}/v1/images/edits", files=files, data=data, timeout=180)
    assert reply.status_code == status, reply.text
    assert message in reply.json()["error"]["message"], reply.text
    _good_edit(url)  # the server goes on serving
