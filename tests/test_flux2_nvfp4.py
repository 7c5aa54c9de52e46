"""FLUX.2-dev-NVFP4: BFL-format NVFP4 transformer weights next to the FLUX.2-dev base pipeline
(``families.flux2_nvfp4``), on the tiny checkpoints, one CPU rank.

Loading is exact: the served pipeline equals ``tiny/flux.2-dev`` whose transformer holds the file's
weights dequantized independently (diffusers' ``dequantize_nvfp4`` per BFL tensor, then diffusers'
BFL key conversion) within ``EXACT_TOL`` (measured: 0.0); and quantization really happened: the
output differs from the unquantized base's (measured max abs 3.7e-3 on the [0, 1] image at 2
steps, mean 4e-4: the tiny random network's output hardly depends on its blocks) and the weights by
up to 1/6 of a block's largest value (half a step of E2M1's top interval, 4 to 6).
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from tests.harness import make_context
from tilecast.runtime.models.families import flux2_nvfp4
from tilecast.runtime.models.families.flux2 import TINY_FLUX2, Flux2T2IPipeline
from tilecast.runtime.models.families.flux2_nvfp4 import RELEASED_FILE, TINY_FLUX2_NVFP4, Flux2NVFP4T2IPipeline
from tilecast.runtime.pipeline import WorkItem
from tilecast.runtime.registry import resolve_pipeline

EXACT_TOL = 1e-5
"""Max abs difference between the served NVFP4 pipeline and the base with the dequantized weights."""


def tiny_flux2_weights(cache) -> dict[str, torch.Tensor]:
    """``tiny/flux.2-dev``'s transformer weights, as saved."""
    from safetensors.torch import load_file

    return load_file(str(TINY_FLUX2.ensure(cache) / "transformer" / "diffusion_pytorch_model.safetensors"))


def _image(pipe, ctx, job: str = "j") -> torch.Tensor:
    params = pipe.prepare(
        pipe.params_type(
            prompt="a harbour at dawn", seed=3, width=32, height=32, num_inference_steps=2, return_tensor=True
        ),
        {},
    )
    return pipe.run([WorkItem(job_id=job, params=params)], ctx)[0].tensors["image"]


@pytest.fixture(scope="module")
def served(tiny_cache, tmp_path_factory):
    """The built-in pair ``tiny/flux.2-dev-nvfp4`` loaded, its load log, and its image."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(flux2_nvfp4.__name__)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        ctx = make_context(tmp_path_factory.mktemp("nvfp4"), dtype="float32")
        pipe = Flux2NVFP4T2IPipeline.load("tiny/flux.2-dev-nvfp4", ctx)
    finally:
        logger.removeHandler(handler)
    return pipe, ctx, [r.getMessage() for r in records], _image(pipe, ctx)


# ---- the tiny checkpoint --------------------------------------------------------------------


def test_bfl_names_round_trip_through_diffusers_conversion():
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    from tilecast.runtime.models.families.flux2 import tiny_transformer

    state = tiny_transformer(guidance_embeds=True).state_dict()
    bfl = flux2_nvfp4.bfl_state_dict(state)
    assert "double_blocks.0.img_attn.qkv.weight" in bfl and "single_blocks.0.norm.key_norm.scale" in bfl
    back = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    assert set(back) == set(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_tiny_nvfp4_file_is_byte_identical_on_every_build_and_laid_out_as_released(tiny_cache, tmp_path):
    from safetensors import safe_open

    first = TINY_FLUX2_NVFP4.ensure(tiny_cache)
    second = TINY_FLUX2_NVFP4.ensure(tmp_path)
    assert [p.name for p in first.iterdir() if not p.name.startswith(".")] == [RELEASED_FILE]
    assert (first / RELEASED_FILE).read_bytes() == (second / RELEASED_FILE).read_bytes()
    with safe_open(str(first / RELEASED_FILE), framework="pt") as handle:
        qkv = "double_blocks.0.img_attn.qkv"
        assert handle.get_tensor(f"{qkv}.weight").dtype == torch.uint8
        assert handle.get_tensor(f"{qkv}.weight").shape == (96, 16)  # 3 x 32 rows, 32 values packed in 16 bytes
        assert handle.get_tensor(f"{qkv}.weight_scale").dtype == torch.float8_e4m3fn
        assert handle.get_tensor(f"{qkv}.weight_scale_2").shape == ()
        assert handle.get_tensor(f"{qkv}.input_scale").shape == ()
        assert handle.get_tensor("img_in.weight").dtype == torch.bfloat16  # kept BF16, as released


# ---- served ---------------------------------------------------------------------------------


def test_builtin_pair_serves_t2i_dequantized_on_cpu_and_says_so(served):
    pipe, _ctx, log, image = served
    assert type(pipe.pipe.transformer.transformer_blocks[0].attn.to_q) is torch.nn.Linear
    assert pipe.pipe.transformer.transformer_blocks[0].attn.to_q.weight.dtype == torch.float32
    assert image.shape == (3, 32, 32) and torch.isfinite(image).all() and image.std() > 0.01
    said = [line for line in log if "dequantized" in line]
    assert len(said) == 1, log
    assert "10 NVFP4 layers to float32 at load on cpu (cpu has no FP4 tensor cores)" in said[0]


def test_merged_batch_and_reference_images_as_flux2_dev(served):
    from tilecast.runtime.models.families import images

    pipe, ctx, _log, image = served
    fields = dict(width=32, height=32, num_inference_steps=2, return_tensor=True)
    a = pipe.prepare(pipe.params_type(prompt="a harbour at dawn", seed=3, **fields), {})
    b = pipe.prepare(pipe.params_type(prompt="a red cat", seed=4, **fields), {})
    merged = pipe.run([WorkItem(job_id="a", params=a), WorkItem(job_id="b", params=b)], ctx)
    assert merged[0].info["batch_size"] == 2
    assert (merged[0].tensors["image"] - image).abs().max() <= 1e-4
    uploads = {"image.0": images.example_image(64, 64)}
    edit = pipe.prepare(pipe.params_type(prompt="make it blue", seed=3, **fields), uploads)
    edited = pipe.run([WorkItem(job_id="edit", params=edit, uploads=uploads)], ctx)[0].tensors["image"]
    assert edited.shape == (3, 32, 32) and (edited - image).abs().max() > 1e-3


def _dequantized_base(tiny_cache, tmp_path):
    """``tiny/flux.2-dev`` whose transformer holds the NVFP4 file's weights, dequantized tensor by
    tensor with diffusers' ``dequantize_nvfp4`` and renamed by diffusers' BFL conversion."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    from diffusers.quantizers.bfl.utils import dequantize_nvfp4
    from safetensors.torch import load_file

    tensors = load_file(str(TINY_FLUX2_NVFP4.ensure(tiny_cache) / RELEASED_FILE))
    weights = {}
    for name, value in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            continue
        prefix = name.removesuffix(".weight")
        if value.dtype == torch.uint8:
            value = dequantize_nvfp4(value, tensors[f"{prefix}.weight_scale"], tensors[f"{prefix}.weight_scale_2"])
        weights[name] = value.float()
    ctx = make_context(tmp_path, dtype="float32")
    base = Flux2T2IPipeline.load("tiny/flux.2-dev", ctx)
    unquantized = _image(base, ctx, "base")
    base.pipe.transformer.load_state_dict(convert_flux2_transformer_checkpoint_to_diffusers(weights), strict=True)
    return base, ctx, unquantized


def test_loading_is_exact_and_quantization_really_happened(served, tiny_cache, tmp_path):
    _pipe, _ctx, _log, image = served
    base, ctx, unquantized = _dequantized_base(tiny_cache, tmp_path)
    exact = (image - _image(base, ctx, "dequantized")).abs().max().item()
    assert exact <= EXACT_TOL, f"NVFP4 load differs from the dequantized weights by {exact:.3g}"
    moved = (image - unquantized).abs().max().item()
    assert 10 * EXACT_TOL < moved < 0.05, f"NVFP4 output moved by {moved:.3g} from the unquantized base's"
    # the weights: 4-bit values, at most half a step of E2M1's top interval (1/6 of a block's largest) away
    ours = served[0].pipe.transformer.transformer_blocks[0].attn.to_q.weight
    unquantized_q = tiny_flux2_weights(tiny_cache)["transformer_blocks.0.attn.to_q.weight"]
    error = (ours - unquantized_q).abs().max().item() / unquantized_q.abs().max().item()
    assert 0.01 < error <= 1 / 6 + 1e-3, error


def test_base_model_path_and_transformer_weights_path_serve_the_same(served, tiny_cache, tmp_path):
    """What a user passes: ``--model-path <FLUX.2-dev> --transformer-weights-path <the NVFP4 folder or file>``."""
    _pipe, _ctx, _log, image = served
    folder = TINY_FLUX2_NVFP4.ensure(tiny_cache)
    for weights in (folder, folder / RELEASED_FILE):
        ctx = make_context(tmp_path / weights.name, dtype="float32", transformer_weights_path=str(weights))
        pipe = resolve_pipeline("tiny/flux.2-dev").load("tiny/flux.2-dev", ctx)
        assert torch.equal(_image(pipe, ctx), image)


# ---- refusals -------------------------------------------------------------------------------


def test_nvfp4_folder_alone_is_refused_saying_what_to_pass(tiny_cache, tmp_path):
    released = tmp_path / "FLUX.2-dev-NVFP4"  # the release: the transformer file alone
    shutil.copytree(TINY_FLUX2_NVFP4.ensure(tiny_cache), released)
    from tilecast.runtime.topology import model_limits

    for route in (resolve_pipeline, model_limits):  # the registry, and the launcher's head count before it
        with pytest.raises(ValueError, match="--transformer-weights-path, with their base pipeline as --model-path"):
            route(str(released))
    family = resolve_pipeline(str(released), model_id="black-forest-labs/FLUX.2-dev-NVFP4")
    assert family is Flux2T2IPipeline
    with pytest.raises(
        ValueError, match="pass the base pipeline as --model-path and this as --transformer-weights-path"
    ):
        family.load(str(released), make_context(tmp_path / "out", dtype="float32"))


@pytest.mark.parametrize("dropped", ["weight_scale_2", "input_scale"])
def test_a_broken_nvfp4_file_is_refused_naming_the_tensor(dropped, tiny_cache, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(TINY_FLUX2_NVFP4.ensure(tiny_cache) / RELEASED_FILE))
    del tensors[f"single_blocks.0.linear1.{dropped}"]
    broken = tmp_path / RELEASED_FILE
    save_file(tensors, str(broken))
    ctx = make_context(tmp_path / "out", dtype="float32", transformer_weights_path=str(broken))
    with pytest.raises(ValueError, match=rf"single_blocks\.0\.linear1\.{dropped} is missing"):
        Flux2T2IPipeline.load("tiny/flux.2-dev", ctx)


def test_a_folder_of_several_files_must_name_one(tiny_cache, tmp_path):
    (tmp_path / "a.safetensors").touch()
    (tmp_path / "flux2-dev-nvfp4-mixed.safetensors").touch()
    with pytest.raises(ValueError, match="name the file"):
        flux2_nvfp4.weights_file(tmp_path)


def test_other_families_refuse_transformer_weights_path(tmp_path):
    from tilecast.runtime.config import UnsupportedSettingError
    from tilecast.runtime.models.families.flux2_klein import Flux2KleinT2IPipeline

    ctx = make_context(tmp_path, dtype="float32", transformer_weights_path=str(tmp_path))
    with pytest.raises(UnsupportedSettingError, match="--transformer-weights-path"):
        Flux2KleinT2IPipeline.load("tiny/flux.2-klein-4b", ctx)


# ---- devices and routing --------------------------------------------------------------------


def test_fp4_gemms_only_on_blackwell_with_flashinfer(monkeypatch):
    import diffusers.utils

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: (9, 0))
    assert "compute capability 9.0) has no FP4 tensor cores" in flux2_nvfp4.fp4_unavailable(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: (10, 0))
    monkeypatch.setattr(diffusers.utils, "is_flashinfer_available", lambda: False)
    assert "flashinfer" in flux2_nvfp4.fp4_unavailable(cuda)
    monkeypatch.setattr(diffusers.utils, "is_flashinfer_available", lambda: True)
    assert flux2_nvfp4.fp4_unavailable(cuda) is None
    assert flux2_nvfp4.fp4_unavailable(torch.device("cpu")) == "cpu has no FP4 tensor cores"


def test_routing(tiny_cache, tmp_path):
    assert resolve_pipeline("tiny/flux.2-dev-nvfp4") is Flux2NVFP4T2IPipeline
    assert resolve_pipeline(str(tmp_path), model_id="black-forest-labs/FLUX.2-dev-NVFP4") is Flux2T2IPipeline
    base = tmp_path / "FLUX.2-dev"  # the base a user names as --model-path
    shutil.copytree(TINY_FLUX2.ensure(tiny_cache), base)
    assert json.loads((base / "model_index.json").read_text())["_class_name"] == "Flux2Pipeline"
    assert resolve_pipeline(str(base)) is Flux2T2IPipeline
    assert Flux2NVFP4T2IPipeline.ensure_builtin(tiny_cache) == TINY_FLUX2.ensure(tiny_cache)
