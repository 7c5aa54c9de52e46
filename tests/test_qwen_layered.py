"""Qwen-Image-Layered (``tiny/qwen-image-layered``, ``QwenImageLayeredPipeline``): one RGBA image in,
``layers`` RGBA images out.

Routing, the request rules (defaults, size rule, refusals, batch keys) and the RGBA input need no
weights. Runs: ``layers`` RGBA PNG files whose alpha depends on the input's, and serving through the
ZeroMQ client and ``POST /v1/images/edits`` (``n`` jobs x ``layers`` data items). The family needs no
torchvision (no captioning processor), so nothing here skips.

Cost (one CPU thread): the output is about 640 x 640 pixels whatever the input (diffusers' buckets are
640 and 1024), so each run VAE-encodes the input and decodes every layer at 768 x 512 (the 48 x 32
test pictures), ~3 s a two-layer run on the tiny (``base_dim`` 4) VAE; runs use 2..3 layers and two steps.
"""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.harness import DYNAMIC_BATCHING, http_server_config, in_process_server, make_context, run_generate
from tilecast.client import Client
from tilecast.runtime.models.families import images
from tilecast.runtime.models.families.qwen_image_edit import QwenImageEditI2IPipeline as Edit
from tilecast.runtime.models.families.qwen_image_layered import LayeredParams
from tilecast.runtime.models.families.qwen_image_layered import QwenImageLayeredI2IPipeline as Layered
from tilecast.runtime.pipeline import WorkItem
from tilecast.runtime.registry import diffusers_classes, resolve_pipeline

pytestmark = pytest.mark.timeout(600)

BATCH_TOL = 1e-4
"""Max abs difference between a request's merged and singleton fp32 output (measured ~1e-5)."""
OUT_SIZE = (768, 512)
"""diffusers' output size for a 48 x 32 input at resolution 640: about 640 x 640 pixels at 3:2."""


def rgba_png(width: int = 48, height: int = 32, alpha: int | None = None) -> bytes:
    """A deterministic RGBA picture: a colour gradient; alpha a vertical ramp (or ``alpha`` everywhere)."""
    image = Image.new("RGBA", (width, height))
    image.putdata(
        [
            (x * 255 // (width - 1), y * 255 // (height - 1), 128, y * 255 // (height - 1) if alpha is None else alpha)
            for y in range(height)
            for x in range(width)
        ]
    )
    return images.png_bytes(image)


def bare(cls, tmp_path):
    """A family instance without weights: what rank 0 runs before queueing (``prepare``, ``batch_key``)."""
    pipe = SimpleNamespace(transformer=SimpleNamespace(dtype=torch.float32), scheduler=SimpleNamespace(config={}))
    return cls(pipe, make_context(tmp_path))


def request(pipe, picture: bytes | None = None, **fields):
    """A prepared request (two steps unless ``fields`` say otherwise) and its checked uploads."""
    uploads = {"image.0": picture or rgba_png()}
    fields.setdefault("num_inference_steps", 2)
    return pipe.prepare(LayeredParams(prompt=fields.pop("prompt", "a layered picture"), **fields), uploads), uploads


# ---- routing and request rules (no weights) --------------------------------------------------


def test_released_ids_and_the_class_route_to_the_family(tmp_path):
    assert resolve_pipeline("tiny/qwen-image-layered") is Layered
    assert diffusers_classes()["QwenImageLayeredPipeline"] == (Layered,)
    assert resolve_pipeline(str(tmp_path), model_id="Qwen/Qwen-Image-Layered") is Layered
    renamed = tmp_path / "Qwen-Image-Layered"  # a class diffusers does not know, the released name
    renamed.mkdir()
    (renamed / "model_index.json").write_text(json.dumps({"_class_name": "SomeRenamedPipeline"}))
    assert resolve_pipeline(str(renamed)) is Layered
    export = tmp_path / "my-export"  # any name: the class decides
    export.mkdir()
    (export / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageLayeredPipeline"}))
    assert resolve_pipeline(str(export)) is Layered
    assert Layered.required_modules == () and Layered.own_components(tmp_path) == {"processor": None}


def test_defaults_follow_the_released_example_and_the_size_is_diffusers_rule(tmp_path):
    pipe = bare(Layered, tmp_path)
    params, _ = request(pipe, num_inference_steps=None)
    assert (params.num_inference_steps, params.guidance_scale, params.layers, params.resolution) == (50, 4.0, 4, 640)
    assert (params.width, params.height) == OUT_SIZE and pipe.guidance_on(params) and not params.cfg_normalize
    kwargs = pipe.call_kwargs(params)
    assert {k: kwargs[k] for k in ("layers", "resolution", "cfg_normalize", "true_cfg_scale")} == {
        "layers": 4,
        "resolution": 640,
        "cfg_normalize": False,
        "true_cfg_scale": 4.0,
    }
    assert "width" not in kwargs and "height" not in kwargs  # diffusers takes no size here
    item = WorkItem(job_id="j", params=params, uploads={"image.0": rgba_png()})
    assert pipe.call_args([item])["negative_prompt"] == [" "]  # Qwen-Image's: guidance runs as the example asks
    big, _ = request(pipe, rgba_png(32, 32), resolution=1024)
    assert (big.width, big.height) == (1024, 1024)


def test_rgba_input_keeps_its_alpha_and_other_families_still_get_rgb(tmp_path):
    picture = rgba_png()
    alpha = Image.open(io.BytesIO(picture)).getchannel("A")
    pipe = bare(Layered, tmp_path)
    params, uploads = request(pipe, picture)
    canonical = Image.open(io.BytesIO(uploads["image.0"]))
    assert canonical.mode == "RGBA" and list(canonical.getchannel("A").getdata()) == list(alpha.getdata())
    (given,) = pipe.image_kwargs([WorkItem(job_id="j", params=params, uploads=uploads)])["image"]
    assert given.mode == "RGBA" and list(given.getchannel("A").getdata()) == list(alpha.getdata())
    _, rgb_uploads = request(pipe, images.example_image())  # no alpha: an opaque one, as the card's convert("RGBA")
    assert set(Image.open(io.BytesIO(rgb_uploads["image.0"])).getchannel("A").getdata()) == {255}
    edit_uploads = {"image.0": picture}  # an RGB family: composited as before, no alpha
    bare(Edit, tmp_path).prepare(Edit.params_type(prompt="x", width=32, height=32), edit_uploads)
    assert Image.open(io.BytesIO(edit_uploads["image.0"])).mode == "RGB"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layers": 0}, "layers must be in 1..10"),
        ({"layers": 11}, "layers must be in 1..10"),
        ({"resolution": 512}, "resolution must be one of 640, 1024"),
        ({"width": 64}, "width cannot be set for qwen-image-layered"),
        ({"height": 64}, "height cannot be set for qwen-image-layered"),
        ({"output_format": "jpeg"}, "output_format 'jpeg' cannot hold the layers' alpha channel"),
        ({"cfg_normalize": True, "guidance_scale": 1.0}, "cfg_normalize needs guidance"),
        ({"max_sequence_length": 2000}, "max_sequence_length must be in 1..1024"),
        ({"prompt": " "}, "prompt must not be empty"),  # diffusers would caption it: not served (no processor)
    ],
)
def test_bad_requests_are_refused_naming_the_field(fields, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        request(bare(Layered, tmp_path), **fields)


def test_requests_merge_only_with_the_same_layers_resolution_and_image_size(tmp_path):
    pipe = bare(Layered, tmp_path)
    key = pipe.batch_key(request(pipe, seed=1)[0])
    assert pipe.batch_key(request(pipe, seed=2, prompt="another")[0]) == key
    assert pipe.batch_key(request(pipe, rgba_png(alpha=0), seed=2)[0]) == key  # other pixels, same size: merge
    for other in (dict(layers=3), dict(resolution=1024), dict(cfg_normalize=True)):
        assert pipe.batch_key(request(pipe, **other)[0]) != key, other
    assert pipe.batch_key(request(pipe, rgba_png(32, 48))[0]) != key


# ---- runs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tiny_cache, tmp_path_factory):
    ctx = make_context(tmp_path_factory.mktemp("layered"), dtype="float32")
    return Layered.load("tiny/qwen-image-layered", ctx), ctx


def test_n_layers_are_n_rgba_png_files_and_alpha_reaches_the_model(loaded):
    pipe, ctx = loaded
    ramp, _ = request(pipe, layers=3, seed=3, return_tensor=True, output_file_name="mine.png")
    clear, _ = request(pipe, rgba_png(alpha=0), layers=3, seed=3, return_tensor=True)
    encoded = []  # what the VAE encodes: the input images, 1 x 4 x 1 x H x W in [-1, 1] each
    encode = pipe.pipe.vae.encode
    pipe.pipe.vae.encode = lambda x, *a, **k: encoded.append(x.clone()) or encode(x, *a, **k)
    given = []  # diffusers' per-prompt layer stacks, before output_rows re-cuts them
    rows = pipe.output_rows
    pipe.output_rows = lambda output, size: given.append([len(stack) for stack in output]) or rows(output, size)
    try:
        out = pipe.run(
            [
                WorkItem(job_id="ramp", params=ramp, uploads={"image.0": rgba_png()}),
                WorkItem(job_id="clear", params=clear, uploads={"image.0": rgba_png(alpha=0)}),
            ],
            ctx,
        )
    finally:
        del pipe.pipe.vae.encode, pipe.output_rows  # back to the classes' methods
    pixels = torch.cat(encoded)  # one encode per request (a generator each)
    assert pixels.shape[:2] == (2, 4)  # RGBA reaches the VAE: its ramp in the first, fully clear in the second
    alpha_rows = pixels[0, 3, 0].mean(dim=1)
    assert alpha_rows[0] < -0.9 and alpha_rows[-1] > 0.9 and bool((pixels[1, 3] == -1).all())
    # diffusers 0.42 cuts the 2 x 3 decoded layers per prompt in steps of layers + 1 = 4: [4, 2], not
    # [3, 3] (why ``output_rows`` joins and re-cuts them; a fixed diffusers would give [3, 3])
    assert given == [[4, 2]]
    first = out[0]
    assert first.info["layers"] == 3 and first.info["batch_size"] == 2
    assert [f.name for f in first.files] == ["mine_layer0.png", "mine_layer1.png", "mine_layer2.png"]
    assert [f.name for f in out[1].files] == [f"qwen-image-layered_seed3_layer{i}.png" for i in range(3)]
    stack = first.tensors["image"]
    assert tuple(stack.shape) == (3, 4, OUT_SIZE[1], OUT_SIZE[0]) and torch.isfinite(stack).all()
    for index, written in enumerate(first.files):
        picture = Image.open(written.path)
        assert written.mime == "image/png" and picture.mode == "RGBA" and picture.size == OUT_SIZE
        expected = (stack[index].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)
        assert torch.equal(torch.from_numpy(np.array(picture)), expected)
    # the same colours with another alpha give other layers (the random tiny weights, two steps, move
    # the output ~6e-4: above the merged-batch noise, ~1e-5)
    assert (stack - out[1].tensors["image"]).abs().max() > BATCH_TOL


# ---- served -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layered_server(tiny_cache, tmp_path_factory):
    """An in-process ``tiny/qwen-image-layered`` server with dynamic batching and the HTTP front end."""
    config = http_server_config("tiny/qwen-image-layered", tmp_path_factory.mktemp("out"), **DYNAMIC_BATCHING)
    with in_process_server(config) as server:
        yield server


def test_served_through_the_client_merged_equals_alone(layered_server):
    with Client(layered_server.endpoint, timeout=180.0) as client:
        requests = [
            dict(prompt=f"layers {i}", seed=i, image=rgba_png(), layers=2, num_inference_steps=2, return_tensor=True)
            for i in (1, 2)
        ]
        with ThreadPoolExecutor(max_workers=2) as pool:
            pair = [f.result() for f in [pool.submit(client.generate, timeout=180.0, **r) for r in requests]]
        alone = client.generate(timeout=180.0, **requests[1])
    assert [r.info["batch_size"] for r in pair] == [2, 2] and alone.info["batch_size"] == 1
    for result in (*pair, alone):
        assert result.job.state == "completed" and result.info["layers"] == 2 and len(result.files) == 2
        for index, file in enumerate(result.files):
            assert file.name.endswith(f"_layer{index}.png") and file.mime == "image/png"
            assert Image.open(io.BytesIO(file.data)).mode == "RGBA"
    assert (pair[1].tensor("image") - alone.tensor("image")).abs().max().item() <= BATCH_TOL


def test_images_edits_returns_every_layer_of_every_job(layered_server):
    """``n`` jobs x ``layers`` data items, job by job, layers in order; as URLs, ``?index=K`` each."""
    url = layered_server.http_url
    form = {"prompt": "split it", "n": "2", "layers": "2", "num_inference_steps": "2", "seed": "7"}
    reply = httpx.post(
        f"{url}/v1/images/edits",
        files={"image": ("in.png", rgba_png(), "image/png")},
        data={**form, "response_format": "b64_json"},
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    pictures = [Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) for item in data]
    assert len(pictures) == 4 and all(p.mode == "RGBA" and p.size == OUT_SIZE for p in pictures)
    assert pictures[0].tobytes() != pictures[2].tobytes()  # job 2 (seed 8) is not job 1 (seed 7)
    reply = httpx.post(
        f"{url}/v1/images/edits",
        files={"image": ("in.png", rgba_png(), "image/png")},
        data={**form, "n": "1", "response_format": "url"},
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    urls = [item["url"] for item in reply.json()["data"]]
    assert [u.rpartition("?")[2] for u in urls] == ["index=0", "index=1"]
    fetched = [httpx.get(u, timeout=60) for u in urls]
    assert all(r.status_code == 200 and r.content.startswith(b"\x89PNG") for r in fetched)
    # the same seed and image: the URL's layers are the b64 reply's first job's, in order (that one ran
    # merged with its n=2 mate: equal within the batch tolerance, so within one 8-bit step)
    for response, picture in zip(fetched, pictures[:2]):
        alone = np.array(Image.open(io.BytesIO(response.content)), dtype=np.int16)
        assert np.abs(alone - np.array(picture, dtype=np.int16)).max() <= 1
    past = httpx.get(urls[0].replace("index=0", "index=2"), timeout=60)
    assert past.status_code == 404 and "index 2 is past them" in past.text
    refused = httpx.post(
        f"{url}/v1/images/edits",
        files={"image": ("in.png", rgba_png(), "image/png")},
        data={**form, "layers": "0"},
        timeout=60,
    )
    assert refused.status_code == 400 and "layers must be in 1..10" in refused.text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_generate_on_the_command_line_writes_every_layer(tiny_cache, tmp_path):
    picture = tmp_path / "in.png"
    picture.write_bytes(rgba_png())
    run_generate(
        model_path="tiny/qwen-image-layered",
        device="cpu",
        prompt="split",
        image_path=picture,
        seed=5,
        layers=2,
        num_inference_steps=2,
        output_path=tmp_path / "out",
        output_file_name="split.png",
    )
    written = sorted(path.name for path in (tmp_path / "out").glob("*.png"))
    assert written == ["split_layer0.png", "split_layer1.png"]
    assert all(Image.open(tmp_path / "out" / name).mode == "RGBA" for name in written)
