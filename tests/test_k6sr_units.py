"""Pure unit tests of the k6sr building blocks (no checkpoint, no video decode of the model)."""

from __future__ import annotations

import datetime
import random
from fractions import Fraction

import pytest
import torch

from tilecast.launcher.bench.k6sr import DenseSDPAProcessor
from tilecast.runtime.models.k6sr import params as P
from tilecast.runtime.models.k6sr.tiling import TileBlender, hann_window_2d, plan_tiles, split_scale, tile_starts
from tilecast.runtime.models.k6sr.video_io import MAX_FRAMES, floor_frame_count, select_frames


# ----------------------------------------------------------------------------- frame selection
def _is_one_plus_8k(n: int) -> bool:
    return n >= 1 and (n - 1) % 8 == 0


def test_frame_counts_floor_to_one_plus_8k_up_to_121():
    assert [floor_frame_count(n) for n in (1, 8, 9, 16, 17, 57, 120, 121, 122, 400)] == [
        1, 1, 9, 9, 17, 57, 113, 121, 121, 121,
    ]  # fmt: skip
    assert {floor_frame_count(n) for n in range(1, 200)} == set(range(1, MAX_FRAMES + 1, 8))
    with pytest.raises(ValueError, match="at least one frame"):
        floor_frame_count(0)


def test_select_frames_30fps_150_subsamples_to_24fps():
    indices, fps = select_frames(150, 30.0)
    assert fps == 24
    assert len(indices) <= MAX_FRAMES and _is_one_plus_8k(len(indices))
    assert len(indices) == 113  # 120 timestamps at 24 fps in 5 s, floored to 1 + 8k
    # frame k is the source frame nearest to k / 24 s
    for k, index in enumerate(indices):
        assert abs(index / 30.0 - k / 24.0) <= 0.5 / 30.0 + 1e-9
    assert indices == sorted(set(indices))


@pytest.mark.parametrize(
    "fps, written_at",
    [(22.6, 23), (23.0, 23), (24000 / 1001, 24), (24.0, 24), (24.5, 24), (25.0, 25), (25.4, 25)],
)
def test_select_frames_near_24_keeps_every_frame_at_the_rounded_rate(fps, written_at):
    indices, out_fps = select_frames(60, fps)
    assert out_fps == written_at and isinstance(out_fps, Fraction)
    assert indices == list(range(57))  # 60 -> 1 + 8 * 7


def test_select_frames_near_24_is_strictly_within_one_and_a_half_fps():
    assert select_frames(60, 25.5)[1] == 24 and len(select_frames(60, 25.5)[0]) == 49  # faster: subsampled
    assert select_frames(60, 22.5) == (list(range(57)), None)  # slower: native rate


def test_select_frames_slow_source_keeps_native_rate_and_caps_length():
    indices, out_fps = select_frames(400, 12.0)
    assert out_fps is None and indices == list(range(121))
    indices, out_fps = select_frames(400, 60.0)
    assert out_fps == 24 and len(indices) == 121 and indices[:4] == [0, 3, 5, 8]  # 2.5 rounds half up


def test_select_frames_short_clips():
    assert select_frames(1, 30.0)[0] == [0]
    assert select_frames(5, 24.0)[0] == [0]
    assert select_frames(8, 24.0)[0] == [0]
    assert select_frames(9, 24.0)[0] == list(range(9))
    assert select_frames(14, 12.0) == (list(range(9)), None)


# ----------------------------------------------------------------------------- tiling
def test_tile_starts_match_diffusers_rule():
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_sr import _tile_positions

    rng = random.Random(0)
    for _ in range(500):
        snap = rng.choice([8, 16])
        tile = snap * rng.randint(1, 40)
        length = snap * rng.randint(1, 200)
        overlap = rng.choice([0.0, 0.1, 0.2, 0.25, 0.5, 0.9])
        assert tile_starts(length, tile, overlap, snap) == _tile_positions(length, tile, overlap, snap)


def test_tile_starts_cover_with_overlap():
    starts = tile_starts(1280, 256, 0.2, 16)
    assert starts[0] == 0 and starts[-1] == 1280 - 256
    assert all(b - a <= 256 * 0.8 for a, b in zip(starts, starts[1:]))


def test_hann_window_matches_diffusers_and_is_positive():
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_sr import _hann_window_2d

    window = hann_window_2d(128, 256)
    assert torch.equal(window, _hann_window_2d(128, 256, torch.device("cpu")))
    assert window.min() > 0


def test_blender_of_identical_tiles_is_identity():
    plan = plan_tiles(96, 160, tiling_scale=2, tile_sizes=((128, 128),), min_overlap=0.2, snap=16)
    assert plan.num_tiles > 2
    blender = TileBlender(plan, batch_size=1, num_frames=1, device="cpu")
    for index in range(plan.num_tiles):
        blender.add(index, torch.full((3, 1, 128, 128), 0.25))
    assert torch.allclose(blender.result(), torch.full((1, 3, 1, 192, 320), 0.25))


def test_plan_refuses_video_smaller_than_a_tile():
    with pytest.raises(ValueError, match="at least 64x64"):
        plan_tiles(48, 64, tiling_scale=2, tile_sizes=((128, 128),), min_overlap=0.2, snap=16)


def test_split_scale():
    assert split_scale(2) == (2, 1.0) and split_scale(4) == (4, 1.0) and split_scale(2.25) == (2, 1.125)
    with pytest.raises(ValueError, match="got 3"):
        split_scale(3)


# ----------------------------------------------------------------------------- request params
def test_params_reject_unknown_fields_and_video_bytes():
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"video": "abc"}, P.SRParams)
    assert msgspec.convert({"sr_resolution_scale": 2}, P.SRParams).sr_resolution_scale == 2


@pytest.mark.parametrize(
    "value, expected",
    [("hd", (1280, 720)), ("FullHD", (1920, 1080)), ("2k", (2560, 1440)), ("640x360", (640, 360)), (None, None)],
)
def test_parse_target_resolution(value, expected):
    assert P.parse_target_resolution(value) == expected


@pytest.mark.parametrize("value", ["4k", "640*360", "x360", "0x0", "wide"])
def test_parse_target_resolution_rejects(value):
    with pytest.raises(ValueError, match="sr_target_resolution"):
        P.parse_target_resolution(value)


def test_target_size_only_downscales():
    assert P.target_size(256, 128, (128, 128), "fit") == ((128, 64), False)
    assert P.target_size(256, 128, (1920, 1080), "fit") == ((256, 128), False)
    assert P.target_size(256, 128, (100, 50), "exact") == ((100, 50), False)
    assert P.target_size(256, 128, (300, 50), "exact") == ((256, 50), True)
    assert P.target_size(256, 128, (101, 51), "fit") == ((100, 50), False)  # even sizes for yuv420p
    with pytest.raises(ValueError, match="sr_target_resize_mode 'crop'"):
        P.target_size(256, 128, (100, 50), "crop")


def test_check_request_names_bad_values():
    for kwargs, pattern in [
        ({"sr_resolution_scale": 3.0}, "got 3.0"),
        ({"sr_tiles_batch_size": 0}, "sr_tiles_batch_size"),
        ({"sr_tile_min_overlap": 1.0}, "sr_tile_min_overlap"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"output_file_name": "../x.mp4"}, "path separators"),
        ({"sr_target_resize_mode": "stretch"}, "stretch"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            P.check_request(P.SRParams(**kwargs))


def test_default_output_name_is_stem_scale_and_local_time():
    at = datetime.datetime(2025, 1, 2, 3, 4, 5)
    assert (
        P.default_output_name("clip", P.SRParams(sr_resolution_scale=2.0, seed=7), at)
        == "clip_sr2x_20250102-030405.mp4"
    )
    assert P.default_output_name("clip", P.SRParams(), at) == "clip_sr2.25x_20250102-030405.mp4"
    assert P.default_output_name("clip", P.SRParams(sr_resolution_scale=4), at) == "clip_sr4x_20250102-030405.mp4"
    assert P.default_output_name("my  summer clip", P.SRParams(sr_resolution_scale=2), at) == (
        "my__summer_clip_sr2x_20250102-030405.mp4"
    )
    before = datetime.datetime.now().replace(microsecond=0)
    name = P.default_output_name("clip", P.SRParams(sr_resolution_scale=2))
    after = datetime.datetime.now()
    stamp = datetime.datetime.strptime(name.removeprefix("clip_sr2x_").removesuffix(".mp4"), "%Y%m%d-%H%M%S")
    assert before <= stamp <= after


def test_claim_output_path_never_takes_an_existing_file(tmp_path):
    from tilecast.runtime.models.k6sr.pipeline import claim_output_path

    (tmp_path / "clip.mp4").write_bytes(b"earlier output")
    first = claim_output_path(tmp_path, "clip.mp4")
    second = claim_output_path(tmp_path, "clip.mp4")
    assert (first.name, second.name) == ("clip-2.mp4", "clip-3.mp4")
    assert (tmp_path / "clip.mp4").read_bytes() == b"earlier output"
    assert first.is_file() and first.stat().st_size == 0  # reserved at once, for the writer to fill
    assert claim_output_path(tmp_path, "other.mp4") == tmp_path / "other.mp4"


# ----------------------------------------------------------------------------- attention processor
def _rope(num_tokens: int, head_dim: int) -> torch.Tensor:
    angles = torch.rand(num_tokens, 1, head_dim // 2) * 6.0
    cos, sin = torch.cos(angles), torch.sin(angles)
    return torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))


def test_dense_processor_matches_sdpa_and_column_sharding():
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttention

    from tilecast.runtime.models.k6sr.attention import K6SRDenseAttnProcessor

    torch.manual_seed(0)
    dim, head_dim, tokens = 192, 16, 40
    attn = Kandinsky6SRAttention(dim, head_dim).eval()
    x = torch.randn(2, tokens, dim)
    rope = _rope(tokens, head_dim)
    with torch.no_grad():
        expected = DenseSDPAProcessor()(attn, x, rope, None)  # diffusers' ops, torch SDPA
        attn.set_processor(K6SRDenseAttnProcessor())
        assert isinstance(attn.processor, K6SRDenseAttnProcessor)
        got = attn(x, rope, {})
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)

        # Tensor parallel: column-shard q/k/v (whole heads) and row-shard out_layer; partial sums add up.
        for num_shards in (2, 3, 4):
            width = dim // num_shards
            total = torch.zeros_like(expected)
            for shard in range(num_shards):
                rows = slice(shard * width, (shard + 1) * width)
                part = Kandinsky6SRAttention(dim, head_dim)
                part.query_norm.load_state_dict(attn.query_norm.state_dict())
                part.key_norm.load_state_dict(attn.key_norm.state_dict())
                for name in ("to_query", "to_key", "to_value"):
                    full = getattr(attn, name)
                    linear = torch.nn.Linear(dim, width)
                    linear.weight.copy_(full.weight[rows])
                    linear.bias.copy_(full.bias[rows])
                    setattr(part, name, linear)
                out_layer = torch.nn.Linear(width, dim, bias=False)
                out_layer.weight.copy_(attn.out_layer.weight[:, rows])
                part.out_layer = out_layer
                part.set_processor(K6SRDenseAttnProcessor())
                total += part(x, rope, {})
            total += attn.out_layer.bias
            assert torch.allclose(total, expected, atol=1e-5, rtol=1e-5), num_shards


def test_install_dense_attention_replaces_every_layer():
    from diffusers import Kandinsky6SRTransformer3DModel

    from tilecast.runtime.models.k6sr.attention import K6SRDenseAttnProcessor, dense_processors, install_dense_attention
    from tilecast.runtime.models.k6sr.tiny import TRANSFORMER_CONFIG

    model = Kandinsky6SRTransformer3DModel(**{**TRANSFORMER_CONFIG, "num_visual_blocks": 3})  # tiny/k6sr's, 3 blocks
    assert install_dense_attention(model, backend="torch_sdpa") == 3
    processors = dense_processors(model)
    assert len(processors) == 3 and all(isinstance(p, K6SRDenseAttnProcessor) for p in processors)
    assert {p.backend for p in processors} == {"torch_sdpa"}
