"""The official ``openai`` SDK, unchanged, against tilecast's HTTP front end (CPU, tiny models).

Images on an in-process ``tiny/flux`` server (``images.generate`` with ``b64_json`` and ``url``,
the neutral-or-refused OpenAI fields, ``models``); videos on an in-process ``tiny/wan2.1-t2v`` server
(``videos.create`` / ``create_and_poll`` / ``retrieve`` / ``download_content`` / ``list`` /
``delete``, ``seconds`` and ``size`` mapped onto the model). The super-resolution route through
the SDK is in ``tests/test_http_api.py`` (it shares that file's K6 SR server).
"""

from __future__ import annotations

import base64
import io

import av
import httpx
import openai
import pytest

from tests.harness import http_server_config
from tilecast.runtime.inproc import InProcessServer

pytestmark = pytest.mark.timeout(300)
STEPS = {"num_inference_steps": 2}


def _sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused-without---api-key", max_retries=0, timeout=120)


def _serve(model_path: str, tmp_path_factory):
    with InProcessServer(http_server_config(model_path, tmp_path_factory.mktemp("out"))) as server:
        yield server


@pytest.fixture(scope="module")
def image_server(tmp_path_factory):
    yield from _serve("tiny/flux", tmp_path_factory)


@pytest.fixture(scope="module")
def video_server(tmp_path_factory):
    yield from _serve("tiny/wan2.1-t2v", tmp_path_factory)


def test_images_generate_b64_and_url_give_the_same_picture(image_server):
    sdk = _sdk(image_server.http_url)
    fields = dict(prompt="a red square", size="32x32", extra_body={**STEPS, "seed": 5})
    b64 = sdk.images.generate(response_format="b64_json", **fields)
    png = base64.b64decode(b64.data[0].b64_json)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and b64.data[0].revised_prompt == "a red square"
    assert b64.id and b64.created > 0 and b64.usage is not None
    assert b64.model_extra["inference_time_s"] > 0 and b64.model_extra["peak_memory_mb"] is None  # CPU: no count

    by_url = sdk.images.generate(**fields)  # the reference's default response_format is url
    url = by_url.data[0].url
    assert url.startswith(image_server.http_url) and by_url.data[0].b64_json is None
    fetched = httpx.get(url, timeout=30)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    assert fetched.content == png  # same seed, same size: the same image

    jpeg = sdk.images.generate(response_format="b64_json", output_format="jpeg", **fields)
    assert base64.b64decode(jpeg.data[0].b64_json).startswith(b"\xff\xd8\xff")
    neutral = sdk.images.generate(
        response_format="b64_json", quality="auto", style="vivid", background="opaque", user="u-1", **fields
    )
    assert base64.b64decode(neutral.data[0].b64_json) == png


def test_sglang_and_openai_encoding_fields_through_http(image_server):
    sdk = _sdk(image_server.http_url)
    webp = sdk.images.generate(
        prompt="a lighthouse", size="32x32", response_format="b64_json", output_format="webp",
        output_compression=50, extra_body=STEPS,
    )  # fmt: skip
    image = base64.b64decode(webp.data[0].b64_json)
    assert image[:4] == b"RIFF" and image[8:12] == b"WEBP"
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.images.generate(prompt="x", size="32x32", extra_body={"enable_teacache": True, **STEPS})
    assert refused.value.param == "enable_teacache" and "TeaCache" in refused.value.message
    # SGLang's clients nest extra fields under "extra_body" in the JSON itself
    nested = {
        "prompt": "x",
        "size": "32x32",
        "response_format": "b64_json",
        "extra_body": {"max_sequence_length": 16, **STEPS},
    }
    response = httpx.post(f"{image_server.http_url}/v1/images/generations", json=nested, timeout=120)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "field, value",
    [("quality", "hd"), ("style", "natural"), ("background", "transparent"), ("response_format", "png")],
)
def test_an_openai_image_field_tilecast_cannot_honour_is_a_400_naming_it(image_server, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        _sdk(image_server.http_url).images.generate(prompt="x", size="32x32", extra_body={field: value, **STEPS})
    assert refused.value.status_code == 400 and refused.value.param == field
    assert field in refused.value.message


def test_models_retrieve_by_any_alias_and_model_info(image_server):
    sdk = _sdk(image_server.http_url)
    (card,) = sdk.models.list().data
    assert card.id == "tiny/flux" and card.model_extra["task_type"] == "T2I"
    assert card.model_extra["pipeline_class"] == "FluxPipeline" and card.model_extra["num_gpus"] == 1
    for alias in ("tiny/flux", "flux"):
        assert sdk.models.retrieve(alias).id == alias
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.models.retrieve("sora-2")
    assert missing.value.code == "model_not_found"
    info = httpx.get(f"{image_server.http_url}/v1/model_info", timeout=30).json()
    assert info["num_gpus"] == 1 and info["precision"] == "float32" and info["pipeline_name"] == "FluxT2IPipeline"
    assert info["layout"]["ulysses_degree"] == 1
    assert httpx.get(f"{image_server.http_url}/models", timeout=30).json()["data"][0]["id"] == "tiny/flux"


@pytest.mark.parametrize("server_name", ["image_server", "video_server"])
def test_health_generate_runs_one_real_step_and_reuses_its_answer(server_name, request):
    url = request.getfixturevalue(server_name).http_url
    first = httpx.get(f"{url}/health_generate", timeout=120)
    assert first.status_code == 200 and first.json()["status"] == "ok", first.text
    assert first.json()["state"] == "completed" and first.json()["inference_time_s"] > 0
    again = httpx.get(f"{url}/health_generate", timeout=120).json()
    assert again["job_id"] == first.json()["job_id"]  # within HEALTH_GENERATE_TTL_S: the same run
    assert httpx.get(f"{url}/v1/videos/{again['job_id']}", timeout=30).status_code == 404  # the probe's job is gone


def test_videos_create_and_poll_download_list_delete(video_server):
    sdk = _sdk(video_server.http_url)
    video = sdk.videos.create_and_poll(
        prompt="a drifting cloud", model="wan2.1-t2v", seconds="1", size="32x32", extra_body={**STEPS, "seed": 3}
    )
    assert video.status == "completed" and video.model == "wan2.1-t2v" and video.size == "32x32"
    mapping = video.model_extra["frames_from_seconds"]
    assert mapping == {"seconds_requested": 1.0, "fps": 16, "num_frames": 17, "seconds": 1.062}  # 16 -> 4k+1
    assert video.seconds == "1.062" and video.completed_at and video.progress == 100 and video.error is None
    assert video.model_extra["num_outputs"] == 1 and video.model_extra["inference_time_s"] > 0

    content = sdk.videos.download_content(video.id)
    with av.open(io.BytesIO(content.read())) as container:
        stream = container.streams.video[0]
        assert (stream.width, stream.height) == (32, 32)
        assert sum(1 for _ in container.decode(video=0)) == 17

    assert video.id in [v.id for v in sdk.videos.list(order="asc", limit=10).data]
    assert sdk.videos.list(after="video_never_made").data == []
    assert sdk.videos.retrieve(video.id).id == video.id
    deleted = sdk.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve(video.id)


def test_video_seconds_and_num_frames_together_are_refused(video_server):
    with pytest.raises(openai.BadRequestError) as refused:
        _sdk(video_server.http_url).videos.create(prompt="x", seconds="1", extra_body={"num_frames": 5})
    assert refused.value.param == "num_frames"
