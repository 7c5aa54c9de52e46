"""FLUX.2-dev-NVFP4: FLUX.2-dev's transformer as BFL-format NVFP4 weights, served by the FLUX.2-dev
family (``families.flux2``) next to the base pipeline's other components.

The release (``black-forest-labs/FLUX.2-dev-NVFP4``) holds the transformer alone, as one
``.safetensors`` file with BFL's key names (``double_blocks.N.img_attn.qkv``, ...), not diffusers'.
Its quantized linear layers store ModelOpt's NVFP4 layout: ``weight`` packed E2M1 values (two per
byte), ``weight_scale`` FP8 scales per 16-value block, ``weight_scale_2`` a per-tensor scale and
``input_scale`` the calibrated activation scale; the other layers are BF16. As SGLang-Diffusion
does, the base pipeline is ``--model-path`` and the file ``--transformer-weights-path``::

    tilecast serve --model-path black-forest-labs/FLUX.2-dev \\
        --transformer-weights-path black-forest-labs/FLUX.2-dev-NVFP4

Loading is diffusers' own: ``Flux2Transformer2DModel.from_single_file`` with its
``BFLQuantizationConfig`` converts the keys (fused QKV split with their block scales) and builds
``BFLNVFP4Linear`` layers. On a device without FP4 tensor cores (CPU; CUDA below compute capability
10.0, so H100 / H200 too), or without flashinfer, through which diffusers runs FP4 GEMMs, the
weights are dequantized to the compute dtype once at load (diffusers' ``dequantize``, which leaves
plain ``nn.Linear`` layers) and the log says so; with both, the layers stay NVFP4.

``tiny/flux.2-dev-nvfp4`` is ``tiny/flux.2-dev`` with such a file: the tiny transformer's weights
under BFL's names, the linear layers of its blocks quantized by diffusers' ``quantize_nvfp4`` (the
embedders, modulations and final layer kept BF16, as released), in a file named as released
(``flux2-dev-nvfp4.safetensors``; the release's ``-mixed`` file, whose NVFP4 layers carry no
``input_scale``, is refused by diffusers' loader, naming the layer).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from tilecast.runtime.models.families import flux2
from tilecast.runtime.models.families.common import TinyWeightsFile

logger = logging.getLogger(__name__)

RELEASED_FILE = "flux2-dev-nvfp4.safetensors"
"""The release's NVFP4 transformer file (its folder also holds ``flux2-dev-nvfp4-mixed.safetensors``)."""

# ------------------------------------------------------------------ diffusers -> BFL key names
# The inverse of diffusers' ``convert_flux2_transformer_checkpoint_to_diffusers`` (which the tests
# run on this mapping's output: the round trip gives back every tensor).
TOP_LEVEL = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",  # rows (scale, shift) in diffusers, (shift, scale) in BFL
}
DOUBLE_BLOCK = {
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.to_out.0": "img_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
    "attn.to_add_out": "txt_attn.proj",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
DOUBLE_BLOCK_QKV = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
"""BFL's fused QKV projections: the diffusers projections concatenated along the output rows."""
SINGLE_BLOCK = {
    "attn.to_qkv_mlp_proj": "linear1",
    "attn.to_out": "linear2",
    "attn.norm_q": "norm.query_norm",
    "attn.norm_k": "norm.key_norm",
}
_BLOCK = re.compile(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)")


def bfl_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``Flux2Transformer2DModel`` state dict under BFL's key names (RMS-norm weights are BFL's ``scale``)."""
    out = {}
    for key, value in state.items():
        module, _, param = key.rpartition(".")
        block = _BLOCK.fullmatch(module)
        if block is None:
            name = TOP_LEVEL[module]
            if module == "norm_out.linear":
                scale, shift = value.chunk(2, dim=0)
                value = torch.cat([shift, scale], dim=0)
        elif block[1] == "single_transformer_blocks":
            name = f"single_blocks.{block[2]}.{SINGLE_BLOCK[block[3]]}"
        else:
            fused = next((bfl for bfl, parts in DOUBLE_BLOCK_QKV.items() if block[3] in parts), None)
            if fused is None:
                name = f"double_blocks.{block[2]}.{DOUBLE_BLOCK[block[3]]}"
            elif block[3] == DOUBLE_BLOCK_QKV[fused][0]:  # written once, from its three parts
                name = f"double_blocks.{block[2]}.{fused}"
                parts = DOUBLE_BLOCK_QKV[fused]
                value = torch.cat([state[f"transformer_blocks.{block[2]}.{part}.{param}"] for part in parts], dim=0)
            else:
                continue
        out[f"{name}.{'scale' if name.endswith('_norm') else param}"] = value
    return out


# ------------------------------------------------------------------ the tiny checkpoint
TINY_INPUT_AMAX = 8.0
"""The activation magnitude the tiny file's ``input_scale`` stands for (``amax / (448 * 6)``, ModelOpt's
rule); only an FP4 GEMM reads it, and the tiny checkpoint is run dequantized."""


def quantized_layer(name: str, value: torch.Tensor) -> bool:
    """Whether the tiny file stores BFL weight ``name`` as NVFP4: the linear layers of the blocks (the
    embedders, modulations and final layer stay BF16, as in the release)."""
    return name.startswith(("double_blocks.", "single_blocks.")) and name.endswith(".weight") and value.ndim == 2


def build_tiny_nvfp4() -> dict[str, torch.Tensor]:
    """The tiny FLUX.2-dev transformer (``flux2.TINY_FLUX2``'s weights: built under its seed) as a BFL
    NVFP4 file's tensors."""
    from diffusers.quantizers.bfl.utils import E2M1_MAX, FP8_MAX, quantize_nvfp4

    state = bfl_state_dict(flux2.build_tiny_flux2().transformer.state_dict())
    tensors = {}
    for name, value in state.items():
        if not quantized_layer(name, value):
            tensors[name] = value.to(torch.bfloat16)
            continue
        prefix = name.removesuffix(".weight")
        packed, block_scales, global_scale = quantize_nvfp4(value)
        tensors[name] = packed
        tensors[f"{prefix}.weight_scale"] = block_scales
        tensors[f"{prefix}.weight_scale_2"] = global_scale.float()
        tensors[f"{prefix}.input_scale"] = torch.tensor(TINY_INPUT_AMAX / (FP8_MAX * E2M1_MAX))
    return tensors


TINY_FLUX2_NVFP4 = TinyWeightsFile(
    name="tiny-flux.2-dev-nvfp4-v1",
    seed=flux2.TINY_FLUX2.seed,  # builds tiny/flux.2-dev's networks again: the same weights
    build=build_tiny_nvfp4,
    ref=f"{__name__}:TINY_FLUX2_NVFP4",
    file_name=RELEASED_FILE,
)


# ------------------------------------------------------------------ loading
def weights_file(path: Path) -> Path:
    """The NVFP4 file ``path`` names: the file itself, or the folder's ``RELEASED_FILE`` (or its one
    ``.safetensors`` file); ``ValueError`` naming what is there otherwise."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"--transformer-weights-path {path} is neither a file nor a folder")
    if (path / RELEASED_FILE).is_file():
        return path / RELEASED_FILE
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    names = ", ".join(p.name for p in found) or "none"
    raise ValueError(
        f"--transformer-weights-path {path}: no {RELEASED_FILE} and not exactly one .safetensors file "
        f"(found: {names}); name the file"
    )


def check_layers(file: Path) -> int:
    """The number of NVFP4 layers in ``file``; ``ValueError`` naming the first tensor that is missing
    or has the wrong type or shape for BFL's NVFP4 layout (read from the header, no weights loaded)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        names = set(handle.keys())
        layers = sorted(name.removesuffix(".weight") for name in names if f"{name}_scale" in names)
        if not layers:
            raise ValueError(
                f"{file} has no quantized layer (no '<layer>.weight_scale' tensor): not a BFL NVFP4 checkpoint"
            )
        for layer in layers:
            weight = handle.get_slice(f"{layer}.weight")
            if weight.get_dtype() != "U8":
                continue  # FP8 rows (diffusers' fp8r scheme): diffusers checks those
            rows, packed = weight.get_shape()
            for part in ("weight_scale_2", "input_scale"):
                if f"{layer}.{part}" not in names:
                    raise ValueError(
                        f"{file}: {layer}.{part} is missing: the NVFP4 layer {layer} (packed uint8 weight) needs "
                        "weight_scale, weight_scale_2 and input_scale (FLUX.2-dev-NVFP4's "
                        f"{RELEASED_FILE} has them)"
                    )
            scales = handle.get_slice(f"{layer}.weight_scale").get_shape()
            if list(scales) != [rows, packed * 2 // 16]:
                raise ValueError(
                    f"{file}: {layer}.weight_scale has shape {list(scales)}, the packed weight {[rows, packed]} "
                    f"needs one FP8 scale per 16 values: {[rows, packed * 2 // 16]}"
                )
    return sum(1 for layer in layers if f"{layer}.weight_scale_2" in names)


def fp4_unavailable(device: torch.device) -> str | None:
    """Why ``device`` cannot run diffusers' FP4 GEMMs (None: it can: Blackwell with flashinfer)."""
    if device.type != "cuda":
        return f"{device.type} has no FP4 tensor cores"
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if major < 10:
        return f"{name} (compute capability {major}.{minor}) has no FP4 tensor cores (10.0 and up have)"
    from diffusers.utils import is_flashinfer_available

    if not is_flashinfer_available():
        return f"{name} has FP4 tensor cores but flashinfer, through which diffusers runs FP4 GEMMs, is not installed"
    return None


def load_transformer(weights: Path, base: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """The ``Flux2Transformer2DModel`` of the BFL NVFP4 file ``weights`` (a file or its folder), with
    the config of the base pipeline at ``base``, on ``device``: dequantized to ``dtype`` where FP4
    GEMMs cannot run (one log line says so), else with diffusers' NVFP4 layers."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.quantizers.quantization_config import BFLQuantizationConfig

    file = weights_file(weights)
    layers = check_layers(file)
    transformer = Flux2Transformer2DModel.from_single_file(
        str(file),
        config=str(base),
        subfolder="transformer",
        quantization_config=BFLQuantizationConfig(compute_dtype=dtype),
        dtype=dtype,
        device=device,
        local_files_only=True,
    )
    why = fp4_unavailable(device)
    if why is None:
        logger.info("%s: %d NVFP4 layers run as FP4 GEMMs (flashinfer) on %s", file, layers, device)
    else:
        transformer.dequantize()
        logger.info(
            "%s: dequantized the weights of %d NVFP4 layers to %s at load on %s (%s): the DiT computes in %s",
            file,
            layers,
            str(dtype).removeprefix("torch."),
            device,
            why,
            str(dtype).removeprefix("torch."),
        )
    return transformer.eval()


class Flux2NVFP4T2IPipeline(flux2.Flux2T2IPipeline):
    """``tiny/flux.2-dev-nvfp4``: ``tiny/flux.2-dev`` with the tiny NVFP4 transformer file
    (``--transformer-weights-path`` defaults to it). Released FLUX.2-dev-NVFP4 routes to the family
    (``flux2.Flux2T2IPipeline``), which loads the file named by that flag."""

    builtin_name = "tiny/flux.2-dev-nvfp4"
    checkpoint = None  # two built-in checkpoints: tiny/flux.2-dev's folder and TINY_FLUX2_NVFP4
    model_id_hints = ()
    weights = TINY_FLUX2_NVFP4

    @classmethod
    def ensure_builtin(cls, cache_dir: Path | None = None) -> Path:
        cls.weights.ensure(cache_dir)
        return flux2.TINY_FLUX2.ensure(cache_dir)

    @classmethod
    def build_diffusers(cls, model_path: str, device, dtype, transformer_weights_path: str | None = None) -> Any:
        weights = transformer_weights_path or str(cls.weights.ensure())  # also for the benchmarks' direct calls
        return super().build_diffusers(model_path, device, dtype, transformer_weights_path=weights)
