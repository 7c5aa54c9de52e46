"""One policy for every pipeline: a setting it cannot honour stops start-up, naming the flag.

Each pipeline declares the ``ServeConfig`` fields it reads (``honoured_settings``); every other
pipeline setting (``setting(..., pipeline=True)``) set away from its default is refused by ``load``
on every rank, before any weight is read, with the flag and the list of what the pipeline honours.
The samples come from the declaration, so a setting added later is covered without editing this file.
Also here: no "is ignored" warning is left in the code, and no terminal UI is imported under
``runtime/`` or ``kernels/``.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.harness import cli_flags, make_context
from tilecast.runtime.config import ServeConfig, UnsupportedSettingError, pipeline_settings
from tilecast.runtime.models.families.ernie_image import ErnieImageT2IPipeline, ErnieImageTurboT2IPipeline
from tilecast.runtime.models.families.flux import FluxT2IPipeline
from tilecast.runtime.models.families.flux2 import Flux2T2IPipeline
from tilecast.runtime.models.families.flux2_klein import Flux2KleinT2IPipeline
from tilecast.runtime.models.families.flux2_nvfp4 import Flux2NVFP4T2IPipeline
from tilecast.runtime.models.families.glm_image import GlmImageT2IPipeline
from tilecast.runtime.models.families.helios import HeliosPyramidT2VPipeline, HeliosT2VPipeline
from tilecast.runtime.models.families.hunyuan_video import HunyuanVideoT2VPipeline
from tilecast.runtime.models.families.ltx2 import LTX2T2VPipeline
from tilecast.runtime.models.families.qwen_image import QwenImage2512T2IPipeline, QwenImageT2IPipeline
from tilecast.runtime.models.families.qwen_image_edit import QwenImageEditI2IPipeline, QwenImageEditPlusI2IPipeline
from tilecast.runtime.models.families.qwen_image_layered import QwenImageLayeredI2IPipeline
from tilecast.runtime.models.families.sana import SanaT2IPipeline
from tilecast.runtime.models.families.sd3 import SD3T2IPipeline
from tilecast.runtime.models.families.wan import WanT2VPipeline
from tilecast.runtime.models.families.wan22 import Wan22I2VPipeline, Wan22T2VPipeline, Wan22TI2VPipeline
from tilecast.runtime.models.families.wan_i2v import WanI2VPipeline
from tilecast.runtime.models.families.z_image import ZImageBaseT2IPipeline, ZImageT2IPipeline
from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = {
    "tiny/k6sr": K6SRPipeline,
    "tiny/flux": FluxT2IPipeline,
    "tiny/qwen-image": QwenImageT2IPipeline,
    "tiny/qwen-image-2512": QwenImage2512T2IPipeline,
    "tiny/z-image-turbo": ZImageT2IPipeline,
    "tiny/z-image": ZImageBaseT2IPipeline,
    "tiny/wan2.1-t2v": WanT2VPipeline,
    "tiny/wan2.1-i2v-14b-480p": WanI2VPipeline,
    "tiny/wan2.2-t2v-a14b": Wan22T2VPipeline,
    "tiny/wan2.2-i2v-a14b": Wan22I2VPipeline,
    "tiny/wan2.2-ti2v-5b": Wan22TI2VPipeline,
    "tiny/sd3": SD3T2IPipeline,
    "tiny/glm-image": GlmImageT2IPipeline,
    "tiny/sana-1.5-1.6b": SanaT2IPipeline,
    "tiny/flux.2-dev": Flux2T2IPipeline,
    "tiny/flux.2-dev-nvfp4": Flux2NVFP4T2IPipeline,
    "tiny/flux.2-klein-4b": Flux2KleinT2IPipeline,
    "tiny/ernie-image": ErnieImageT2IPipeline,
    "tiny/ernie-image-turbo": ErnieImageTurboT2IPipeline,
    "tiny/hunyuanvideo": HunyuanVideoT2VPipeline,
    "tiny/helios-base": HeliosT2VPipeline,
    "tiny/helios-distilled": HeliosPyramidT2VPipeline,
    "tiny/ltx-2": LTX2T2VPipeline,
    "tiny/qwen-image-edit": QwenImageEditI2IPipeline,
    "tiny/qwen-image-edit-2511": QwenImageEditPlusI2IPipeline,
    "tiny/qwen-image-layered": QwenImageLayeredI2IPipeline,
}
_LORA_DIR = Path(tempfile.mkdtemp(prefix="tilecast-lora-"))
(_LORA_DIR / "style.safetensors").touch()  # the settings check the file exists (tests/test_lora.py loads real ones)
SAMPLES = {  # a valid value other than the default, and the flags it needs besides its own
    "dtype": ({"dtype": "bfloat16"}, "--dtype bfloat16"),
    "transformer_weights_path": (
        {"transformer_weights_path": "/data/flux2-dev-nvfp4.safetensors"},
        "--transformer-weights-path /data/flux2-dev-nvfp4.safetensors",
    ),
    "tp_size": ({"tp_size": 2, "num_gpus": 2}, "--tp-size 2"),
    "ulysses_degree": ({"ulysses_degree": 2, "num_gpus": 2}, "--ulysses-degree 2"),
    "ring_degree": ({"ring_degree": 2, "num_gpus": 2}, "--ring-degree 2"),
    "tile_parallel": ({"tile_parallel": True, "num_gpus": 2}, "--tile-parallel"),
    "vae.use_parallel_tiling": ({"vae": {"use_parallel_tiling": True}}, "--vae-config.use-parallel-tiling"),
    "vae.use_parallel_decode": ({"vae": {"use_parallel_decode": True}}, "--vae-config.use-parallel-decode"),
    "vae.parallel_decode_mode": (None, None),  # one choice only: it cannot be set away from its default
    "vae.fast_decode": ({"vae": {"fast_decode": False}}, "--vae-config.fast-decode false"),
    "vae.fp8_convs": ({"vae": {"fp8_convs": True}}, "--vae-config.fp8-convs"),
    "layerwise_offload_components": ({"layerwise_offload_components": "vae"}, "--layerwise-offload-components vae"),
    "cpu_offload_components": ({"cpu_offload_components": "vae"}, "--cpu-offload-components vae"),
    "dit_offload_prefetch_size": (
        {"dit_offload_prefetch_size": 2, "layerwise_offload_components": "all"},
        "--dit-offload-prefetch-size 2",
    ),
    "dit_layerwise_resident_layers": (
        {"dit_layerwise_resident_layers": 1, "layerwise_offload_components": "all"},
        "--dit-layerwise-resident-layers 1",
    ),
    "use_fsdp_inference": ({"use_fsdp_inference": True, "num_gpus": 2}, "--use-fsdp-inference"),
    "attention_backend": ({"attention_backend": "sdpa_math"}, "--attention-backend sdpa_math"),
    "compile": ({"compile": True}, "--compile"),
    "allow_dense_attention_fallback": (
        {"allow_dense_attention_fallback": True},
        "--allow-dense-attention-fallback",
    ),
    "quantize": ({"quantize": "fp8"}, "--quantize fp8"),
    "cuda_graphs": ({"cuda_graphs": True, "device": "cuda"}, "--cuda-graphs"),
    "allowed_video_dirs": ({"allowed_video_dirs": ("/data",)}, "--allowed-video-dir /data"),
    "lora_paths": (
        {"lora_paths": (str(_LORA_DIR / "style.safetensors"),)},
        f"--lora-path {_LORA_DIR / 'style.safetensors'}",
    ),
    "lora_dirs": ({"lora_dirs": (_LORA_DIR,)}, f"--lora-dir {_LORA_DIR}"),
}


def _config(fields: dict) -> ServeConfig:
    return ServeConfig(**{"device": "cpu", **fields})


def _honours(pipeline, name: str) -> bool:
    return name in pipeline.honoured_settings or name.partition(".")[0] in pipeline.honoured_settings


def test_every_pipeline_setting_has_a_sample():
    assert {item.name for item in pipeline_settings()} == set(SAMPLES)


def _cases(honoured: bool):
    return [
        (model, name)
        for model, pipeline in PIPELINES.items()
        for name, (fields, _) in SAMPLES.items()
        if fields is not None and _honours(pipeline, name) == honoured
    ]


@pytest.mark.parametrize(("model", "name"), _cases(honoured=False))
def test_an_unsupported_setting_is_refused_at_load_naming_its_flag(model, name, tmp_path):
    fields, flag = SAMPLES[name]
    pipeline = PIPELINES[model]
    config = _config(fields)
    with pytest.raises(UnsupportedSettingError) as info:
        pipeline.load(model, make_context(tmp_path, settings=config, cache_dir=tmp_path))  # before any weight
    message = str(info.value)
    refused, _, rest = message.partition(" not supported by ")
    named = refused.rsplit(" ", 1)[0].split("; ")  # "FLAG [VALUE] [(why)]; ... is|are"
    assert any(part == flag or part.startswith(f"{flag} (") for part in named), message
    assert rest.startswith(f"{model} ({pipeline.family} honours: "), message
    assert "--dtype" in message.partition("honours: ")[2]  # what it does honour is listed
    assert not (tmp_path / "models").exists()  # refused before the checkpoint was even built


@pytest.mark.parametrize(("model", "name"), _cases(honoured=True))
def test_a_supported_setting_passes_the_check(model, name):
    fields, _ = SAMPLES[name]
    PIPELINES[model].check_settings(_config(fields), model)


VIDEO_DECODERS = {
    "tiny/k6sr": "k6sr.spatial_shard",
    "tiny/wan2.1-t2v": "wan_decode",
    "tiny/wan2.1-i2v-14b-480p": "wan_decode",
    "tiny/wan2.2-t2v-a14b": "wan_decode",
    "tiny/wan2.2-i2v-a14b": "wan_decode",
    "tiny/wan2.2-ti2v-5b": "wan_decode",
    "tiny/helios-base": "wan_decode",
    "tiny/helios-distilled": "wan_decode",
    "tiny/hunyuanvideo": "hunyuan_decode",
    "tiny/ltx-2": "ltx2_decode",
}
"""Every video row and the module that splits its VAE decode by rows (its multi-rank test:
``tests/test_<module>.py`` or ``tests/test_spatial_shard.py``)."""


@pytest.mark.parametrize(
    "model", [model for model, p in PIPELINES.items() if getattr(p, "output_kind", "video") == "video"]
)  # K6 SR (no output_kind: not a diffusers family) writes video
def test_every_video_family_honours_the_parallel_decode(model):
    """A video row without a row-band decode must be added here on purpose (and refuse the flag
    with its reason in ``unsupported_reasons``), not slip in."""
    assert model in VIDEO_DECODERS, f"{model}: a video family without a parallel VAE decode"
    pipeline = PIPELINES[model]
    pipeline.check_settings(_config({"vae": {"use_parallel_decode": True}}), model)
    if model != "tiny/k6sr":  # the diffusers video families: whole tiles are K6 SR's, and say so
        with pytest.raises(UnsupportedSettingError, match=re.escape("this video VAE decodes untiled")):
            pipeline.check_settings(_config({"vae": {"use_parallel_tiling": True}}), model)


def test_the_refusal_lists_every_unsupported_setting_and_the_reasons():
    config = _config({"cuda_graphs": True, "transformer_weights_path": "/w.safetensors", "device": "cuda"})
    with pytest.raises(ValueError) as info:
        K6SRPipeline.check_settings(config, "tiny/k6sr")
    message = str(info.value)
    assert message.startswith("--transformer-weights-path /w.safetensors")
    assert "; --cuda-graphs (one DiT call is seconds of GPU work" in message
    assert "are not supported by tiny/k6sr (k6sr honours: --dtype, --tp-size" in message


def test_defaults_pass_every_pipeline():
    for model, pipeline in PIPELINES.items():
        pipeline.check_settings(ServeConfig(device="cpu"), model)
        pipeline.check_settings(ServeConfig(device="cuda"), model)


def test_honoured_names_must_be_pipeline_settings():
    class Typo(FluxT2IPipeline):
        honoured_settings = FluxT2IPipeline.honoured_settings | {"atention_backend"}

    with pytest.raises(TypeError, match="atention_backend"):
        Typo.check_settings(ServeConfig(device="cpu"))


def test_a_supported_flag_still_starts(tiny_cache, tmp_path):
    pipe = FluxT2IPipeline.load("tiny/flux", make_context(tmp_path, dtype="float32", attention_backend="sdpa_math"))
    assert pipe.dtype.is_floating_point


@pytest.mark.timeout(240)
def test_generate_stops_at_start_up_on_every_rank_naming_the_flag(tiny_cache, tmp_path):
    """Two gloo ranks of ``tilecast generate``: each rank refuses the setting, the command fails."""
    env = {**os.environ, "TILECAST_CACHE": str(tiny_cache)}
    args = cli_flags(model_path="tiny/flux", device="cpu", prompt="x", width=32, height=32, output_path=tmp_path)
    topology = cli_flags(num_gpus=2, ulysses_degree=1, ring_degree=1, tile_parallel=True)
    command = [sys.executable, "-P", "-m", "tilecast", "generate", *args, *topology]
    result = subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)
    text = " ".join((result.stdout + result.stderr).split())
    assert result.returncode != 0, text
    for rank in (0, 1):
        assert f"rank {rank}: --tile-parallel is not supported by tiny/flux (flux honours: --dtype," in text, text
    assert not list(tmp_path.glob("*.png"))


# ----------------------------------------------------------------------------- the code itself


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _warnings_saying_ignored(path: Path) -> list[int]:
    """Lines of ``logger.warning(...)`` / ``warnings.warn(...)`` calls whose message says "ignored"."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("warning", "warn")
        ):
            texts = [
                c.value
                for arg in node.args
                for c in ast.walk(arg)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
            if any(re.search(r"\b(is|are) ignored\b", text) for text in texts):
                lines.append(node.lineno)
    return lines


def test_no_setting_is_warned_about_as_ignored():
    """The refuse policy has no "X is ignored" warning left in tilecast's code, nor the helpers that
    listed ignored settings."""
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in _sources("runtime", "scheduler", "launcher", "kernels")
        for n in _warnings_saying_ignored(p)
    ]
    hits += [
        f"{p.relative_to(ROOT)}:{n}"
        for p in _sources("runtime", "scheduler", "launcher", "kernels")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\b(ignored_settings|honoured_options|pipeline_options)\b", line)
    ]
    assert hits == []


@functools.cache
def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def test_runtime_and_kernels_import_no_terminal_ui():
    """typer and rich belong to ``launcher/`` (the CLI, the progress bar of ``generate``)."""
    offenders = [
        f"{p.relative_to(ROOT)}: {', '.join(sorted(_imports(p) & {'typer', 'rich', 'click'}))}"
        for p in _sources("runtime", "kernels")
        if _imports(p) & {"typer", "rich", "click"}
    ]
    assert offenders == []
    assert {"rich"} <= _imports(ROOT / "launcher" / "generate.py")


def test_tile_parallel_picks_one_rank_per_unit_instead_of_a_refused_layout():
    """Left to pick the degrees, ``--tile-parallel`` gets units of one rank (sharding the DiT over
    every rank would leave one unit, which ``TileWork`` refuses)."""
    from tilecast.launcher.options import build_config

    config = build_config({"model_path": "tiny/k6sr", "device": "cpu", "num_gpus": 2, "tile_parallel": True})
    assert (config.tp_size, config.ulysses_degree, config.ring_degree) == (1, 1, 1)
    assert build_config({"model_path": "tiny/k6sr", "device": "cpu", "num_gpus": 2}).ulysses_degree == 2
