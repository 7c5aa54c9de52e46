"""Kandinsky 6 SR through the scheduler and the client library: each bad input gets its own clear
error at submit, and the server then serves a good request."""

from __future__ import annotations

import re

import pytest

from tests.media import write_test_video
from tilecast.client import Client, ServerError
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.inproc import InProcessServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    config = ServeConfig(
        model_path="tiny/k6sr",
        device="cpu",
        port=0,
        output_dir=tmp_path_factory.mktemp("out"),
        allowed_video_dirs=(allowed,),
    )
    with InProcessServer(config) as srv:
        yield srv, allowed


@pytest.mark.timeout(180)
def test_bad_inputs_get_errors_then_a_good_request_is_served(server, tmp_path):
    srv, allowed = server
    good = write_test_video(allowed / "good.mp4", 64, 64, 9, 24.0)
    tiny = write_test_video(allowed / "tiny.mp4", 16, 16, 5, 24.0)
    outside = write_test_video(tmp_path / "outside.mp4", 64, 64, 9, 24.0)
    truncated = good.read_bytes()[: len(good.read_bytes()) // 3]
    cases = {
        "not a video": (dict(video=b"this is plain text, not an mp4"), "video"),
        "truncated mp4": (dict(video=truncated), "video"),
        "smaller than one tile": (dict(video_path=str(tiny), sr_resolution_scale=2), "tile"),
        "scale 3": (dict(video_path=str(good), sr_resolution_scale=3), "sr_resolution_scale"),
        "bad target resolution": (dict(video_path=str(good), sr_target_resolution="huge"), "sr_target_resolution"),
        "outside allowed dirs": (dict(video_path=str(outside)), "allowed"),
        "dot-dot escape": (dict(video_path=str(allowed / ".." / outside.parent.name / outside.name)), "allowed"),
        "unknown field": (dict(video_path=str(good), sr_scale=2), "sr_scale"),
        "wrong type": (dict(video_path=str(good), seed="forty-two"), "seed"),
    }
    with Client(srv.endpoint) as client:
        for label, (fields, needle) in cases.items():
            with pytest.raises(ServerError) as err:
                client.submit(**fields)
            assert err.value.code == "bad_request", label
            assert needle in err.value.message, (label, err.value.message)
        result = client.generate(video_path=str(good), sr_resolution_scale=2, seed=1, timeout=120)
        assert result.job.state == "completed"
        assert result.info["width"] == 128 and result.info["height"] == 128
        assert result.info["num_frames"] == 9 and result.info["fps"] == 24.0
        (output,) = result.files
        assert re.fullmatch(r"good_sr2x_\d{8}-\d{6}\.mp4", output.name), output.name
        assert client.stats()["jobs"]["completed"] == 1
