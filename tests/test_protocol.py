"""Wire protocol: round trips, tensors as frames, and a corpus of malformed messages that a live
server must survive."""

from __future__ import annotations

import re

import msgspec
import pytest
import torch
import zmq

from tests.harness import plain_socket
from tilecast.client import Client
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.inproc import InProcessServer
from tilecast.scheduler import protocol as P


@pytest.mark.parametrize(
    "msg",
    [
        P.SubmitRequest(
            req_id=7, params={"prompt": "a cat", "width": 64, "scale": 2.25, "tags": [1, 2]}, uploads=["video"]
        ),
        P.StatusRequest(req_id=1, job_id="job_x"),
        P.ResultRequest(req_id=2, job_id="job_y", wait=False, as_paths=True),
        P.CancelRequest(req_id=3, job_id="job_z"),
        P.HealthRequest(req_id=4),
        P.StatsRequest(req_id=5),
        P.ShutdownRequest(req_id=6),
        P.JobInfo(req_id=1, job_id="j", state="failed", error="boom", progress=0.5, queue_position=3),
        P.ResultReply(
            req_id=1,
            job=P.JobInfo(req_id=1, job_id="j", state="completed"),
            outputs=[P.OutputMeta(name="a.mp4", kind="file", mime="video/mp4", size=3)],
            info={"w": 1},
        ),
        P.HealthReply(req_id=1, status="serving", world_size=2, model="m"),
        P.StatsReply(req_id=1, stats={"jobs": {"queued": 1}}),
        P.ErrorReply(req_id=1, code="overloaded", message="full"),
    ],
)
def test_every_message_round_trips(msg):
    frames = P.encode(msg, b"payload")
    assert len(frames[0]) == 1
    decoded, payloads = P.decode(frames)
    assert decoded == msg
    assert payloads == [b"payload"]


def test_plan_round_trips_with_uploads():
    plan = P.Plan(seq=3, kind="run", items=[P.PlanItem(job_id="j", params={"a": 1.5}, uploads={"video": b"\x00\x01"})])
    assert P.decode_plan(P.encode_plan(plan)) == plan


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5, dtype=torch.bfloat16),
        torch.randn(4, 6)[:, ::2],  # non-contiguous
        torch.randn(2, 3, 4).permute(2, 0, 1),  # non-contiguous, 3-D
        torch.empty(0, 7),  # empty
        torch.tensor(2.5, dtype=torch.float64),  # 0-d
        torch.arange(10, dtype=torch.int64),
        torch.randint(0, 255, (2, 3), dtype=torch.uint8),
        torch.tensor([True, False]),
        torch.randn(3, dtype=torch.float16),
    ],
    ids=["bf16", "noncontig", "permuted", "empty", "scalar", "int64", "uint8", "bool", "fp16"],
)
def test_tensor_frames_round_trip(tensor):
    meta, data = P.tensor_to_frame("t", tensor)
    frames = P.encode(
        P.ResultReply(req_id=1, job=P.JobInfo(req_id=1, job_id="j", state="completed"), outputs=[meta]), data
    )
    reply, payloads = P.decode([bytes(f) for f in frames])
    back = P.frame_to_tensor(reply.outputs[0], payloads[0])
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_tensor_frame_with_wrong_length_is_refused():
    meta, data = P.tensor_to_frame("t", torch.randn(4))
    with pytest.raises(P.WireError, match="bytes for shape"):
        P.frame_to_tensor(meta, bytes(data)[:-1])


def test_protocol_imports_without_torch_for_clients():
    import subprocess
    import sys

    code = "import sys, tilecast.client; assert 'torch' not in sys.modules and 'diffusers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


MALFORMED = [
    [],
    [b""],
    [b"S"],
    [b"S", b"\xc1"],  # msgpack's never-used byte
    [b"S", b"garbage that is not msgpack"],
    [b"Z", msgspec.msgpack.encode([1])],  # unknown type byte
    [b"SS", msgspec.msgpack.encode([1, {}])],  # multi-byte type
    [b"S", msgspec.msgpack.encode([1])],  # truncated submit (no params)
    [b"S", msgspec.msgpack.encode(["one", {}])],  # wrong type for req_id
    [b"S", msgspec.msgpack.encode([1, {}, [], None, "extra"])],  # unknown trailing field
    [b"S", msgspec.msgpack.encode([1, "not-a-map"])],
    [b"S", msgspec.msgpack.encode([1, {"size": 2}, ["video"]])],  # upload name without its frame
    [b"S", msgspec.msgpack.encode([1, {"size": "two"}])],  # a field of the wrong type
    [b"S", msgspec.msgpack.encode([1, {"no_such_field": 1}])],  # unknown request field
    [b"Q", msgspec.msgpack.encode([1, 42])],
    [b"R", msgspec.msgpack.encode({"req_id": 1})],  # a map where an array is expected
    [b"j", msgspec.msgpack.encode([1, "j", "queued"])],  # a reply type sent to the server
    [b"Q", msgspec.msgpack.encode([1, "job_unknown"])],  # well-formed, unknown job
]


@pytest.fixture
def small_server(tmp_path):
    config = ServeConfig(model_path="test/allreduce", device="cpu", port=0, output_dir=tmp_path, max_message_mb=0.01)
    with InProcessServer(config) as server:
        yield server


@pytest.mark.timeout(60)
def test_malformed_corpus_gets_errors_and_server_keeps_serving(small_server):
    with plain_socket(small_server.endpoint, receive_timeout_ms=5000) as sock:
        for frames in MALFORMED:
            if not frames:
                continue  # ZeroMQ cannot send an empty multipart message
            sock.send_multipart(frames)
            reply_frames = sock.recv_multipart()
            if frames[0] == b"":  # an empty first frame is a REQ-style envelope: the reply carries it back
                assert reply_frames[0] == b""
                reply_frames = reply_frames[1:]
            reply, _ = P.decode(reply_frames)
            assert isinstance(reply, P.ErrorReply), (frames, reply)
            assert reply.code in {"bad_request", "not_found"}, reply
            assert reply.message
        # Over --max-message-mb (10 KiB here): an error reply naming the limit, nothing processed.
        sock.send_multipart([b"S", msgspec.msgpack.encode([7, {"size": 2}, ["video"]]), b"x" * 15_000])
        reply, _ = P.decode(sock.recv_multipart())
        assert isinstance(reply, P.ErrorReply) and reply.req_id == 7 and reply.code == "bad_request", reply
        assert "15017 bytes, over this server's limit of 10485 bytes (--max-message-mb)" in reply.message
        # Over twice the limit ZeroMQ drops the frame with the connection before it is buffered.
        with plain_socket(small_server.endpoint) as big:
            big.send_multipart([b"S", b"x" * 50_000])
            assert big.poll(500) == 0  # no reply: the server dropped it
    with Client(small_server.endpoint) as client:
        assert client.health().status == "serving"
        result = client.generate(size=2, seed=3, timeout=30)
        assert result.job.state == "completed"
        assert client.stats()["jobs"]["completed"] == 1


@pytest.mark.timeout(60)
def test_req_sockets_get_replies(small_server):
    with plain_socket(small_server.endpoint, zmq.REQ, receive_timeout_ms=5000) as sock:
        sock.send_multipart(P.encode(P.HealthRequest(req_id=5)))
        reply, _ = P.decode(sock.recv_multipart())
        assert isinstance(reply, P.HealthReply) and reply.req_id == 5 and reply.status == "serving"
        sock.send_multipart([b"Z", b"junk"])  # REQ's strict send/receive turns: a malformed message is answered too
        reply, _ = P.decode(sock.recv_multipart())
        assert isinstance(reply, P.ErrorReply) and reply.code == "bad_request"


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(seed=2**64), "seed = 18446744073709551616 does not fit in 64 bits"),
        (dict(seed=-(2**63) - 1), "seed = -9223372036854775809 does not fit in 64 bits"),
        (dict(prompt="a \ud800 cat"), "prompt is not valid UTF-8 text"),
        (dict(extra={"tags": ["ok", "\udfff"]}), "extra.tags[1] is not valid UTF-8 text"),
    ],
)
def test_client_names_a_field_the_wire_cannot_carry(fields, named):
    """Both clients refuse before sending (no server at this endpoint: nothing is sent)."""
    import asyncio

    from tilecast.client import AsyncClient

    with Client("tcp://127.0.0.1:9", timeout=1.0) as client:
        with pytest.raises(ValueError, match=re.escape(named)):
            client.submit(**({"prompt": "p"} | fields))

    async def submit_async():
        async with AsyncClient("tcp://127.0.0.1:9", timeout=1.0) as client:
            await client.submit(**({"prompt": "p"} | fields))

    with pytest.raises(ValueError, match=re.escape(named)):
        asyncio.run(submit_async())
