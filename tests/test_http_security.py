"""Hardening of the HTTP front end (issue 18), against a real ``tilecast serve`` over real sockets.

One 1-rank CPU ``tiny/flux`` server started with ``--api-key`` (module fixture) serves every test:

- the key: every route but ``/health`` needs ``Authorization: Bearer``; the official ``openai`` SDK's
  ``api_key=`` works unchanged; refusals are counted in ``/metrics``;
- JSON bodies have a small limit (``MAX_JSON_BYTES``), enforced from Content-Length and while a
  chunked body streams, so large bodies never reach rank 0's memory (its peak RSS is measured);
- values that do not fit the wire or the generator (seed past 2**64, seed + n past it, a lone
  surrogate, 70-bit integers) are 400s over HTTP and ``bad_request`` over ZeroMQ, never 500s;
- a client that disconnects while waiting for images gets its jobs cancelled.

The queued-upload cap and K6 SR's ``output_file_name`` are tested on the SR server of
``tests/test_http_api.py``.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.harness import ServerProcess, send_chunks, serve_args
from tests.test_http_api import metric_values
from tilecast.client import Client, ServerError
from tilecast.scheduler.http_api import MAX_JSON_BYTES

pytestmark = pytest.mark.timeout(300)

API_KEY = "tc-test-" + secrets.token_hex(12)
IMAGE = {"size": "64x64", "num_inference_steps": 2, "response_format": "b64_json"}


# ---------------------------------------------------------------------------------------------
# The server and helpers
# ---------------------------------------------------------------------------------------------
def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS since the last reset) of ``pid``, in kB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return {key: int(re.search(rf"^{key}:\s*(\d+) kB", status, re.M).group(1)) for key in ("VmRSS", "VmHWM")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """1-rank CPU tiny/flux with ``--api-key`` and the HTTP front end; ``.url`` is its base URL."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TILECAST_API_KEY", API_KEY)  # what ServerProcess's readiness client presents
        args = serve_args("tiny/flux", tmp_path_factory.mktemp("outputs"), num_gpus=1, api_key=API_KEY)
        proc = ServerProcess(*args, http=True, ready_timeout=240.0)
        try:
            proc.url = proc.http_url
            yield proc
        finally:
            proc.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


def raw_request(url: str, head: str, chunks=(), *, chunked: bool = False) -> tuple[int, dict]:
    """Send ``head`` and then as much of ``chunks`` as the server takes; its status and JSON body."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n")
        send_chunks(sock, chunks, chunked=chunked)
        reply = b""
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            reply += data
            head_end = reply.find(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", reply[:head_end]) if head_end >= 0 else None
            if length and len(reply) - head_end - 4 >= int(length.group(1)):
                break
    if not reply.startswith(b"HTTP/1.1 "):
        return 0, None  # the connection was closed without an answer
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.partition(b"\r\n\r\n")[2] or b"null")


def post_head(length: int | None, *, key: str = API_KEY) -> str:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (
        f"POST /v1/images/generations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\n{size}"
    )


# ---------------------------------------------------------------------------------------------
# 1. Authentication
# ---------------------------------------------------------------------------------------------
def test_openai_sdk_api_key_works_unchanged_and_a_wrong_key_is_refused(server):
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    result = sdk.images.generate(
        prompt="a red square",
        n=2,
        size="64x64",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 11},
    )
    images = [base64.b64decode(item.b64_json) for item in result.data]
    assert len(images) == 2 and all(image.startswith(b"\x89PNG\r\n\x1a\n") for image in images)
    assert [model.id for model in sdk.models.list()] == ["tiny/flux"]

    for key in ("wrong-" + API_KEY, API_KEY[:-1]):
        stranger = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as refused:
            stranger.images.generate(prompt="a red square", size="64x64", response_format="b64_json")
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()


def test_every_route_but_health_needs_the_key_and_refusals_are_counted(server, http):
    before = metric_values(http.get("/metrics").text)
    routes = [
        ("GET", "/v1/models"),
        ("GET", "/v1/videos"),
        ("GET", "/v1/videos/job_000000000000000000000000"),
        ("DELETE", "/v1/videos/job_000000000000000000000000"),
        ("GET", "/metrics"),
        ("POST", "/v1/images/generations"),
        ("POST", "/v1/videos"),
        ("GET", "/v1/nothing"),
    ]
    headers_tried = [
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": API_KEY},
    ]
    with httpx.Client(base_url=server.url, timeout=30) as stranger:
        for method, path in routes:
            for headers in headers_tried:
                response = stranger.request(method, path, headers=headers, json={"prompt": "x"})
                assert response.status_code == 401, (method, path, headers, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
                error = response.json()["error"]
                assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        health = stranger.get("/health")  # liveness probes need no key
        assert health.status_code == 200 and health.json()["status"] == "ok"
    assert http.get("/v1/models").status_code == 200
    assert http.get("/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200

    after = metric_values(http.get("/metrics").text)
    refused = len(routes) * len(headers_tried)
    key = ("tilecast_http_unauthorized_total", ())
    assert after[key] - before.get(key, 0.0) == refused
    status_401 = sum(
        v
        for (name, labels), v in after.items()
        if name == "tilecast_http_requests_total" and ("status", "401") in labels
    )
    assert (
        status_401
        - sum(
            v
            for (name, labels), v in before.items()
            if name == "tilecast_http_requests_total" and ("status", "401") in labels
        )
        == refused
    )
    # The scheduler's own refusals (ZeroMQ handshakes without the key, shutdowns, oversize messages,
    # the queued-upload cap) are in the same exposition.
    reasons = {dict(labels)["reason"] for name, labels in after if name == "tilecast_refused_total"}
    assert {"queued_upload_cap", "shutdown", "refused_handshakes", "oversize_messages"} <= reasons, reasons


# ---------------------------------------------------------------------------------------------
# 4. Memory limits of the JSON route
# ---------------------------------------------------------------------------------------------
def test_json_bodies_over_the_limit_are_413_naming_it(server, http):
    prompt = "a" * (MAX_JSON_BYTES + 1)  # a valid request, just too large
    response = http.post("/v1/images/generations", json={"prompt": prompt, **IMAGE})
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "payload_too_large" and "1 MiB" in error["message"] and "JSON" in error["message"]

    started = time.monotonic()
    status, body = raw_request(server.url, post_head(400 * 2**20))  # declared: refused before any body is sent
    assert status == 413 and "1 MiB" in body["error"]["message"], body
    assert time.monotonic() - started < 5
    chunks = [b'{"prompt": "'] + [b"a" * 2**20] * 8  # chunked, never finished: refused while it streams
    status, body = raw_request(server.url, post_head(None), chunks, chunked=True)
    assert status == 413 and "1 MiB" in body["error"]["message"], body
    # The video route's JSON form has the same limit (its uploads go as multipart).
    response = http.post("/v1/videos", json={"prompt": prompt})
    assert response.status_code == 413 and "JSON" in response.json()["error"]["message"]


@pytest.mark.timeout(120)
def test_large_json_bodies_do_not_grow_rank_zero_memory(server, http):
    """Four 64 MiB bodies at once, chunked and with Content-Length: rank 0's peak RSS barely moves
    (without the JSON limit each body is read whole, twice over when joined)."""
    pid = server.pid  # rank 0's, from the ready file
    assert http.get("/health").status_code == 200
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = memory_kb(pid)
    body_mb = 64
    piece = b"a" * 2**20
    statuses: list[int] = []

    def send(chunked: bool) -> None:
        chunks = [b'{"prompt": "'] + [piece] * body_mb + [b'"}']
        length = None if chunked else sum(len(c) for c in chunks)
        statuses.append(raw_request(server.url, post_head(length), chunks, chunked=chunked)[0])

    threads = [threading.Thread(target=send, args=(i % 2 == 0,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    after = memory_kb(pid)
    growth_mb = (after["VmHWM"] - before["VmRSS"]) / 1024
    assert growth_mb < 32, f"rank 0's peak RSS grew by {growth_mb:.0f} MiB for 4 x {body_mb} MiB bodies ({statuses})"
    assert statuses == [413] * 4
    assert http.get("/health").status_code == 200


# ---------------------------------------------------------------------------------------------
# 5. Values that overflow
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "seed": 2**64 - 2, "n": 3}, "seed"),  # seeds seed..seed+n-1: the last one is 2**64
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "size": None, "width": 2**70}, "width"),
        ({"prompt": "x", "num_inference_steps": -(2**70)}, "num_inference_steps"),
        ({"prompt": "x", "output_file_name": "a" * 300}, "output_file_name"),
    ],
)
def test_overflowing_values_are_400_over_http(http, body, param):
    response = http.post("/v1/images/generations", json={**IMAGE, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error


@pytest.mark.parametrize(
    "raw, param, words",
    [
        (b'{"prompt": "\\ud800", "size": "64x64"}', "prompt", "surrogate"),  # a lone surrogate is not Unicode
        (
            b'{"prompt": "x", "negative_prompt": "a\\udfffb", "guidance_scale": 3.0, "size": "64x64"}',
            "negative_prompt",
            "surrogate",
        ),
        (b'{"prompt": "x", "guidance_scale": 1e400, "size": "64x64"}', "guidance_scale", "0..100"),  # inf
        (b'{"prompt": "x", "guidance_scale": NaN, "size": "64x64"}', None, "NaN"),  # not JSON
    ],
)
def test_lone_surrogates_and_non_finite_numbers_are_400(http, raw, param, words):
    response = http.post("/v1/images/generations", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_overflowing_values_over_zeromq_are_bad_request_and_the_extremes_work(server, http):
    with Client(server.endpoint, timeout=60) as client:
        for fields, field in (({"seed": -1}, "seed"), ({"output_file_name": "b" * 300}, "output_file_name")):
            with pytest.raises(ServerError) as refused:
                client.submit(prompt="x", width=64, height=64, num_inference_steps=1, **fields)
            assert refused.value.code == "bad_request" and field in refused.value.message
        for seed in (2**64 - 1, 2**63):  # the largest seeds are served
            result = client.generate(prompt="x", width=64, height=64, num_inference_steps=1, seed=seed, timeout=120)
            assert result.job.state == "completed" and result.files[0].data.startswith(b"\x89PNG")
        assert client.health().status == "serving"
    largest = http.post("/v1/images/generations", json={**IMAGE, "prompt": "x", "seed": 2**64 - 2, "n": 2})
    assert largest.status_code == 200 and len(largest.json()["data"]) == 2
    values = metric_values(http.get("/metrics").text)
    errors = {
        labels: v
        for (name, labels), v in values.items()
        if name == "tilecast_http_requests_total" and ("status", "500") in labels
    }
    assert not errors, errors


# ---------------------------------------------------------------------------------------------
# 13. A disconnected client's jobs are cancelled
# ---------------------------------------------------------------------------------------------
def job_counts(client: Client) -> dict[str, int]:
    return dict(client.stats()["jobs"])


@pytest.mark.timeout(120)
def test_disconnected_clients_jobs_are_cancelled(server, http):
    """Four n=10 requests aborted by their clients (0.5 s timeout): all 40 jobs end cancelled within
    seconds, none left queued or running (each would take seconds: 500 steps)."""
    with Client(server.endpoint, timeout=30) as client:
        before = job_counts(client)
        request = {
            "prompt": "a long one",
            "n": 10,
            "size": "64x64",
            "num_inference_steps": 500,
            "response_format": "b64_json",
        }

        def abort(index: int) -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{server.url}/v1/images/generations",
                    json={**request, "seed": 100 * index},
                    headers={"Authorization": f"Bearer {API_KEY}"},
                    timeout=httpx.Timeout(30, read=0.5),
                )

        threads = [threading.Thread(target=abort, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)

        deadline = time.monotonic() + 10
        while True:
            counts = job_counts(client)
            new = {state: counts.get(state, 0) - before.get(state, 0) for state in counts}
            if sum(new.values()) >= 40 and new.get("queued", 0) == 0 and new.get("running", 0) == 0:
                break
            assert time.monotonic() < deadline, f"jobs of disconnected clients still alive: {new}"
            time.sleep(0.1)
    assert new.get("cancelled", 0) == 40 and new.get("completed", 0) == 0, new
    values = metric_values(http.get("/metrics").text)
    assert values[("tilecast_http_client_disconnects_total", ())] >= 4
