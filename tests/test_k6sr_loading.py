"""The tiny checkpoint is reproducible, and broken checkpoints are refused with a clear message."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tilecast.runtime.models.k6sr.loading import load_components
from tilecast.runtime.models.k6sr.tiny import TINY_NAME, ensure_tiny_k6sr, write_tiny_k6sr

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return ensure_tiny_k6sr(tmp_path_factory.mktemp("cache"))


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a checkpoint but the cache's completion marker (``write_tiny_k6sr`` alone writes none)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".tilecast-complete"
    }


def test_tiny_checkpoint_is_byte_identical(tiny_dir, tmp_path):
    again = write_tiny_k6sr(tmp_path / "again")
    first, second = _files(tiny_dir), _files(again)
    assert sorted(first) == sorted(second)
    assert {
        "model_index.json",
        "transformer/config.json",
        f"transformer/{WEIGHTS}",
        "vae/config.json",
        f"vae/{WEIGHTS}",
        "latent_upscaler/config.json",
        f"latent_upscaler/{WEIGHTS}",
        "scheduler/scheduler_config.json",
    } <= set(first)
    for name in first:
        assert first[name] == second[name], name
    index = json.loads(first["model_index.json"])
    assert index["_class_name"] == "Kandinsky6SRPipeline"


def test_ensure_tiny_is_idempotent_and_race_safe(tiny_dir, tmp_path):
    assert ensure_tiny_k6sr(tiny_dir.parent.parent) == tiny_dir  # already there: no rewrite
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_tiny_k6sr(tmp_path))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(results) == 2 and results[0] == results[1] == tmp_path / "models" / TINY_NAME
    assert _files(results[0]) == _files(tiny_dir)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [TINY_NAME]  # no staging dirs left


def test_tiny_model_is_sane(tiny_dir):
    from tilecast.runtime.models.k6sr.attention import install_dense_attention

    parts = load_components(tiny_dir, device="cpu", dtype=torch.float32)
    install_dense_attention(parts.transformer)
    config = parts.transformer.config
    assert config.in_visual_dim == 16 and config.out_visual_dim == 160 and parts.scheduler.config.n_grid == 10
    assert parts.spatial_factor == 16 and parts.temporal_factor == 4
    assert model_dim_heads(parts.transformer) == 12
    torch.manual_seed(0)
    x = torch.randn(1, 2, 8, 8, 2 * 16 + 1)
    with torch.no_grad():
        out = parts.transformer(hidden_states=x, timestep=torch.tensor([500.0]), return_dict=False)[0]
    assert out.shape == (1, 2, 8, 8, 160) and torch.isfinite(out).all() and out.std() > 1e-3


def model_dim_heads(transformer) -> int:
    attn = transformer.visual_transformer_blocks[0].self_attention
    return attn.to_query.out_features // attn.query_norm.normalized_shape[-1]


# ----------------------------------------------------------------------------- broken copies
def _copy(tiny_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_dir, tmp_path / "broken"))


def _edit_weights(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_weight_is_refused(tiny_dir, tmp_path):
    root = _copy(tiny_dir, tmp_path)
    _edit_weights(root / "transformer" / WEIGHTS, lambda t: t.pop("out_layer.out_layer.weight"))
    with pytest.raises(ValueError, match=r"^transformer: .*out_layer\.out_layer\.weight"):
        load_components(root, device="cpu", dtype=torch.float32)


def test_unexpected_weight_is_refused(tiny_dir, tmp_path):
    root = _copy(tiny_dir, tmp_path)
    _edit_weights(root / "vae" / WEIGHTS, lambda t: t.__setitem__("encoder.extra.weight", torch.zeros(3)))
    with pytest.raises(ValueError, match=r"^vae: .*unexpected keys: encoder\.extra\.weight"):
        load_components(root, device="cpu", dtype=torch.float32)


def test_shape_mismatch_is_refused(tiny_dir, tmp_path):
    root = _copy(tiny_dir, tmp_path)
    key = "_models.0.output_proj.conv.bias"

    def edit(tensors):
        tensors[key] = torch.zeros(tensors[key].shape[0] + 1)

    _edit_weights(root / "latent_upscaler" / WEIGHTS, edit)
    with pytest.raises(ValueError, match=r"^latent_upscaler: .*output_proj\.conv\.bias"):
        load_components(root, device="cpu", dtype=torch.float32)


def test_latent_channel_mismatch_is_refused(tiny_dir, tmp_path):
    from diffusers import Kandinsky6SRVAE

    from tilecast.runtime.models.k6sr.tiny import VAE_CONFIG

    root = _copy(tiny_dir, tmp_path)
    shutil.rmtree(root / "vae")
    Kandinsky6SRVAE(**{**VAE_CONFIG, "latent_channels": 64}).save_pretrained(str(root / "vae"))
    with pytest.raises(ValueError, match="transformer in_visual_dim 16 does not match vae latent_channels 64"):
        load_components(root, device="cpu", dtype=torch.float32)


def test_flow_match_scheduler_with_distilled_head_is_refused(tiny_dir, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    root = _copy(tiny_dir, tmp_path)
    shutil.rmtree(root / "scheduler")
    FlowMatchEulerDiscreteScheduler(shift=5.0).save_pretrained(str(root / "scheduler"))
    with pytest.raises(ValueError, match=r"^scheduler: FlowMatchEulerDiscreteScheduler .*160 wide.*distilled"):
        load_components(root, device="cpu", dtype=torch.float32)


def test_piflow_grid_mismatch_is_refused(tiny_dir, tmp_path):
    root = _copy(tiny_dir, tmp_path)
    config_path = root / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config["n_grid"] = 8
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"n_grid \* in_visual_dim = 128, but out_visual_dim is 160"):
        load_components(root, device="cpu", dtype=torch.float32)


def test_missing_component_folder_is_refused(tiny_dir, tmp_path):
    root = _copy(tiny_dir, tmp_path)
    shutil.rmtree(root / "transformer")
    with pytest.raises(ValueError, match=r"^transformer: component folder .* is missing"):
        load_components(root, device="cpu", dtype=torch.float32)
