"""The batchable T2I/T2V families on their tiny checkpoints, one rank, no server.

A request's output inside a merged batch matches its singleton output within ``BATCH_TOL``
(fp32, max abs difference on the ``[0, 1]`` output; measured: FLUX ~2e-6, Qwen-Image ~8e-7,
Qwen-Image-2512 ~1e-6, Z-Image-Turbo ~2e-6, Z-Image ~2e-6, Wan2.1 ~3e-6, SD3 ~2e-6, SANA ~4e-7,
FLUX.2-dev ~3e-6, FLUX.2 [klein] ~3e-6, ERNIE-Image ~2e-6, ERNIE-Image-Turbo ~2e-6, HunyuanVideo ~3e-6,
Helios-Base ~2e-6, LTX-2 ~1e-6 video and ~1e-7 audio (``tests/test_ltx2.py``), Wan2.1 I2V ~1.4e-6,
Wan2.2 T2V A14B ~1.3e-6, Wan2.2 I2V A14B ~1.9e-6, Wan2.2 TI2V ~8e-7,
Qwen-Image-Edit ~8e-7, Qwen-Image-Layered ~1e-5): batch shape may change kernels,
the seeds do not change. Image-to-video families get their example input images (``example_uploads``),
the same for every request of a batch.
GLM-Image is served one request at a time (``max_batch_size = 1``): a merged ``GlmImagePipeline``
batch changes every request's picture (``test_glm_image_serves_singletons_because_merging_changes_each_request``);
so are Helios-Mid and -Distilled (``tests/test_hunyuan_helios.py`` says why) and Edit Plus, whose
diffusers pipeline takes one prompt per call (``tests/test_image_edit.py``).
A family whose ``required_modules`` cannot be imported (the Qwen image-edit families without
torchvision) is skipped, saying why.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from tests.harness import make_context, skip_without_required_modules, tiny_families
from tilecast.runtime.models.families.common import T2IParams, T2VParams
from tilecast.runtime.models.families.ernie_image import ErnieImageT2IPipeline, ErnieImageTurboT2IPipeline
from tilecast.runtime.models.families.flux import TINY_FLUX
from tilecast.runtime.models.families.flux2 import Flux2T2IPipeline
from tilecast.runtime.models.families.flux2_klein import Flux2KleinT2IPipeline
from tilecast.runtime.models.families.glm_image import GlmImageT2IPipeline
from tilecast.runtime.models.families.qwen_image import QwenImage2512T2IPipeline, QwenImageT2IPipeline
from tilecast.runtime.models.families.sana import SanaT2IPipeline
from tilecast.runtime.models.families.sd3 import SD3T2IPipeline
from tilecast.runtime.models.families.z_image import ZImageBaseT2IPipeline, ZImageT2IPipeline
from tilecast.runtime.pipeline import WorkItem
from tilecast.runtime.registry import resolve_pipeline

BATCH_TOL = 1e-4
"""Max abs difference between a request's batched and singleton fp32 output."""

FAMILIES = tiny_families()
"""Built-in name → family class: FLUX, Qwen-Image, Z-Image-Turbo, SD3, Wan2.1 T2V and any family declared later."""


@pytest.fixture(scope="module")
def loaded(tiny_cache, tmp_path_factory):
    """name -> (pipeline, ctx), loaded lazily once per module."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            ctx = make_context(tmp_path_factory.mktemp(name.replace("/", "-")), dtype="float32")
            cache[name] = (FAMILIES[name].load(name, ctx), ctx)
        return cache[name]

    return get


def params_for(pipe, **fields):
    """A prepared request of 32 x 32 pixels (or the family's smallest size, LTX-2's 64; a family whose
    size follows its input image, that size) with the family's example input images
    (``example_uploads``: an image-to-video family's first frame) and, for a video family, its
    shortest clip of more than one frame (Wan 5, LTX-2 9; a layered family: 2 layers), at two denoising
    steps unless ``fields`` say otherwise (the cards' 20..50 steps show nothing more here)."""
    fields.setdefault("num_inference_steps", min(2, pipe.default_steps))
    side = max(32, getattr(pipe, "min_side", 32))
    if not pipe.size_from_image:  # Qwen-Image-Layered: the size is its rule from the input image
        fields.setdefault("width", side)
        fields.setdefault("height", side)
    if "layers" in pipe.params_type.__struct_fields__:  # a layered family: the fewest layers above one
        fields.setdefault("layers", 2)
    if pipe.output_kind == "video":
        multiple, remainder = pipe.num_frames_rule
        fields.setdefault("num_frames", multiple + remainder)
    return pipe.prepare(pipe.params_type(**fields), pipe.example_uploads())


def work(pipe, job_id: str, params) -> WorkItem:
    """A work item of ``params`` with the family's example input images."""
    return WorkItem(job_id=job_id, params=params, uploads=pipe.example_uploads())


# ---- checkpoints ---------------------------------------------------------------------------


def test_tiny_checkpoint_is_byte_identical_on_every_build(tiny_cache, tmp_path):
    first = TINY_FLUX.ensure(tiny_cache)
    second = TINY_FLUX.ensure(tmp_path)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert {Path("model_index.json"), Path("tokenizer/tokenizer.json"), Path("tokenizer_2/tokenizer.json")} <= set(
        files
    )
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for rel in files:
        assert (first / rel).read_bytes() == (second / rel).read_bytes(), rel
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")], "staging dir left behind"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_builtin_name_and_checkpoint_directory_route_to_the_family(name, tiny_cache):
    cls = FAMILIES[name]
    skip_without_required_modules(cls)
    assert resolve_pipeline(name) is cls
    directory = cls.checkpoint.ensure(tiny_cache)
    assert json.loads((directory / "model_index.json").read_text())["_class_name"] == cls.diffusers_class
    assert resolve_pipeline(str(directory)) is cls


# ---- batch == singleton --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_batched_output_matches_singleton_and_files_are_written(name, loaded):
    skip_without_required_modules(FAMILIES[name])
    pipe, ctx = loaded(name)
    # An image-to-image family runs 2 steps, not its card's (50 on Qwen-Image-Edit): each run also
    # encodes its input image at about 1024 x 1024 pixels.
    steps = dict(num_inference_steps=2) if pipe.task == "i2i" else {}
    a = params_for(pipe, prompt="a red cat on a mat", seed=1, return_tensor=True, **steps)
    b = params_for(pipe, prompt="a blue dog, much longer prompt than the first", seed=2, return_tensor=True, **steps)
    alone = pipe.run([work(pipe, "alone", a)], ctx)[0]
    items = [work(pipe, "a", a), work(pipe, "b", b)]
    size = min(len(items), pipe.max_batch_size)  # a singleton-only family (GLM-Image) runs them one by one
    pair = [out for start in range(0, len(items), size) for out in pipe.run(items[start : start + size], ctx)]
    kind = pipe.output_kind
    x, y, other = alone.tensors[kind], pair[0].tensors[kind], pair[1].tensors[kind]
    expected_shape = (3, a.height, a.width) if kind == "image" else (a.num_frames, 3, a.height, a.width)
    if hasattr(a, "layers"):  # Qwen-Image-Layered: a stack of RGBA layers per request
        expected_shape = (a.layers, 4, a.height, a.width)
    assert tuple(x.shape) == expected_shape and x.dtype == torch.float32
    assert torch.isfinite(x).all() and 0.0 <= x.min() and x.max() <= 1.0 and x.std() > 0.01
    diff = (x - y).abs().max().item()
    assert diff <= BATCH_TOL, f"{name}: batched output differs from singleton by {diff:.3g}"
    assert (x - other).abs().max() > 0.01, "a different prompt and seed gave the same output"
    assert pair[0].info["batch_size"] == size
    # files: a readable PNG / MP4 of the requested size
    written = alone.files[0]
    if kind == "image":
        from PIL import Image

        assert written.mime == "image/png" and written.path.suffix == ".png"
        assert Image.open(written.path).size == (a.width, a.height)
    else:
        import av

        assert written.mime == "video/mp4"
        with av.open(str(written.path)) as container:
            frames = list(container.decode(video=0))
        assert len(frames) == a.num_frames and (frames[0].width, frames[0].height) == (a.width, a.height)


DIRECT_TOL = 1e-5
"""Max abs difference between tilecast's singleton output and the diffusers pipeline called directly
(fp32, CPU, the same seed): the same networks on the same inputs."""


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_output_equals_the_diffusers_pipeline_called_directly(name, loaded, tiny_cache):
    """tilecast's serving path (its fast paths, hooks, generators, defaults) against the family's
    diffusers class loaded from the same checkpoint and called with public arguments only."""
    import inspect

    import diffusers

    cls = FAMILIES[name]
    skip_without_required_modules(cls)
    pipe, ctx = loaded(name)
    params = params_for(pipe, prompt="a lighthouse at dusk", seed=5, num_inference_steps=2, return_tensor=True)
    item = work(pipe, "ours", params)
    ours = pipe.run([item], ctx)[0].tensors[pipe.output_kind]

    path = cls.checkpoint.ensure(tiny_cache)
    # a component the family leaves unloaded (Qwen-Image-Layered's captioning processor) is left out here too
    unloaded = {name: None for name, component in cls.own_components(path).items() if component is None}
    direct = getattr(diffusers, cls.diffusers_class).from_pretrained(str(path), **unloaded)
    direct.set_progress_bar_config(disable=True)
    accepted = inspect.signature(direct.__call__).parameters
    kwargs = dict(
        prompt=params.prompt,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(5),
        output_type="pt",
    )
    if "width" in accepted:  # Qwen-Image-Layered takes no size: its resolution bucket and input image decide
        kwargs.update(width=params.width, height=params.height)
    guidance = "true_cfg_scale" if cls.true_cfg_is_guidance else "guidance_scale"
    kwargs[guidance] = params.guidance_scale
    if pipe.guidance_on(params) and "negative_prompt" in accepted:
        kwargs["negative_prompt"] = cls.default_negative_prompt
    if "max_sequence_length" in accepted:
        kwargs["max_sequence_length"] = cls.max_sequence_length
    if pipe.output_kind == "video":
        kwargs["num_frames"] = params.num_frames
    # the family's own extra arguments (SANA's use_resolution_binning=False) are part of its declaration
    kwargs = {**pipe.call_kwargs(params), **kwargs}
    if "pyramid_num_inference_steps_list" in accepted:  # Helios' pyramid: steps per stage, Distilled's card
        del kwargs["num_inference_steps"]
        kwargs["pyramid_num_inference_steps_list"] = [2] * direct.scheduler.config.stages
        kwargs["is_amplify_first_chunk"] = direct.config.is_distilled
    if hasattr(pipe, "card_kwargs"):  # a card's recipe where diffusers' defaults differ (LTX-2: fps, guidance terms)
        kwargs.update(pipe.card_kwargs(params))
    if pipe.max_images and item.uploads:
        kwargs.update(pipe.image_kwargs([item]))  # the input images as diffusers' public arguments
    with torch.inference_mode():
        theirs = direct(**kwargs, return_dict=False)[0][0].float()
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    assert diff <= DIRECT_TOL, f"{name}: tilecast differs from diffusers' {cls.diffusers_class} by {diff:.3g}"


def test_seed_alone_decides_the_noise(loaded):
    pipe, ctx = loaded("tiny/flux")
    a = params_for(pipe, prompt="same", seed=7, return_tensor=True)
    b = params_for(pipe, prompt="same", seed=8, return_tensor=True)
    out = pipe.run(
        [WorkItem(job_id="a", params=a), WorkItem(job_id="b", params=b), WorkItem(job_id="c", params=a)], ctx
    )
    assert (out[0].tensors["image"] - out[2].tensors["image"]).abs().max() <= BATCH_TOL
    assert (out[0].tensors["image"] - out[1].tensors["image"]).abs().max() > 0.01


def test_output_file_name_and_jpeg(loaded):
    pipe, ctx = loaded("tiny/flux")
    params = params_for(pipe, prompt="x", output_format="jpeg", output_file_name="mine.jpg")
    out = pipe.run([WorkItem(job_id="j", params=params)], ctx)[0]
    assert (
        out.files[0].path == ctx.output_dir / "j" / "mine.jpg"
    )  # a folder per job and out.files[0].mime == "image/jpeg"
    assert out.files[0].path.read_bytes()[:2] == b"\xff\xd8" and not out.tensors


# ---- params, validation, batch keys --------------------------------------------------------


def test_defaults_are_resolved_in_prepare(loaded):
    flux, _ = loaded("tiny/flux")
    wan, _ = loaded("tiny/wan2.1-t2v")
    p = flux.prepare(T2IParams(prompt="x"), {})
    assert (p.width, p.height, p.num_inference_steps, p.guidance_scale, p.output_format) == (64, 64, 2, 3.5, "png")
    v = wan.prepare(T2VParams(prompt="x"), {})
    assert (v.num_frames, v.num_inference_steps, v.guidance_scale, v.output_format) == (5, 2, 5.0, "mp4")


# ---- released ids ------------------------------------------------------------------------
RELEASED_IDS = {
    "stabilityai/stable-diffusion-3-medium-diffusers": SD3T2IPipeline,
    "stabilityai/stable-diffusion-3.5-medium": SD3T2IPipeline,
    "stabilityai/stable-diffusion-3.5-large": SD3T2IPipeline,
    "stabilityai/stable-diffusion-3.5-large-turbo": SD3T2IPipeline,
    "zai-org/GLM-Image": GlmImageT2IPipeline,
    "GLM-Image": GlmImageT2IPipeline,
    "Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers": SanaT2IPipeline,
    "Efficient-Large-Model/SANA1.5_4.8B_1024px_diffusers": SanaT2IPipeline,
    "Efficient-Large-Model/Sana_1600M_1024px_diffusers": SanaT2IPipeline,
    "Efficient-Large-Model/Sana_600M_1024px_diffusers": SanaT2IPipeline,
    "Efficient-Large-Model/Sana_1600M_512px_diffusers": SanaT2IPipeline,
    "Efficient-Large-Model/Sana_600M_512px_diffusers": SanaT2IPipeline,
    "black-forest-labs/FLUX.2-dev": Flux2T2IPipeline,
    "black-forest-labs/FLUX.2-dev-NVFP4": Flux2T2IPipeline,
    "black-forest-labs/FLUX.2-klein-4B": Flux2KleinT2IPipeline,
    "black-forest-labs/FLUX.2-klein-9B": Flux2KleinT2IPipeline,
    "black-forest-labs/FLUX.2-klein-base-4B": Flux2KleinT2IPipeline,
    "black-forest-labs/FLUX.2-klein-base-9B": Flux2KleinT2IPipeline,
}
"""Released hub id → the family that serves it (variants of one diffusers class: ``RELEASED_VARIANTS``)."""


@pytest.mark.parametrize("model_id", list(RELEASED_IDS))
def test_released_ids_route_to_their_family(model_id, tmp_path):
    """By ``--model-id``, and by a directory named as released whose class diffusers does not know."""
    family = RELEASED_IDS[model_id]
    assert resolve_pipeline(str(tmp_path), model_id=model_id) is family
    renamed = tmp_path / model_id.rpartition("/")[2]
    renamed.mkdir()
    (renamed / "model_index.json").write_text(json.dumps({"_class_name": "SomeRenamedPipeline"}))
    assert resolve_pipeline(str(renamed)) is family


# ---- Stable Diffusion 3 / 3.5 --------------------------------------------------------------


def test_sd3_defaults_follow_the_sd3_medium_card(loaded):
    pipe, _ = loaded("tiny/sd3")
    p = pipe.prepare(T2IParams(prompt="x"), {})
    assert (p.num_inference_steps, p.guidance_scale) == (28, 7.0)
    assert pipe.guidance_on(p) and pipe.call_kwargs(p)["max_sequence_length"] == 256


def test_sd3_negative_prompt_changes_the_output_when_guidance_is_on(loaded):
    pipe, ctx = loaded("tiny/sd3")
    plain = params_for(pipe, prompt="a lighthouse", seed=5, num_inference_steps=4, return_tensor=True)
    negative = msgspec.structs.replace(plain, negative_prompt="fog, night, blurry")
    out = pipe.run([WorkItem(job_id="plain", params=plain), WorkItem(job_id="neg", params=negative)], ctx)
    alone = pipe.run([WorkItem(job_id="neg-alone", params=negative)], ctx)[0].tensors["image"]
    with_negative = out[1].tensors["image"]
    assert (out[0].tensors["image"] - with_negative).abs().max() > 0.01  # the negative prompt steers the result
    assert (alone - with_negative).abs().max() <= BATCH_TOL  # and is per request inside a merged batch
    empty = msgspec.structs.replace(plain, negative_prompt="")
    same = pipe.run([WorkItem(job_id="empty", params=empty)], ctx)[0].tensors["image"]
    assert (same - out[0].tensors["image"]).abs().max() <= BATCH_TOL  # unset means "" (diffusers' default)


# ---- GLM-Image -----------------------------------------------------------------------------


def test_glm_image_defaults_follow_the_model_card(loaded):
    pipe, _ = loaded("tiny/glm-image")
    p = pipe.prepare(T2IParams(prompt="x"), {})
    assert (p.num_inference_steps, p.guidance_scale) == (30, 1.5)
    assert pipe.guidance_on(p) and "negative_prompt" not in pipe.call_args([WorkItem(job_id="j", params=p)])
    assert (pipe.size_multiple, pipe.max_batch_size, pipe.cp_plan) == (32, 1, None)


def test_glm_image_serves_singletons_because_merging_changes_each_request(loaded):
    """Why ``max_batch_size = 1``: diffusers' ``GlmImagePipeline`` samples a batch's prior image
    tokens in one ``generate`` call seeded from the first request's generator only (and over
    left-padded prompts), so a merged request's picture depends on its batch mates."""
    pipe, ctx = loaded("tiny/glm-image")
    a = params_for(pipe, prompt="a red cat on a mat", seed=1, num_inference_steps=2, return_tensor=True)
    b = params_for(pipe, prompt="a blue dog, much longer prompt than the first", seed=2, num_inference_steps=2)
    items = [
        WorkItem(job_id="a", params=a),
        WorkItem(job_id="b", params=msgspec.structs.replace(b, return_tensor=True)),
    ]
    alone = [pipe.run([item], ctx)[0].tensors["image"] for item in items]
    with torch.inference_mode():
        merged = pipe.pipe(**pipe.call_args(items), return_dict=False)[0].float()
    for i in range(2):
        assert (merged[i] - alone[i]).abs().max() > 0.01, f"request {i} merged equals its singleton"

    def prior_tokens(prompts: list[str], seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return pipe.pipe.generate_prior_tokens(prompt=prompts, height=64, width=64, generator=generator)[0]

    second = [prior_tokens(["first", "second"], seed)[1] for seed in (1, 2)]
    assert not torch.equal(*second)  # the second request's tokens follow the first one's seed


# ---- SANA / SANA 1.5 ------------------------------------------------------------------------


def test_sana_defaults_follow_the_cards_and_the_size_the_checkpoint(loaded):
    from types import SimpleNamespace

    pipe, ctx = loaded("tiny/sana-1.5-1.6b")
    p = pipe.prepare(pipe.params_type(prompt="x"), {})
    assert (p.num_inference_steps, p.guidance_scale) == (20, 4.5) and pipe.guidance_on(p)
    assert (p.width, p.height) == (64, 64)  # the tiny transformer's sample_size 2 x DC-AE's 32
    kwargs = pipe.call_kwargs(p)
    assert kwargs["max_sequence_length"] == 300 and kwargs["use_resolution_binning"] is False
    assert (pipe.prepare(pipe.params_type(prompt="x", width=96), {}).width, p.height) == (96, 64)
    for sample_size, size in ((32, 1024), (16, 512)):  # the released configs: 1024px and 512px rows
        transformer = SimpleNamespace(config=SimpleNamespace(sample_size=sample_size), dtype=torch.float32)
        released = SanaT2IPipeline(SimpleNamespace(transformer=transformer, vae_scale_factor=32), ctx)
        assert released.native_size == size
    tokenizer = pipe.pipe.tokenizer  # Gemma's conventions, which SanaPipeline's text window relies on
    assert tokenizer("a b").input_ids[0] == tokenizer.bos_token_id and tokenizer.pad_token_id == 0


def test_sana_negative_prompt_is_per_request_in_a_batch(loaded):
    pipe, ctx = loaded("tiny/sana-1.5-1.6b")
    plain = params_for(pipe, prompt="a lighthouse", seed=5, return_tensor=True)
    negative = msgspec.structs.replace(plain, negative_prompt="fog, night, blurry")
    out = pipe.run([WorkItem(job_id="plain", params=plain), WorkItem(job_id="neg", params=negative)], ctx)
    alone = pipe.run([WorkItem(job_id="neg-alone", params=negative)], ctx)[0].tensors["image"]
    assert (out[0].tensors["image"] - out[1].tensors["image"]).abs().max() > 0.01
    assert (alone - out[1].tensors["image"]).abs().max() <= BATCH_TOL


# ---- variants: one diffusers class, several released checkpoints ----------------------------
RELEASED_VARIANTS = {
    "Tongyi-MAI/Z-Image-Turbo": ZImageT2IPipeline,
    "Tongyi-MAI/Z-Image": ZImageBaseT2IPipeline,
    "Qwen/Qwen-Image": QwenImageT2IPipeline,
    "Qwen/Qwen-Image-2512": QwenImage2512T2IPipeline,
    "baidu/ERNIE-Image": ErnieImageT2IPipeline,
    "baidu/ERNIE-Image-Turbo": ErnieImageTurboT2IPipeline,
}
"""Released hub id → the pipeline that serves it, where one diffusers class serves several checkpoints."""


def _checkpoint_dir(path: Path, diffusers_class: str) -> Path:
    path.mkdir(parents=True)
    (path / "model_index.json").write_text(json.dumps({"_class_name": diffusers_class}))
    return path


@pytest.mark.parametrize("model_id", sorted(RELEASED_VARIANTS))
def test_released_variant_ids_route_to_their_variant(model_id, tmp_path, monkeypatch):
    from tilecast.runtime import registry

    family = RELEASED_VARIANTS[model_id]
    name = model_id.rpartition("/")[2]
    assert resolve_pipeline(str(tmp_path), model_id=model_id) is family  # --model-id
    assert resolve_pipeline(str(_checkpoint_dir(tmp_path / "local" / name, family.diffusers_class))) is family
    for suffix in ("-bf16", "-diffusers"):  # a renamed copy still carries the released name
        assert resolve_pipeline(str(_checkpoint_dir(tmp_path / f"{name}{suffix}", family.diffusers_class))) is family
    # a Hub id: its snapshot directory is named by a commit, the id names the variant
    snapshot = tmp_path / f"models--{model_id.replace('/', '--')}" / "snapshots" / "0123abc"
    _checkpoint_dir(snapshot, family.diffusers_class)
    monkeypatch.setattr(registry, "local_dir", lambda model_path: snapshot)
    assert resolve_pipeline(model_id) is family


def test_a_checkpoint_of_an_unserved_diffusers_pipeline_is_refused_whatever_its_name(tmp_path):
    inpaint = _checkpoint_dir(tmp_path / "Qwen-Image-Inpaint", "QwenImageInpaintPipeline")
    with pytest.raises(ValueError, match="'QwenImageInpaintPipeline' is not served"):
        resolve_pipeline(str(inpaint))  # its name holds the hint "Qwen-Image", its class says otherwise
    renamed = _checkpoint_dir(tmp_path / "Qwen-Image-2512-export", "SomeRenamedPipeline")
    assert resolve_pipeline(str(renamed)) is QwenImage2512T2IPipeline  # a class diffusers does not know: the name


def test_an_unnamed_checkpoint_of_a_shared_class_is_served_by_its_first_declaration(tmp_path):
    assert resolve_pipeline(str(_checkpoint_dir(tmp_path / "my-finetune", "ZImagePipeline"))) is ZImageT2IPipeline
    assert resolve_pipeline(str(_checkpoint_dir(tmp_path / "other", "QwenImagePipeline"))) is QwenImageT2IPipeline
    assert resolve_pipeline(str(_checkpoint_dir(tmp_path / "third", "ErnieImagePipeline"))) is ErnieImageT2IPipeline


def test_the_longest_hint_wins_whatever_the_listing_order():
    from tilecast.runtime.registry import by_hint

    for order in ((ZImageT2IPipeline, ZImageBaseT2IPipeline), (ZImageBaseT2IPipeline, ZImageT2IPipeline)):
        assert by_hint(("/ckpt/z-image-turbo-v2",), order) is ZImageT2IPipeline
        assert by_hint(("/ckpt/Z-Image",), order) is ZImageBaseT2IPipeline
        assert by_hint(("/ckpt/flux",), order) is None
    # every name is searched: the Hub id names the variant when the snapshot directory does not
    assert by_hint(("0123abc", "Tongyi-MAI/Z-Image-Turbo")) is ZImageT2IPipeline


def test_variant_defaults_follow_their_cards(loaded):
    z_image, _ = loaded("tiny/z-image")
    p = z_image.prepare(T2IParams(prompt="x", negative_prompt="blurry"), {})  # guidance on: a negative prompt is used
    assert (p.num_inference_steps, p.guidance_scale, z_image.guidance_on(p)) == (50, 4.0, True)
    assert z_image.pipe.scheduler.config.shift == 6.0  # Tongyi-MAI/Z-Image's scheduler (Turbo: 3.0)
    turbo, _ = loaded("tiny/z-image-turbo")
    assert turbo.pipe.scheduler.config.shift == 3.0 and not turbo.guidance_on(turbo.prepare(T2IParams(prompt="x"), {}))
    qwen, _ = loaded("tiny/qwen-image-2512")
    p = qwen.prepare(T2IParams(prompt="x"), {})
    assert (p.num_inference_steps, p.guidance_scale) == (50, 4.0)
    assert qwen.call_kwargs(p)["true_cfg_scale"] == 4.0
    ernie, _ = loaded("tiny/ernie-image")
    p = ernie.prepare(T2IParams(prompt="x", negative_prompt="blurry"), {})
    assert (p.num_inference_steps, p.guidance_scale, ernie.guidance_on(p)) == (50, 4.0, True)
    turbo, _ = loaded("tiny/ernie-image-turbo")
    p = turbo.prepare(T2IParams(prompt="x"), {})
    assert (p.num_inference_steps, p.guidance_scale, turbo.guidance_on(p)) == (8, 1.0, False)


# ---- ERNIE-Image ---------------------------------------------------------------------------


def test_ernie_negative_prompt_steers_per_request_and_the_prompt_enhancer_stays_off(loaded):
    pipe, ctx = loaded("tiny/ernie-image")
    plain = params_for(pipe, prompt="a lighthouse", seed=5, num_inference_steps=4, return_tensor=True)
    negative = msgspec.structs.replace(plain, negative_prompt="fog, night, blurry")
    out = pipe.run([WorkItem(job_id="plain", params=plain), WorkItem(job_id="neg", params=negative)], ctx)
    alone = pipe.run([WorkItem(job_id="neg-alone", params=negative)], ctx)[0].tensors["image"]
    assert (out[0].tensors["image"] - out[1].tensors["image"]).abs().max() > 0.01
    assert (alone - out[1].tensors["image"]).abs().max() <= BATCH_TOL
    assert pipe.call_kwargs(plain)["use_pe"] is False and "max_sequence_length" not in pipe.call_kwargs(plain)


# ---- FLUX.2-dev and FLUX.2 [klein] ---------------------------------------------------------


def test_flux2_dev_defaults_follow_its_card(loaded):
    pipe, _ = loaded("tiny/flux.2-dev")
    p = pipe.prepare(pipe.params_type(prompt="x"), {})
    assert (p.num_inference_steps, p.guidance_scale) == (50, 4.0)
    assert not pipe.guidance_on(p) and pipe.call_kwargs(p)["max_sequence_length"] == 512


def test_flux2_dev_reads_a_released_tokenizer_folder_without_its_processor(loaded, tiny_cache, tmp_path):
    """The released FLUX.2-dev stores its tokenizer as a ``PixtralProcessor`` (importing it needs
    torchvision); the family loads the folder's tokenizer and chat template alone, also from the
    processor's older ``chat_template.json``, and computes what the tiny checkpoint's own layout does."""
    import shutil

    released = tmp_path / "FLUX.2-dev"
    shutil.copytree(Flux2T2IPipeline.checkpoint.ensure(tiny_cache), released)
    index = json.loads((released / "model_index.json").read_text())
    (released / "model_index.json").write_text(json.dumps({**index, "tokenizer": ["transformers", "PixtralProcessor"]}))
    folder = released / "tokenizer"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "processor_class": "PixtralProcessor"}))
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))

    pipe, ctx = loaded("tiny/flux.2-dev")
    released_pipe = Flux2T2IPipeline.load(str(released), ctx)
    assert released_pipe.pipe.tokenizer.chat_template == template
    params = params_for(pipe, prompt="a harbour at dawn", seed=3, num_inference_steps=2, return_tensor=True)
    want = pipe.run([WorkItem(job_id="tiny", params=params)], ctx)[0].tensors["image"]
    got = released_pipe.run([WorkItem(job_id="released", params=params)], ctx)[0].tensors["image"]
    assert torch.equal(got, want)


def test_flux2_klein_distilled_defaults_and_refusals(loaded):
    pipe, _ = loaded("tiny/flux.2-klein-4b")
    p = pipe.prepare(pipe.params_type(prompt="x"), {})
    assert pipe.distilled and (p.num_inference_steps, p.guidance_scale) == (4, 1.0) and not pipe.guidance_on(p)
    assert pipe.call_kwargs(p)["max_sequence_length"] == 512
    with pytest.raises(ValueError, match="guidance_scale must be at most 1.0 for flux.2-klein"):
        pipe.prepare(pipe.params_type(prompt="x", guidance_scale=4.0), {})
    with pytest.raises(ValueError, match="negative_prompt cannot be used by flux.2-klein: .* step-distilled"):
        pipe.prepare(pipe.params_type(prompt="x", negative_prompt="blurry"), {})


def test_flux2_klein_base_runs_guidance_with_per_request_negative_prompts(tiny_cache, tmp_path):
    """A Klein Base checkpoint (``is_distilled`` false in its ``model_index.json``) takes the Base
    card's defaults and runs classifier-free guidance; a negative prompt is per request in a batch."""
    import shutil

    base = tmp_path / "FLUX.2-klein-base-4B"
    shutil.copytree(Flux2KleinT2IPipeline.checkpoint.ensure(tiny_cache), base)
    index = json.loads((base / "model_index.json").read_text())
    (base / "model_index.json").write_text(json.dumps({**index, "is_distilled": False}))
    ctx = make_context(tmp_path / "out", dtype="float32")
    pipe = Flux2KleinT2IPipeline.load(str(base), ctx)
    p = pipe.prepare(pipe.params_type(prompt="x"), {})
    assert not pipe.distilled and (p.num_inference_steps, p.guidance_scale) == (50, 4.0) and pipe.guidance_on(p)

    plain = params_for(pipe, prompt="a lighthouse", seed=5, num_inference_steps=2, return_tensor=True)
    negative = msgspec.structs.replace(plain, negative_prompt="fog, night, blurry")
    out = pipe.run([WorkItem(job_id="plain", params=plain), WorkItem(job_id="neg", params=negative)], ctx)
    alone = pipe.run([WorkItem(job_id="neg-alone", params=negative)], ctx)[0].tensors["image"]
    with_negative = out[1].tensors["image"]
    assert (out[0].tensors["image"] - with_negative).abs().max() > 0.01  # the negative prompt steers the result
    assert (alone - with_negative).abs().max() <= BATCH_TOL  # and is per request inside a merged batch
    empty = msgspec.structs.replace(plain, negative_prompt="")
    same = pipe.run([WorkItem(job_id="empty", params=empty)], ctx)[0].tensors["image"]
    assert (same - out[0].tensors["image"]).abs().max() <= BATCH_TOL  # unset means "" (diffusers' only one)
    unguided = params_for(pipe, prompt="a lighthouse", seed=5, num_inference_steps=2, guidance_scale=1.0)
    with pytest.raises(ValueError, match="negative_prompt cannot be used"):
        pipe.prepare(msgspec.structs.replace(unguided, negative_prompt="fog"), {})


def test_ernie_checkpoint_with_a_prompt_enhancer_loads_without_it(tiny_cache, tmp_path):
    """The released checkpoints list ``pe`` / ``pe_tokenizer`` (a 3B model): they are not read."""
    released = tmp_path / "ERNIE-Image"
    shutil.copytree(ErnieImageT2IPipeline.checkpoint.ensure(tiny_cache), released)
    index = json.loads((released / "model_index.json").read_text())
    index.update(pe=["transformers", "Ministral3ForCausalLM"], pe_tokenizer=["transformers", "TokenizersBackend"])
    (released / "model_index.json").write_text(json.dumps(index))  # no pe/ folder: reading it would fail
    pipe = ErnieImageT2IPipeline.load(str(released), make_context(tmp_path / "out", dtype="float32"))
    assert pipe.pipe.pe is None and pipe.pipe.pe_tokenizer is None


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("tiny/flux", {"width": 40}, "width must be a multiple of 16"),
        ("tiny/flux", {"height": 8192}, "height must be a multiple of 16"),
        ("tiny/flux", {"num_inference_steps": 0}, "num_inference_steps"),
        ("tiny/flux", {"negative_prompt": "blurry"}, "negative_prompt cannot be used by flux"),
        ("tiny/flux", {"output_format": "mp4"}, "output_format must be one of png, jpeg"),
        ("tiny/flux", {"output_file_name": "../x.png"}, "output_file_name"),
        ("tiny/flux", {"prompt": "  "}, "prompt must not be empty"),
        ("tiny/z-image-turbo", {"negative_prompt": "blurry"}, "negative_prompt cannot be used"),
        ("tiny/qwen-image", {"guidance_scale": 1.0, "negative_prompt": "x"}, "negative_prompt cannot be used"),
        ("tiny/sd3", {"guidance_scale": 1.0, "negative_prompt": "x"}, "negative_prompt cannot be used by sd3"),
        ("tiny/sd3", {"width": 1552}, "width must be at most 1536 for sd3"),
        ("tiny/glm-image", {"width": 48}, "width must be a multiple of 32"),
        ("tiny/glm-image", {"negative_prompt": "blurry"}, "negative_prompt cannot be used by glm-image"),
        ("tiny/glm-image", {"guidance_scale": 1.0, "negative_prompt": "x"}, "negative_prompt cannot be used by glm-i"),
        ("tiny/glm-image", {"max_sequence_length": 4096}, "max_sequence_length must be in 1..2048"),
        ("tiny/sana-1.5-1.6b", {"width": 48}, "width must be a multiple of 32"),
        (
            "tiny/sana-1.5-1.6b",
            {"guidance_scale": 1.0, "negative_prompt": "x"},
            "negative_prompt cannot be used by sana",
        ),
        ("tiny/flux.2-dev", {"negative_prompt": "blurry"}, "negative_prompt cannot be used by flux.2-dev"),
        ("tiny/flux.2-klein-4b", {"guidance_scale": 2.0}, "guidance_scale must be at most 1.0"),
        ("tiny/ernie-image", {"max_sequence_length": 64}, "max_sequence_length cannot be used by ernie-image"),
        ("tiny/ernie-image-turbo", {"negative_prompt": "x"}, "negative_prompt cannot be used by ernie-image-turbo"),
        ("tiny/wan2.1-t2v", {"num_frames": 6}, "num_frames must be 4k+1"),
        ("tiny/wan2.1-t2v", {"output_format": "png"}, "output_format must be one of mp4"),
        ("tiny/qwen-image", {"num_inference_steps": 1}, "num_inference_steps must be in 2..1000 for qwen-image"),
        ("tiny/ltx-2", {"num_inference_steps": 1}, "one step is 0/0 in its scheduler's shift_terminal stretch"),
    ],
)
def test_prepare_refuses_bad_requests_naming_the_field(name, fields, message, loaded):
    pipe, _ = loaded(name)
    fields = {"prompt": "x", **fields}
    with pytest.raises(ValueError, match=re.escape(message)):
        pipe.prepare(pipe.params_type(**fields), {})


@pytest.mark.parametrize(("name", "steps"), [("tiny/flux", 1), ("tiny/qwen-image", 2)])
def test_the_health_generation_runs_the_fewest_steps_that_give_an_image(name, steps, loaded):
    """One step where the schedule allows it; two under a ``shift_terminal`` stretch, whose one-step
    schedule diffusers computes as 0/0 (NaN): the request the health probe sends must be valid."""
    pipe, ctx = loaded(name)
    fields, uploads = pipe.health_request()
    assert fields["num_inference_steps"] == steps == pipe.min_steps
    params = params_for(pipe, **fields, return_tensor=True)  # at 32 x 32
    (output,) = pipe.run([WorkItem(job_id="health", params=params, uploads=uploads)], ctx)
    assert torch.isfinite(output.tensors["image"]).all()


def test_unknown_fields_are_refused():
    with pytest.raises(msgspec.ValidationError, match="fail"):
        msgspec.convert({"prompt": "x", "fail": True}, T2IParams)
    with pytest.raises(msgspec.ValidationError, match="num_frames"):
        msgspec.convert({"prompt": "x", "num_frames": 5}, T2IParams)


def test_batch_key_holds_shape_fields_not_per_request_ones(loaded):
    pipe, _ = loaded("tiny/qwen-image")
    a = params_for(pipe, prompt="a", seed=1, negative_prompt="x", output_file_name="a.png")
    b = params_for(pipe, prompt="b", seed=2)
    assert pipe.batch_key(a) == pipe.batch_key(b)
    assert set(pipe.batch_key(a)) == {
        "width",
        "height",
        "num_inference_steps",
        "guidance_scale",
        "output_format",
        "return_tensor",
        # SGLang's fields: what shapes the computation is in the key (true_cfg_scale is folded
        # into guidance_scale and enable_teacache can only be false by then)
        "generator_device",
        "max_sequence_length",
        "flow_shift",
        "true_cfg_scale",
        "enable_teacache",
        # the LoRA adapter a request runs with (written by the scheduler's registry)
        "lora",
        "lora_scale",
        "lora_path",
        "lora_merged",
    }
    for change in (
        {"num_inference_steps": 3},
        {"guidance_scale": 1.0},
        {"return_tensor": True},
        {"width": 48},
        {"max_sequence_length": 64},
    ):
        assert pipe.batch_key(params_for(pipe, prompt="a", **change)) != pipe.batch_key(b), change
    jpeg = dict(prompt="a", output_format="jpeg")
    assert pipe.batch_key(params_for(pipe, **jpeg, output_quality=50)) == pipe.batch_key(params_for(pipe, **jpeg))
    wan, _ = loaded("tiny/wan2.1-t2v")
    wan_key = wan.batch_key(params_for(wan, prompt="a"))
    assert "num_frames" in wan_key and "fps" not in wan_key  # fps only stamps the file
    assert (pipe.task, wan.task, pipe.max_batch_size) == ("t2i", "t2v", 16)


INDUCTOR_FAMILIES = {"tiny/qwen-image", "tiny/wan2.1-t2v"}
"""Families whose ``--compile`` test runs inductor's generated code (an image DiT with a text mask and
a video DiT; FLUX's is ``tests/test_flux_fast.py``). The others compile their blocks through dynamo
with the ``aot_eager`` backend: the same graph capture (a graph break or an untraceable op fails the
same way) without inductor's C++ build, 15-40 s a family on CI's CPU."""


@pytest.mark.parametrize(
    "name", sorted(set(tiny_families(variants=False)) - {"tiny/flux"})
)  # FLUX: tests/test_flux_fast.py; variants compile their family's transformer
def test_compile_compiles_the_repeated_blocks_and_keeps_the_output(name, loaded, tmp_path, monkeypatch):
    skip_without_required_modules(FAMILIES[name])
    eager, ctx = loaded(name)
    if name not in INDUCTOR_FAMILIES:
        compile_module = torch.nn.Module.compile
        monkeypatch.setattr(
            torch.nn.Module,
            "compile",
            lambda self, *a, **kw: compile_module(self, *a, **{"backend": "aot_eager", **kw}),
        )
    compiled = FAMILIES[name].load(name, make_context(tmp_path, dtype="float32", compile=True))
    blocks = [
        m for m in compiled.pipe.transformer.modules() if type(m).__name__ in compiled.pipe.transformer._repeated_blocks
    ]
    assert blocks and all(block._compiled_call_impl is not None for block in blocks)
    steps = dict(num_inference_steps=2) if eager.task == "i2i" else {}  # as in the batch test
    params = params_for(eager, prompt="a quiet harbour", seed=4, return_tensor=True, **steps)
    expected = eager.run([work(eager, "eager", params)], ctx)[0].tensors[eager.output_kind]
    got = compiled.run([work(compiled, "compiled", params)], ctx)[0].tensors[eager.output_kind]
    assert (got - expected).abs().max().item() <= 1e-4


# ---- SGLang-Diffusion's request fields -----------------------------------------------------
def _tensor(pipe, ctx, job="j", **fields):
    params = params_for(pipe, return_tensor=True, **fields)
    return pipe.run([WorkItem(job_id=job, params=params)], ctx)[0].tensors[pipe.output_kind]


@pytest.mark.parametrize(
    "name, fields, message",
    [
        ("tiny/flux", {"generator_device": "cuda"}, "generator_device 'cuda' needs a CUDA server"),
        ("tiny/flux", {"generator_device": "tpu"}, "generator_device must be one of cpu, cuda"),
        ("tiny/flux", {"enable_teacache": True}, "tilecast has no TeaCache"),
        ("tiny/flux", {"flow_shift": 3.0}, "flow_shift cannot be used by flux"),
        ("tiny/flux", {"true_cfg_scale": 4.0}, "true_cfg_scale cannot be used by flux"),
        ("tiny/flux", {"max_sequence_length": 4096}, "max_sequence_length must be in 1..512"),
        ("tiny/flux", {"output_quality": 80}, "output_quality applies to jpeg and webp images, not png"),
        ("tiny/flux", {"output_format": "jpeg", "output_quality": 80, "output_compression": 5}, "not both"),
        ("tiny/qwen-image", {"true_cfg_scale": 4.0, "guidance_scale": 2.0}, "give one of them"),
        ("tiny/wan2.1-t2v", {"output_compression": 10}, "applies to jpeg and webp images, not mp4"),
    ],
)
def test_sglang_fields_a_family_cannot_honour_are_refused_naming_them(loaded, name, fields, message):
    pipe, _ = loaded(name)
    with pytest.raises(ValueError, match=re.escape(message)):
        params_for(pipe, prompt="a", **fields)


def test_sglang_fields_are_honoured(loaded):
    flux, flux_ctx = loaded("tiny/flux")
    base = _tensor(flux, flux_ctx, prompt="a lighthouse", seed=4)
    shorter = _tensor(flux, flux_ctx, prompt="a lighthouse", seed=4, max_sequence_length=16)
    assert (base - shorter).abs().max() > 1e-4  # fewer (padded) text tokens: another computation

    qwen, qwen_ctx = loaded("tiny/qwen-image")
    assert params_for(qwen, prompt="a", true_cfg_scale=3.0).guidance_scale == 3.0  # Qwen's guidance is true CFG
    by_guidance = _tensor(qwen, qwen_ctx, prompt="a boat", seed=2, guidance_scale=3.0)
    by_true_cfg = _tensor(qwen, qwen_ctx, prompt="a boat", seed=2, true_cfg_scale=3.0)
    assert torch.equal(by_guidance, by_true_cfg)

    wan, wan_ctx = loaded("tiny/wan2.1-t2v")
    default = _tensor(wan, wan_ctx, prompt="rain", seed=1)
    shifted = _tensor(wan, wan_ctx, prompt="rain", seed=1, flow_shift=9.0)
    assert (default - shifted).abs().max() > 1e-4
    assert wan.pipe.scheduler.config.flow_shift != 9.0  # the shift was for that batch only
    again = _tensor(wan, wan_ctx, prompt="rain", seed=1)
    assert torch.equal(default, again)


def test_jpeg_and_webp_quality_and_compression(loaded, tmp_path):
    pipe, ctx = loaded("tiny/flux")

    def encoded(**fields) -> bytes:
        params = params_for(pipe, prompt="a checkerboard", seed=3, **fields)
        (path,) = [
            f.path
            for f in pipe.run([WorkItem(job_id="-".join(map(str, fields.values())), params=params)], ctx)[0].files
        ]
        return Path(path).read_bytes()

    webp = encoded(output_format="webp")
    assert webp[:4] == b"RIFF" and webp[8:12] == b"WEBP"
    assert len(encoded(output_format="jpeg", output_quality=5)) < len(encoded(output_format="jpeg", output_quality=95))
    assert encoded(output_format="jpeg", output_compression=90) == encoded(output_format="jpeg", output_quality=10)
