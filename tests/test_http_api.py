"""The OpenAI-style HTTP front end, through a real HTTP client against real servers.

Most tests share one 2-rank CPU ``tilecast serve --model-path tiny/k6sr --http-port ...``
(module fixture, ``--max-upload-mb 1`` so the limits are cheap to hit); the clips are 64x64 x 9
frames at x2, one tile each. The ``/health`` failure modes use a front end pointed at a silent
endpoint and at a fake scheduler that reports a dead rank. Image generation runs on an
in-process ``tiny/flux`` server with dynamic batching.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import av
import httpx
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import ServerProcess, send_chunks, serve_args, wait_until
from tests.media import write_test_video
from tilecast.scheduler import protocol as P
from tilecast.scheduler.http_server import HttpFrontEnd

pytestmark = pytest.mark.timeout(600)

JOB_TIMEOUT_S = 180.0
QUEUED_UPLOADS = 2.5
"""``--max-queued-upload-mb`` of the shared server, in clips: two uploaded clips may wait, not three."""
SR_FIELDS = {"sr_resolution_scale": "2", "sr_tiles_batch_size": "1", "num_inference_steps": "2", "seed": "42"}


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("allowed")
    write_test_video(directory / "clip.mp4", 64, 64, 9, 24, audio=True)
    return directory


@pytest.fixture(scope="module")
def server(media, tmp_path_factory):
    """A 2-rank CPU server with the HTTP front end; yields its base URL."""
    queued_upload_mb = f"{QUEUED_UPLOADS * (media / 'clip.mp4').stat().st_size / 2**20:.6f}"
    limits = dict(allowed_video_dir=media, max_upload_mb=1, max_queued_upload_mb=queued_upload_mb)
    args = serve_args("tiny/k6sr", tmp_path_factory.mktemp("outputs"), num_gpus=2, **limits)
    proc = ServerProcess(*args, http=True, ready_timeout=240.0)
    try:
        url = proc.http_url
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"HTTP front end did not come up:\n{proc.log()[-4000:]}"
            time.sleep(0.2)
        proc.url = url
        yield proc
    finally:
        proc.stop()
        assert not proc.left_behind


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def wait_terminal(http: httpx.Client, job_id: str, timeout: float = JOB_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = http.get(f"/v1/videos/{job_id}").json()
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job['status']} after {timeout} s"
        time.sleep(0.25)


def describe_mp4(path: Path) -> dict:
    with av.open(str(path)) as container:
        video, audio = container.streams.video, container.streams.audio
        info = {
            "width": video[0].width,
            "height": video[0].height,
            "codec": video[0].codec_context.name,
            "audio": audio[0].codec_context.name if audio else None,
        }
        info["num_frames"] = sum(1 for _ in container.decode(video=0))
    return info


def pixels(png: bytes):
    import io

    import numpy as np
    import torch
    from PIL import Image

    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float32))


def metric_values(text: str) -> dict[tuple, float]:
    """Parse the exposition (strictly: every line is a comment or a well-formed sample) into
    ``{(sample name, sorted labels): value}``."""
    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? \S+$')
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return values


def raw_post(port: int, headers: dict[str, str], chunks: list[bytes] = (), chunked: bool = False) -> bytes:
    """POST /v1/videos over a plain socket, sending only ``chunks`` of the body; returns what came back
    (the head, and the body as far as its Content-Length says)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = "POST /v1/videos HTTP/1.1\r\nHost: test\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(head.encode() + b"\r\n")
        send_chunks(sock, chunks, chunked=chunked)
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
        head, _, body = reply.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        while length and len(body) < int(length.group(1)):
            data = sock.recv(65536)
            if not data:
                break
            body += data
        return head + b"\r\n\r\n" + body


# ---------------------------------------------------------------------------------------------
# Videos: the documented flow, JSON paths, cancel
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uploaded_job(server, media) -> dict:
    """The reference's curl command (curl itself when installed), polled to completion."""
    clip = media / "clip.mp4"
    if shutil.which("curl"):
        command = [
            "curl",
            "-sS",
            "--fail-with-body",
            f"{server.url}/v1/videos",
            "-F",
            f"video_reference=@{clip};type=video/mp4",
        ]
        for key, value in SR_FIELDS.items():
            command += ["-F", f"{key}={value}"]
        created = json.loads(subprocess.run(command, check=True, capture_output=True, timeout=60).stdout)
    else:
        response = httpx.post(
            f"{server.url}/v1/videos",
            data=SR_FIELDS,
            files={"video_reference": ("input.mp4", clip.read_bytes(), "video/mp4")},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        created = response.json()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        finished = wait_terminal(client, created["id"])
    return {"created": created, "finished": finished}


def test_upload_poll_download_gives_playable_mp4_with_audio(http, uploaded_job, tmp_path):
    created, finished = uploaded_job["created"], uploaded_job["finished"]
    assert created["object"] == "video" and created["id"].startswith("job_")
    assert created["status"] in ("queued", "in_progress", "completed") and created["error"] is None
    assert isinstance(created["created_at"], int) and 0 <= created["progress"] <= 100
    assert finished["status"] == "completed" and finished["progress"] == 100 and finished["error"] is None

    response = http.get(f"/v1/videos/{created['id']}/content")
    assert response.status_code == 200 and response.headers["content-type"] == "video/mp4"
    path = tmp_path / "out.mp4"
    path.write_bytes(response.content)
    mp4 = describe_mp4(path)
    assert (mp4["width"], mp4["height"], mp4["num_frames"]) == (128, 128, 9)
    assert mp4["codec"] == "h264" and mp4["audio"] == "aac"

    listed = http.get("/v1/videos", params={"limit": 100}).json()
    assert listed["object"] == "list" and created["id"] in [job["id"] for job in listed["data"]]


def test_openai_sdk_super_resolves_a_video_sent_as_input_reference(server, media, tmp_path):
    """The official SDK's videos.create takes a prompt (required there) and an input_reference:
    a video there is the SR source, as the reference routes it; the prompt is accepted, not read."""
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=JOB_TIMEOUT_S)
    clip = (media / "clip.mp4").read_bytes()
    video = sdk.videos.create_and_poll(
        prompt="sharper, please", input_reference=("in.mp4", clip, "video/mp4"), extra_body=SR_FIELDS
    )
    assert video.status == "completed" and video.model == "tiny/k6sr", video
    assert video.model_extra["notes"] == ["super-resolution does not read the prompt"]
    with pytest.raises(openai.BadRequestError) as refused:  # the source sets the duration
        sdk.videos.create(prompt="x", input_reference=("in.mp4", clip, "video/mp4"), seconds="4", extra_body=SR_FIELDS)
    assert refused.value.param == "seconds"
    fitted = sdk.videos.create_and_poll(
        prompt="x", input_reference=("in.mp4", clip, "video/mp4"), size="64x64", extra_body=SR_FIELDS
    )  # size is the SR target resolution: the x2 result is scaled down to fit it
    small = tmp_path / "fitted.mp4"
    small.write_bytes(sdk.videos.download_content(fitted.id).read())
    assert (describe_mp4(small)["width"], describe_mp4(small)["height"]) == (64, 64)
    path = tmp_path / "sdk.mp4"
    path.write_bytes(sdk.videos.download_content(video.id).read())
    mp4 = describe_mp4(path)
    assert (mp4["width"], mp4["height"], mp4["num_frames"], mp4["audio"]) == (128, 128, 9, "aac")


def test_health_generate_super_resolves_a_generated_clip(http):
    response = http.get("/health_generate", timeout=JOB_TIMEOUT_S)
    assert response.status_code == 200 and response.json()["state"] == "completed", response.text


def test_json_video_path_inside_and_outside_the_allowed_dir(http, media, tmp_path):
    response = http.post(
        "/v1/videos",
        json={"video_path": str(media / "clip.mp4"), "sr_resolution_scale": 2, "seed": 3, "model": "tiny/k6sr"},
    )
    assert response.status_code == 200, response.text
    job = wait_terminal(http, response.json()["id"])
    assert job["status"] == "completed", job
    content = http.get(f"/v1/videos/{job['id']}/content")
    (tmp_path / "json.mp4").write_bytes(content.content)
    assert describe_mp4(tmp_path / "json.mp4")["audio"] == "aac"
    # newest first
    assert http.get("/v1/videos", params={"limit": 1}).json()["data"][0]["id"] == job["id"]

    outside = write_test_video(tmp_path / "outside.mp4", 64, 64, 1, 24)
    response = http.post("/v1/videos", json={"video_path": str(outside)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "is not allowed" in error["message"] and error["param"] == "video_path"
    assert str(outside.resolve().parent) not in error["message"].replace(str(outside), "")  # no resolved path
    response = http.post("/v1/videos", json={"video_path": str(media / ".." / outside.parent.name / "outside.mp4")})
    assert response.status_code == 400 and "is not allowed" in response.json()["error"]["message"]


def test_delete_queued_and_running_jobs(http, media):
    """OpenAI's DELETE: the job is cancelled if unfinished and forgotten (video.deleted, then 404)."""
    clip = media / "clip.mp4"
    files = lambda: {"video_reference": ("in.mp4", clip.read_bytes(), "video/mp4")}  # noqa: E731
    first = http.post("/v1/videos", data={**SR_FIELDS, "seed": "5"}, files=files()).json()
    second = http.post("/v1/videos", data={**SR_FIELDS, "seed": "6"}, files=files()).json()
    assert second["status"] == "queued", second  # the first one holds the ranks

    deleted = http.delete(f"/v1/videos/{second['id']}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": second["id"], "object": "video.deleted", "deleted": True}
    assert http.get(f"/v1/videos/{second['id']}").status_code == 404
    assert http.get(f"/v1/videos/{second['id']}/content").status_code == 404
    assert http.delete(f"/v1/videos/{second['id']}").status_code == 404  # already gone
    assert second["id"] not in [job["id"] for job in http.get("/v1/videos", params={"limit": 100}).json()["data"]]

    wait_until(lambda: http.get(f"/v1/videos/{first['id']}").json()["status"] != "queued", 60, "the first job's start")
    early = http.get(f"/v1/videos/{first['id']}/content")
    assert early.status_code == 404 and early.json()["error"]["code"] == "job_running"  # as the reference
    assert "still in progress" in early.json()["error"]["message"]
    running = http.delete(f"/v1/videos/{first['id']}")
    assert running.status_code == 200 and running.json()["deleted"] is True
    assert http.get(f"/v1/videos/{first['id']}").status_code == 404


# ---------------------------------------------------------------------------------------------
# Limits and errors
# ---------------------------------------------------------------------------------------------
def test_declared_oversize_body_gets_413_before_any_body_is_sent(server):
    port = int(server.url.rsplit(":", 1)[1])
    started = time.monotonic()
    reply = raw_post(port, {"Content-Type": "multipart/form-data; boundary=B", "Content-Length": str(50 * 2**20)})
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert time.monotonic() - started < 5


def test_streamed_oversize_body_gets_413_while_streaming(server):
    """No Content-Length (chunked): the body is counted as it arrives and refused past 1 MiB."""
    port = int(server.url.rsplit(":", 1)[1])
    preamble = (
        b'--B\r\nContent-Disposition: form-data; name="video_reference"; filename="a.mp4"\r\n'
        b"Content-Type: video/mp4\r\n\r\n"
    )
    chunks = [preamble] + [b"\0" * 65536] * 24  # 1.5 MiB, never terminated: the server must not wait for the end
    reply = raw_post(
        port, {"Content-Type": "multipart/form-data; boundary=B", "Transfer-Encoding": "chunked"}, chunks, chunked=True
    )
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]  # the message names the limit and its flag
    assert error["code"] == "payload_too_large" and "1 MiB (--max-upload-mb)" in error["message"], error


def test_content_types(http):
    response = http.post("/v1/videos", content=b"video_path=x", headers={"content-type": "text/plain"})
    assert response.status_code == 415
    response = http.post("/v1/videos", data=SR_FIELDS, files={"video_reference": ("a.txt", b"hello", "text/plain")})
    assert response.status_code == 415 and response.json()["error"]["param"] == "video_reference"
    # application/octet-stream (curl's default for -F f=@x.mp4) is accepted and the bytes are probed:
    response = http.post(
        "/v1/videos", data=SR_FIELDS, files={"video_reference": ("a.mp4", b"not a video", "application/octet-stream")}
    )
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    response = http.post("/v1/images/generations", json={"prompt": "a cat"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "wrong_task"


def test_unknown_ids_are_404(http):
    for method, path in (
        ("GET", "/v1/videos/job_000000000000000000000000"),
        ("GET", "/v1/videos/job_000000000000000000000000/content"),
        ("DELETE", "/v1/videos/job_000000000000000000000000"),
    ):
        response = http.request(method, path)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["code"] == "not_found"
    assert http.get("/v1/nothing").status_code == 404


@pytest.mark.parametrize(
    "kind, fields, param",
    [
        ("form", {"seed": "abc"}, "seed"),
        ("form", {"sr_resolution_scale": "two"}, "sr_resolution_scale"),
        ("form", {"sr_resolution_scale": "3"}, "sr_resolution_scale"),  # a type-correct value the pipeline refuses
        ("form", {"colour": "red"}, "colour"),
        ("form", {"video": "/etc/passwd"}, "video"),  # never read as a server-side upload path
        ("json", {"video_path": "x", "seed": "42"}, "seed"),  # JSON values keep their types
        ("json", {"video_path": "x", "num_inference_steps": 1.5}, "num_inference_steps"),
        ("json", {"video_path": "x", "model": "other/model"}, "model"),
        ("json", {"video_path": "x", "output_file_name": "a" * 300}, "output_file_name"),  # refused before any compute
        ("form", {"output_file_name": "out put.mp4"}, "output_file_name"),
        ("json", {"video_path": "x", "seed": 2**64}, "seed"),
    ],
)
def test_malformed_fields_are_400_naming_the_field(http, media, kind, fields, param):
    if kind == "form":
        files = {"video_reference": ("a.mp4", (media / "clip.mp4").read_bytes(), "video/mp4")}
        response = http.post("/v1/videos", data=fields, files=files)
    else:
        response = http.post("/v1/videos", json=fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error


def test_malformed_json_and_query(http):
    response = http.post("/v1/videos", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = http.post("/v1/videos", json=[1, 2])
    assert response.status_code == 400
    assert http.get("/v1/videos", params={"limit": "0"}).json()["error"]["param"] == "limit"


def test_queued_uploads_have_a_total_cap_answered_with_503_and_retry_after(http, media, server):
    """While a long job holds the ranks, two uploaded clips may wait; the third is refused (503,
    Retry-After, counted) rather than held in memory; once one leaves the queue, uploads are taken again."""
    long_clip = write_test_video(media / "long.mp4", 64, 64, 33, 24)
    running = http.post(
        "/v1/videos", json={"video_path": str(long_clip), "sr_resolution_scale": 4, "num_inference_steps": 8}
    ).json()  # a server-side file: no upload bytes
    wait_until(lambda: http.get(f"/v1/videos/{running['id']}").json()["status"] != "queued", 60, "the long job's start")
    clip = (media / "clip.mp4").read_bytes()
    upload = lambda seed: http.post(
        "/v1/videos",
        data={**SR_FIELDS, "seed": str(seed)},  # noqa: E731
        files={"video_reference": ("in.mp4", clip, "video/mp4")},
    )
    before = metric_values(http.get("/metrics").text)
    waiting = [upload(seed) for seed in (1, 2)]
    assert [r.status_code for r in waiting] == [200, 200] and [r.json()["status"] for r in waiting] == ["queued"] * 2
    refused = upload(3)
    assert refused.status_code == 503 and refused.headers["retry-after"].isdigit(), refused.text
    error = refused.json()["error"]
    assert error["code"] == "overloaded" and "--max-queued-upload-mb" in error["message"], error
    key = ("tilecast_refused_total", (("reason", "queued_upload_cap"),))
    assert metric_values(http.get("/metrics").text)[key] - before[key] == 1
    assert http.get(f"/v1/videos/{running['id']}").json()["status"] == "in_progress"  # the test held the ranks

    assert http.delete(f"/v1/videos/{waiting[0].json()['id']}").status_code == 200  # its bytes leave the queue
    again = upload(4)
    assert again.status_code == 200, again.text
    for job_id in (running["id"], waiting[1].json()["id"], again.json()["id"]):
        assert http.delete(f"/v1/videos/{job_id}").status_code == 200


# ---------------------------------------------------------------------------------------------
# Service routes
# ---------------------------------------------------------------------------------------------
def test_health_and_models(http):
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["world_size"] == 2
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny/k6sr"
    assert models["data"][0]["task"] == "sr"


def test_metrics_parse_and_move_with_traffic(http, uploaded_job):
    before = metric_values(http.get("/metrics").text)
    assert before[("tilecast_up", ())] == 1.0
    assert before[("tilecast_jobs", (("state", "completed"),))] >= 1
    assert before[("tilecast_stage_seconds_count", (("stage", "denoise"),))] >= 1  # from Output.info timings
    assert before[("tilecast_job_duration_seconds_count", (("state", "completed"),))] >= 1
    assert before[("tilecast_batch_size_count", ())] >= 1

    for _ in range(3):
        http.get("/v1/videos/job_000000000000000000000000")
    http.get("/health")
    after = metric_values(http.get("/metrics").text)

    key = ("tilecast_http_requests_total", (("method", "GET"), ("route", "/v1/videos/{video_id}"), ("status", "404")))
    assert after[key] - before.get(key, 0.0) == 3
    health = ("tilecast_http_requests_total", (("method", "GET"), ("route", "/health"), ("status", "200")))
    assert after[health] - before.get(health, 0.0) == 1
    scrape = ("tilecast_http_requests_total", (("method", "GET"), ("route", "/metrics"), ("status", "200")))
    assert after[scrape] - before.get(scrape, 0.0) == 1  # the first scrape is counted once it has finished


# ---------------------------------------------------------------------------------------------
# /health when the scheduler is silent or reports a dead rank (no model needed)
# ---------------------------------------------------------------------------------------------
class FakeScheduler(threading.Thread):
    """A ROUTER socket that answers health/stats like a scheduler whose rank 1 died."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                if not self.sock.poll(100):
                    continue
                identity, *frames = self.sock.recv_multipart()
                msg, _ = P.decode(frames, allowed=P.REQUEST_TYPES)
                if isinstance(msg, P.HealthRequest):
                    reply = P.HealthReply(
                        req_id=msg.req_id, status="dead", world_size=2, model="fake", detail="rank 1 (pid 4242) died"
                    )
                else:
                    reply = P.StatsReply(req_id=msg.req_id, stats={"status": "dead", "world_size": 2})
                self.sock.send_multipart([identity, *P.encode(reply)])
        finally:
            self.sock.close(linger=0)


@pytest.mark.parametrize("scheduler", ["silent", "dead"])
def test_health_is_503_when_the_scheduler_is_silent_or_dead(scheduler):
    fake = None
    if scheduler == "dead":
        fake = FakeScheduler()
        fake.start()
        endpoint = fake.endpoint
    else:
        endpoint = "tcp://127.0.0.1:1"  # nobody there (a privileged port nothing serves): never answered
    front = HttpFrontEnd.for_scheduler(endpoint=endpoint, host="127.0.0.1", port=0, max_upload_mb=1).start()
    try:
        started = time.monotonic()
        response = httpx.get(f"{front.url}/health", timeout=10)
        assert response.status_code == 503
        assert time.monotonic() - started < 5
        body = response.json()
        if scheduler == "dead":
            assert body["status"] == "dead" and "rank 1" in body["detail"]
        else:
            assert body["status"] == "unavailable"
        values = metric_values(httpx.get(f"{front.url}/metrics", timeout=10).text)
        assert values[("tilecast_up", ())] == 0.0
    finally:
        front.stop()
        if fake is not None:
            fake.halt.set()
            fake.join(5)


# ---------------------------------------------------------------------------------------------
# Images through the same scheduler (needs the tiny/flux family)
# ---------------------------------------------------------------------------------------------
def test_images_generations_batches_n_requests_with_consecutive_seeds(tmp_path):
    # tiny/flux is a built-in: if it fails to import or load, this test fails (it is never skipped).
    from tilecast.runtime.config import ServeConfig
    from tilecast.runtime.inproc import InProcessServer

    config = ServeConfig(
        model_path="tiny/flux",
        device="cpu",
        port=0,
        http_port=0,
        output_dir=tmp_path,
        batching_mode="dynamic",
        batching_max_size=4,
        batching_delay_ms=200,
    )
    with InProcessServer(config) as srv, httpx.Client(base_url=srv.http_url, timeout=120) as http:
        request = {
            "prompt": "a red square",
            "n": 2,
            "size": "64x64",
            "seed": 7,
            "num_inference_steps": 2,
            "response_format": "b64_json",
        }
        response = http.post("/v1/images/generations", json=request)
        assert response.status_code == 200, response.text
        body = response.json()
        images = [base64.b64decode(item["b64_json"]) for item in body["data"]]
        assert isinstance(body["created"], int) and len(images) == 2
        assert all(image.startswith(b"\x89PNG\r\n\x1a\n") for image in images) and images[0] != images[1]

        # n requests use seed, seed+1, ...: a lone seed-8 request draws the second picture again (up to the
        # rounding of batched versus unbatched compute) and not the first.
        single = http.post("/v1/images/generations", json={**request, "n": 1, "seed": 8}).json()
        alone = pixels(base64.b64decode(single["data"][0]["b64_json"]))
        first, second = pixels(images[0]), pixels(images[1])
        assert (alone - second).abs().mean() < 0.1 * (alone - first).abs().mean()

        values = metric_values(http.get("/metrics").text)
        assert values[("tilecast_batch_size_bucket", (("le", "1"),))] == 1  # the n=1 request
        assert values[("tilecast_batch_size_count", ())] == 2  # the n=2 pair went out as one batch
        bad = http.post("/v1/images/generations", json={**request, "size": "big"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "size"
        bad = http.post("/v1/images/generations", json={**request, "response_format": "jpeg_url"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


def test_http_settings_are_validated():
    from tilecast.runtime.config import ServeConfig

    assert ServeConfig().http_port is None  # off unless asked
    assert ServeConfig().http_host == "127.0.0.1"
    with pytest.raises(ValueError, match="--http-port"):
        ServeConfig(http_port=70000)
    with pytest.raises(ValueError, match="--max-upload-mb"):
        ServeConfig(max_upload_mb=0)
    with pytest.raises(ValueError, match="--max-message-mb"):
        ServeConfig(http_port=0, max_upload_mb=600, max_message_mb=512)


def test_taken_http_port_fails_start_naming_the_flag():
    with socket.create_server(("127.0.0.1", 0)) as taken:  # held (and listening) for the whole test
        port = taken.getsockname()[1]
        front = HttpFrontEnd.for_scheduler(endpoint="tcp://127.0.0.1:1", host="127.0.0.1", port=port, max_upload_mb=1)
        with pytest.raises(OSError, match="--http-port"):
            front.start()
