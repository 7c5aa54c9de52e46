"""What the tests of the row-band VAE decodes (``runtime/models/families/row_band_decode.py`` and the
families' ``wan_decode``, ``hunyuan_decode``, ``ltx2_decode``) share; each test file keeps its
VAE, its measured numbers and its tolerance.

- :class:`Case`: one family's tiny VAE, latents and bounds.
- :func:`check_parallel_decode`: the decode on gloo ranks against diffusers' serial ``vae.decode`` of
  the same latents in the test process (on one thread, like the ranks): every rank returns the same
  video, twice; a decoder restored after; a replicated fallback equal to serial; PSNR and max
  difference of the uint8 frames, float max |diff|, the float64 decode's (where the case asks);
  bands decoded alone, without the sharding, must be off by more than ``SEAM_FLOOR``.
- :func:`check_pipeline_decode`: a family served on 2 ranks whose decode group spans both (Ulysses
  degree 2: one DP replica of 2 ranks; the DiT runs replicated) with
  ``--vae-config.use-parallel-decode`` against the same rank's serial pipeline.
- :func:`check_single_rank_and_tiling`: one rank decodes serially, diffusers' tiling is refused.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import one_thread, run_ranks
from tests.test_spatial_shard import psnr_and_max_diff, to_uint8
from tilecast.kernels.halo import split_sizes

TIMEOUT = 120
PSNR_BOUND_DB = 60.0
MAX_DIFF_BOUND = 1  # uint8 levels
FLOAT64_BOUND = 1e-12
"""The same decode in float64: the sharded arithmetic is the serial one up to rounding."""
SEAM_FLOOR = 1e-2
"""Bands decoded without the sharding must differ from serial by more than this (the test sees seams)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One family's decode under test. The callables are module-level functions (the ranks unpickle
    them by name)."""

    label: str
    """The family in the printed numbers."""
    module: str
    """Its decode module under ``tilecast.runtime.models.families``."""
    tiny_vae: Callable[[], Any]
    """The VAE with seeded weights."""
    latents: Callable[[int, int], torch.Tensor]
    """``latents(rows, latent_frames)``, seeded."""
    changed: Callable[[Any], list[str]]
    """Decoder modules the sharded decode left changed (hooks, forwards, paddings)."""
    rows: int
    latent_frames: int
    scale: int
    """Pixel rows per latent row."""
    float_bound: float
    short_frames: int = 2
    """Latent frames of the replicated fallback (one latent row per rank)."""
    float64: bool = True
    """Also decode in float64 (within ``FLOAT64_BOUND`` of serial float64)."""
    preload: tuple[str, ...] = ()
    extra: Callable[[Any], dict] | None = None
    """``extra(group)`` on every rank after the checks' decodes: more results to compare."""

    def decode_spatial_shard(self) -> Callable[..., torch.Tensor]:
        return importlib.import_module(f"tilecast.runtime.models.families.{self.module}").decode_spatial_shard

    def serial_decode(self, rows: int, latent_frames: int) -> torch.Tensor:
        with torch.no_grad(), one_thread():
            return self.tiny_vae().decode(self.latents(rows, latent_frames), return_dict=False)[0]


def _decode_rank(rank, world_size, case: Case) -> dict:
    import torch.distributed as dist

    decode = case.decode_spatial_shard()
    vae = case.tiny_vae()
    group = dist.group.WORLD
    with torch.no_grad():
        videos = [decode(vae, case.latents(case.rows, case.latent_frames), group) for _ in range(2)]
        short = decode(vae, case.latents(world_size, case.short_frames), group)  # 1 row each: replicated
        sizes = split_sizes(case.rows, world_size)
        band = case.latents(case.rows, case.latent_frames).narrow(3, sum(sizes[:rank]), sizes[rank])
        unsharded_band = vae.decode(band, return_dict=False)[0]  # no sharding: what seams look like
        result = {"videos": videos, "short": short, "band": unsharded_band, "left": case.changed(vae)}
        if case.float64:
            result["float64"] = decode(vae.double(), case.latents(case.rows, case.latent_frames).double(), group)
        if case.extra is not None:
            result.update(case.extra(group))
    return result


def check_parallel_decode(case: Case, world_size: int) -> list[dict]:
    """The decode on ``world_size`` ranks against serial (module docstring); returns the ranks' results."""
    reference = case.serial_decode(case.rows, case.latent_frames)
    results = run_ranks(_decode_rank, world_size, case, timeout=TIMEOUT, preload=case.preload)
    video = results[0]["videos"][0]
    assert video.shape == reference.shape
    for rank, result in enumerate(results):
        assert result["left"] == [], f"rank {rank}: decoder not restored after the sharded decode: {result['left']}"
        for again in result["videos"]:
            assert torch.equal(again, video), f"rank {rank}: output differs from rank 0's or from its first decode"
        short_reference = case.serial_decode(world_size, case.short_frames)
        assert torch.equal(result["short"], short_reference), f"rank {rank}: replicated fallback"
    float_diff = (video - reference).abs().max().item()
    psnr, max_diff = psnr_and_max_diff(to_uint8(video), to_uint8(reference))
    sizes = split_sizes(case.rows, world_size)
    seams = max(
        (result["band"] - reference.narrow(3, case.scale * sum(sizes[:rank]), case.scale * sizes[rank]))
        .abs()
        .max()
        .item()
        for rank, result in enumerate(results)
    )
    exact = ""
    if case.float64:
        with torch.no_grad(), one_thread():
            serial64 = case.tiny_vae().double().decode(case.latents(case.rows, case.latent_frames).double())[0]
        exact_diff = (results[0]["float64"] - serial64).abs().max().item()
        exact = f"float64: {exact_diff:.3g}; "
    print(
        f"\n{case.label} parallel decode, {world_size} ranks, latent rows {sizes}, {reference.shape[2]} frames: "
        f"PSNR {psnr:.2f} dB, max diff {max_diff}/255, float max |diff| {float_diff:.3g}; "
        f"{exact}bands decoded alone: float max |diff| {seams:.3g}"
    )
    assert psnr >= PSNR_BOUND_DB and max_diff <= MAX_DIFF_BOUND and float_diff <= case.float_bound
    if case.float64:
        assert exact_diff <= FLOAT64_BOUND
    assert seams > SEAM_FLOOR
    return results


def _pipeline_rank(rank, world_size, cache, cls, stand_in, request: dict) -> dict:
    import torch.distributed as dist

    from tests.harness import make_context
    from tilecast.runtime.models.families import images
    from tilecast.runtime.pipeline import WorkItem
    from tilecast.runtime.topology import Topology

    os.environ["TILECAST_CACHE"] = cache
    topology = Topology(num_gpus=world_size, ulysses_degree=world_size)
    groups = topology.groups(topology.build_mesh("cpu"))
    uploads = {}
    if cls.min_images:
        uploads = dict(zip(images.upload_names(1), [images.example_image(request["width"], request["height"])]))
    outputs = {}
    for name, vae in (("serial", {}), ("parallel", {"use_parallel_decode": True})):
        # The mesh's Ulysses axis makes the decode group of all ranks; the settings keep the DiT degrees
        # at 1 (the families refuse --ulysses-degree until they honour it).
        ctx = make_context(
            Path(cache) / f"out{rank}",
            rank=rank,
            world_size=world_size,
            cpu_group=dist.group.WORLD,
            device_group=dist.group.WORLD,
            groups=groups,
            dtype="float32",
            vae=vae,
        )
        pipe = cls.load(cls.builtin_name, ctx)
        params = pipe.prepare(
            pipe.params_type(prompt="a red kite", seed=5, return_tensor=True, **request),
            uploads,
        )
        output = pipe.run([WorkItem(job_id=name, params=params, uploads=uploads)], ctx)[0]
        outputs[name] = output.tensors["video"]
        if "audio" in output.tensors:
            outputs[f"{name}_audio"] = output.tensors["audio"]
        outputs[f"{name}_installed"] = isinstance(vars(pipe.pipe.vae).get("decode"), stand_in)
        assert pipe.parallel_decode == outputs[f"{name}_installed"]
    return outputs


def check_pipeline_decode(
    cls, stand_in: type, cache: Path, request: dict, *, float_bound: float, preload: tuple[str, ...]
) -> None:
    """``cls`` (a pipeline class; its tiny checkpoint built here, not raced by the ranks) served on 2
    ranks with ``--vae-config.use-parallel-decode`` (installed: ``vae.decode`` is a ``stand_in``)
    and without: the frames of ``request`` (``width``, ``height``, ``num_frames``,
    ``num_inference_steps``; an input image where the family takes one) within ``float_bound``, the
    ranks equal, a soundtrack (decoded replicated) equal."""
    cls.checkpoint.ensure(cache)
    results = run_ranks(_pipeline_rank, 2, str(cache), cls, stand_in, request, timeout=TIMEOUT, preload=preload)
    for rank, result in enumerate(results):
        assert result["parallel_installed"] and not result["serial_installed"], rank
        assert result["parallel"].shape == (request["num_frames"], 3, request["height"], request["width"])
        assert torch.equal(result["parallel"], results[0]["parallel"]), f"rank {rank} differs from rank 0"
        if "parallel_audio" in result:
            assert torch.equal(result["parallel_audio"], result["serial_audio"]), rank  # decoded replicated
        diff = (result["parallel"] - result["serial"]).abs().max().item()
        print(f"\n{cls.__name__} rank {rank}: parallel vs serial decode, max |diff| {diff:.3g} on [0, 1] frames")
        assert diff <= float_bound, (rank, diff)


def check_single_rank_and_tiling(case: Case, latent_frames: int) -> None:
    """No group: the decode is diffusers' serial one, bit for bit; with diffusers' tiling on it refuses."""
    decode = case.decode_spatial_shard()
    vae = case.tiny_vae()
    with torch.no_grad(), one_thread():
        assert torch.equal(decode(vae, case.latents(8, latent_frames), None), case.serial_decode(8, latent_frames))
    vae.enable_tiling()
    with pytest.raises(ValueError, match="tiling"):
        decode(vae, case.latents(8, latent_frames), None)
