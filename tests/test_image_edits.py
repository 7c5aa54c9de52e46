"""Image-to-image end to end on FLUX.2 [klein] (``tiny/flux.2-klein-4b``, reference images): the
family on one rank, the ZeroMQ client's ``image=``, ``tilecast generate --image-path``, and the
official ``openai`` SDK's ``images.edit`` with the multipart edge cases of ``/v1/images/edits``.

FLUX.2's pipelines give one list of references to the whole call, so requests merge only when
they send the same references (their digests are in the batch key); a merged batch with shared
references equals its singletons within ``BATCH_TOL`` (fp32).
"""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch
from PIL import Image

from tests.harness import DYNAMIC_BATCHING, http_server_config, make_context, run_generate
from tilecast.runtime.inproc import InProcessServer
from tilecast.runtime.models.families.flux2_klein import Flux2KleinT2IPipeline
from tilecast.runtime.pipeline import WorkItem

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny/flux.2-klein-4b"
BATCH_TOL = 1e-4
STEPS = {"num_inference_steps": 2}


def png(width: int = 64, height: int = 64, color=(200, 30, 30)) -> bytes:
    image = Image.new("RGB", (width, height), color)
    image.paste((20, 200, 40), (0, 0, width // 2, height // 2))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def klein(tiny_cache, tmp_path_factory):
    ctx = make_context(tmp_path_factory.mktemp("klein"), dtype="float32")
    return Flux2KleinT2IPipeline.load(MODEL, ctx), ctx


def item(pipe, job_id: str, images: list[bytes], **fields) -> WorkItem:
    uploads = {f"image.{i}": data for i, data in enumerate(images)}
    params = pipe.prepare(pipe.params_type(**{"return_tensor": True, **STEPS, **fields}), uploads)
    return WorkItem(job_id=job_id, params=params, uploads=uploads)


def test_references_change_the_output_and_set_its_size(klein):
    pipe, ctx = klein
    edited = item(pipe, "e", [png(96, 64)], prompt="make it blue", seed=3)
    assert (edited.params.width, edited.params.height) == (96, 64)  # the reference's size, as diffusers derives it
    text_only = item(pipe, "t", [], prompt="make it blue", seed=3, width=96, height=64)
    out = pipe.run([edited], ctx)[0].tensors["image"]
    plain = pipe.run([text_only], ctx)[0].tensors["image"]
    # the tiny model's two blocks give the reference tokens a small say (measured 1.7e-3), still 17x BATCH_TOL
    assert out.shape == (3, 64, 96) and (out - plain).abs().max() > 10 * BATCH_TOL
    big = item(pipe, "b", [png(2048, 1024)], prompt="x")  # shrunk to 1024^2 pixels, floored to 16
    assert (big.params.width, big.params.height) == (1440, 720)


def test_requests_with_the_same_references_merge_and_match_their_singletons(klein):
    pipe, ctx = klein
    reference = png()
    a = item(pipe, "a", [reference], prompt="a red cat", seed=1)
    b = item(pipe, "b", [reference], prompt="a much longer prompt about a blue dog", seed=2)
    other = item(pipe, "c", [png(color=(0, 0, 250))], prompt="a red cat", seed=1)
    assert pipe.batch_key(a.params) == pipe.batch_key(b.params) != pipe.batch_key(other.params)
    pair = pipe.run([a, b], ctx)
    alone = pipe.run([a], ctx)[0].tensors["image"]
    assert (pair[0].tensors["image"] - alone).abs().max() <= BATCH_TOL
    assert (pipe.run([other], ctx)[0].tensors["image"] - alone).abs().max() > 10 * BATCH_TOL  # the reference is read


def test_output_equals_the_diffusers_pipeline_called_directly_with_the_reference(klein, tiny_cache):
    import diffusers

    pipe, ctx = klein
    reference = png(80, 64)
    ours = pipe.run([item(pipe, "o", [reference], prompt="a lighthouse", seed=5)], ctx)[0].tensors["image"]
    direct = diffusers.Flux2KleinPipeline.from_pretrained(str(Flux2KleinT2IPipeline.checkpoint.ensure(tiny_cache)))
    direct.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        theirs = direct(
            prompt="a lighthouse",
            image=[Image.open(io.BytesIO(reference))],
            num_inference_steps=2,
            guidance_scale=1.0,
            generator=torch.Generator().manual_seed(5),
            output_type="pt",
            return_dict=False,
        )[0][0]
    assert ours.shape == theirs.shape == (3, 64, 80)
    assert (ours - theirs).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ([png()] * 5, "image: flux.2-klein takes at most 4 input image(s); got 5"),
        ([png(48, 64)], "image is 48x64; flux.2-klein needs both sides >= 64"),
        ([png(64, 600)], "image is 64x600; flux.2-klein takes aspect ratios up to 8:1"),
        ([b"\x89PNG\r\n\x1a\n broken"], "image cannot be decoded"),
    ],
)
def test_bad_references_are_refused_naming_the_problem(klein, images, message):
    pipe, _ = klein
    with pytest.raises(ValueError) as info:
        item(pipe, "x", images, prompt="x")
    assert message in str(info.value)


def test_a_text_to_image_family_refuses_images(tiny_cache, tmp_path):
    from tilecast.runtime.models.families.flux import FluxT2IPipeline

    pipe = FluxT2IPipeline.load("tiny/flux", make_context(tmp_path, dtype="float32"))
    with pytest.raises(ValueError, match="image: flux takes no input image; got 1"):
        pipe.prepare(pipe.params_type(prompt="x"), {"image.0": png()})


# ---- served: ZeroMQ client, HTTP through the openai SDK ---------------------------------------


@pytest.fixture(scope="module")
def server(tiny_cache, tmp_path_factory):
    config = http_server_config(MODEL, tmp_path_factory.mktemp("out"), **DYNAMIC_BATCHING)
    with InProcessServer(config) as running:
        yield running


def _sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_zeromq_client_sends_paths_bytes_and_pil_images(server, tmp_path):
    from tilecast.client import Client

    path = tmp_path / "ref.png"
    path.write_bytes(png())
    with Client(server.endpoint, timeout=60.0) as client:
        by_path = client.generate(prompt="edit", image=path, seed=4, return_tensor=True, timeout=120, **STEPS)
        by_pil = client.generate(
            prompt="edit", image=Image.open(path), seed=4, return_tensor=True, timeout=120, **STEPS
        )
        assert by_path.job.state == by_pil.job.state == "completed"
        assert torch.equal(by_path.tensor("image"), by_pil.tensor("image"))
        with pytest.raises(Exception, match="image: flux.2-klein takes at most 4"):
            client.generate(prompt="edit", image=[path] * 5, timeout=60, **STEPS)


def test_images_edit_through_the_openai_sdk(server):
    sdk = _sdk(server.http_url)
    reference = png(96, 64)
    one = sdk.images.edit(
        image=("ref.png", reference, "image/png"),
        prompt="make it blue",
        response_format="b64_json",
        extra_body={**STEPS, "seed": 7},
    )
    picture = Image.open(io.BytesIO(base64.b64decode(one.data[0].b64_json)))
    assert picture.size == (96, 64) and one.data[0].revised_prompt == "make it blue"
    again = sdk.images.edit(
        image=("ref.png", reference, "image/png"),
        prompt="make it blue",
        response_format="b64_json",
        extra_body={**STEPS, "seed": 7},
    )
    assert again.data[0].b64_json == one.data[0].b64_json  # same reference, prompt and seed
    two = sdk.images.edit(
        image=[("a.png", png(), "image/png"), ("b.png", png(color=(0, 0, 255)), "image/png")],
        prompt="combine them",
        size="64x64",
        n=2,
        response_format="b64_json",
        extra_body=STEPS,
    )
    assert len(two.data) == 2 and all(
        Image.open(io.BytesIO(base64.b64decode(d.b64_json))).size == (64, 64) for d in two.data
    )


def _post(server, files, data=None) -> httpx.Response:
    """A multipart POST (form fields as parts too, so a body without files is still multipart)."""
    fields = [(name, (None, value)) for name, value in (data or {}).items()]
    return httpx.post(f"{server.http_url}/v1/images/edits", files=[*fields, *files], timeout=120)


@pytest.mark.parametrize(
    ("files", "status", "param", "message"),
    [
        ([], 400, "image", "image is required"),
        ([("image[]", ("a.png", png(), "image/png"))] * 5, 400, "image", "takes at most 4 input image(s); got 5"),
        ([("image", ("big.png", b"\0" * (30 * 2**20), "image/png"))], 413, "image", "at most 20 MiB per image"),
        ([("image", ("bad.png", png()[:50], "image/png"))], 400, "image", "image cannot be decoded"),
        ([("image", ("a.png", png(), "image/png")), ("mask", ("m.png", png(), "image/png"))], 400, "mask", "no mask"),
        ([("image", ("a.txt", b"hello", "text/plain"))], 415, "image", "expected image/*"),
    ],
    ids=["missing", "too-many", "30-MiB", "corrupt", "mask", "not-an-image-type"],
)
def test_edits_edge_cases_get_their_4xx_and_the_server_goes_on(server, files, status, param, message):
    answer = _post(server, files, {"prompt": "x", **{k: str(v) for k, v in STEPS.items()}})
    error = answer.json()["error"]
    assert answer.status_code == status and error["param"] == param and message in error["message"]
    good = _post(
        server,
        [("image", ("a.png", png(), "image/png"))],
        {"prompt": "fine", "response_format": "b64_json", **{k: str(v) for k, v in STEPS.items()}},
    )
    assert good.status_code == 200 and good.json()["data"][0]["b64_json"]


def test_edits_need_multipart_and_an_image_model(server, tiny_cache, tmp_path):
    json_body = httpx.post(f"{server.http_url}/v1/images/edits", json={"prompt": "x"}, timeout=30)
    assert json_body.status_code == 415 and "multipart/form-data" in json_body.json()["error"]["message"]
    config = http_server_config("tiny/flux", tmp_path)
    with InProcessServer(config) as text_only:
        answer = httpx.post(
            f"{text_only.http_url}/v1/images/edits",
            files=[("image", ("a.png", png(), "image/png"))],
            data={"prompt": "x"},
        )
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "image"
        assert "takes no input image" in answer.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_generate_image_path_on_the_command_line(tiny_cache, tmp_path):
    reference = tmp_path / "ref.png"
    reference.write_bytes(png(80, 64))
    run_generate(
        model_path=MODEL,
        device="cpu",
        prompt="a lighthouse",
        image_path=reference,
        seed=5,
        num_inference_steps=2,
        output_path=tmp_path / "out",
    )
    written = list((tmp_path / "out").glob("*.png"))
    assert len(written) == 1 and Image.open(written[0]).size == (80, 64)
