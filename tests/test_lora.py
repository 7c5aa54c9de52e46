"""LoRA adapters on tiny FLUX: diffusers' ``load_lora_weights`` format, generated here with peft.

- The registry's rules (``scheduler/lora.py``), no model.
- The pipeline: an adapter changes the output, and equals diffusers' own ``load_lora_weights``
  result on the same checkpoint within ``LORA_TOL``; merged equals unmerged within ``LORA_TOL``;
  after unmerging, the base output comes back.
- A server: set, list, generate, merge, unmerge over HTTP (SGLang's routes) and the ZeroMQ client,
  a request's own ``lora``, refusals.

``LORA_TOL`` (max abs difference on the ``[0, 1]`` fp32 image): tilecast's FLUX attention kernel
against diffusers' processor, and a merged matrix against the separate low-rank product, differ by
float rounding only (measured below 1e-5).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests.harness import http_server_config, make_context
from tilecast.client import Client, ServerError
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.inproc import InProcessServer
from tilecast.runtime.models.families.flux import TINY_FLUX, FluxT2IPipeline
from tilecast.runtime.pipeline import WorkItem
from tilecast.scheduler.lora import LoraError, LoraRegistry

LORA_TOL = 1e-4
REQUEST = dict(prompt="a lighthouse at dusk", width=32, height=32, num_inference_steps=2, seed=5)


def write_lora(checkpoint: Path, path: Path, seed: int) -> Path:
    """A rank-4 LoRA on the transformer's attention projections with seeded non-zero weights,
    saved with diffusers' ``FluxPipeline.save_lora_weights``."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = FluxTransformer2DModel.from_pretrained(checkpoint / "transformer")
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    transformer.add_adapter(config)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_" in name:
                param.mul_(4.0)  # a visible effect on a random tiny model
    FluxPipeline.save_lora_weights(
        path.parent, transformer_lora_layers=get_peft_model_state_dict(transformer), weight_name=path.name
    )
    return path


@pytest.fixture(scope="module")
def loras(tiny_cache, tmp_path_factory) -> dict[str, Path]:
    checkpoint = TINY_FLUX.ensure(tiny_cache)
    directory = tmp_path_factory.mktemp("loras")
    return {
        name: write_lora(checkpoint, directory / f"{name}.safetensors", seed) for name, seed in (("ink", 1), ("oil", 2))
    }


def _image(pipe, ctx, **fields):
    params = pipe.prepare(pipe.params_type(return_tensor=True, **{**REQUEST, **fields}), {})
    return pipe.run([WorkItem(job_id="lora", params=params)], ctx)[0].tensors["image"]


# ---- the registry --------------------------------------------------------------------------
def test_the_registry_resolves_what_each_request_runs_with(loras, tmp_path):
    registry = LoraRegistry.from_settings([f"ink={loras['ink']}"], [loras["oil"].parent])
    assert registry.active == "ink" and registry.merged  # the first --lora-path: active and merged
    assert registry.resolve({"prompt": "p"})["lora_merged"] is True
    assert registry.resolve({"prompt": "p", "lora": "none"})["lora"] is None
    own = registry.resolve({"prompt": "p", "lora": "ink", "lora_scale": 0.5})
    assert (own["lora_scale"], own["lora_merged"]) == (0.5, False)  # another strength: not the merged one
    registry.unmerge()
    assert registry.resolve({"prompt": "p"})["lora"] is None
    registry.set("oil", str(loras["oil"]), strength=0.7)
    assert registry.listing()["active"]["transformer"] == [
        {"nickname": "oil", "path": str(loras["oil"].resolve()), "merged": True, "strength": 0.7}
    ]
    outside = tmp_path / "x.safetensors"
    outside.write_bytes(b"")
    for call, message in (
        (lambda: registry.set("x", str(outside)), "not allowed"),
        (lambda: registry.set("bad name", str(loras["oil"])), "lora_nickname must be"),
        (lambda: registry.set("ghost"), "no adapter 'ghost' is loaded"),
        (lambda: registry.resolve({"lora": "ghost"}), "lora 'ghost' is not loaded"),
        (lambda: registry.resolve({"lora_path": "/etc/passwd"}), "lora_path is set by the server"),
        (lambda: registry.resolve({"lora_scale": 2.0}), "lora_scale needs lora"),
        (lambda: LoraRegistry().set("ink"), "LoRA is off on this server"),
    ):
        with pytest.raises(LoraError, match=message):
            call()


# ---- the pipeline --------------------------------------------------------------------------
def test_an_adapter_equals_diffusers_load_lora_weights_and_merging_keeps_it(loras, tiny_cache, tmp_path):
    from diffusers import FluxPipeline

    ctx = make_context(tmp_path, dtype="float32", lora_dirs=(loras["ink"].parent,))
    pipe = FluxT2IPipeline.load("tiny/flux", ctx)
    base = _image(pipe, ctx)
    ink = dict(lora="ink", lora_path=str(loras["ink"]), lora_scale=1.0)
    with_ink = _image(pipe, ctx, **ink)
    assert (with_ink - base).abs().max() > 1e-2  # the adapter changes the picture

    reference = FluxPipeline.from_pretrained(str(TINY_FLUX.ensure(tiny_cache)), dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(str(loras["ink"]))
    args = pipe.call_args([WorkItem(job_id="r", params=pipe.prepare(pipe.params_type(**REQUEST, **ink), {}))])
    expected = reference(**args, return_dict=False)[0][0].float()
    assert (with_ink - expected).abs().max() <= LORA_TOL

    merged = _image(pipe, ctx, **ink, lora_merged=True)
    assert pipe.lora_fused == ("ink", 1.0) and (merged - with_ink).abs().max() <= LORA_TOL
    half = _image(pipe, ctx, **{**ink, "lora_scale": 0.5})  # unmerges, then runs at half strength
    assert pipe.lora_fused is None and (half - with_ink).abs().max() > 1e-3
    again = _image(pipe, ctx)
    assert (again - base).abs().max() <= 1e-5  # the base model is back


# ---- a server ------------------------------------------------------------------------------
def test_set_list_generate_merge_unmerge_over_http_and_zeromq(loras, tmp_path):
    config = http_server_config(
        "tiny/flux", tmp_path / "out", lora_paths=(f"ink={loras['ink']}",), lora_dirs=(loras["oil"].parent,)
    )
    with InProcessServer(config) as server, Client(server.endpoint, timeout=120) as client:
        http = httpx.Client(base_url=server.http_url, timeout=120)

        def png(**fields) -> np.ndarray:
            body = {"size": "32x32", "response_format": "b64_json", "num_inference_steps": 2, "seed": 5, **fields}
            response = http.post("/v1/images/generations", json={"prompt": REQUEST["prompt"], **body})
            assert response.status_code == 200, response.text
            from PIL import Image

            data = base64.b64decode(response.json()["data"][0]["b64_json"])
            return np.asarray(Image.open(io.BytesIO(data)), dtype=np.int16)

        listed = http.get("/v1/list_loras").json()
        assert listed["active"]["transformer"][0]["nickname"] == "ink" and listed["active"]["transformer"][0]["merged"]
        ink, base = png(), png(lora="none")
        assert np.abs(ink - base).max() > 3
        assert np.abs(png(lora="ink") - ink).max() <= 1  # unmerged at strength 1: the merged picture

        assert http.post("/v1/unmerge_lora_weights").json()["status"] == "ok"
        assert np.array_equal(png(), base)  # requests without lora run on the base model
        assert http.post("/v1/merge_lora_weights", json={}).json()["active"]["transformer"][0]["merged"]
        assert np.abs(png() - ink).max() <= 1

        answer = http.post(
            "/v1/set_lora", json={"lora_nickname": "oil", "lora_path": str(loras["oil"]), "strength": 1.0}
        )
        assert answer.status_code == 200, answer.text
        oil = png()
        assert np.abs(oil - ink).max() > 3 and np.abs(oil - base).max() > 3
        assert [a["nickname"] for a in client.list_loras()["loaded_adapters"]] == ["ink", "oil"]
        client.set_lora("ink")  # the ZeroMQ client: back to the first adapter
        assert np.abs(png() - ink).max() <= 1

        refused = http.post("/v1/set_lora", json={"lora_nickname": "x", "lora_path": str(tmp_path / "x.safetensors")})
        assert refused.status_code == 400 and "not allowed" in refused.json()["error"]["message"]
        assert (
            http.post("/v1/set_lora", json={"lora_nickname": "ink", "target": "critic"}).json()["error"]["param"]
            == "target"
        )
        with pytest.raises(ServerError, match="lora 'ghost' is not loaded"):
            client.generate(prompt="x", width=32, height=32, lora="ghost", timeout=60)


def test_lora_settings_are_refused_where_they_cannot_be_honoured(loras):
    from tilecast.runtime.config import UnsupportedSettingError
    from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline

    with pytest.raises(UnsupportedSettingError, match="--lora-path"):
        K6SRPipeline.check_settings(ServeConfig(model_path="tiny/k6sr", lora_paths=(str(loras["ink"]),)), "tiny/k6sr")
    with pytest.raises(ValueError, match="--lora-path: lora_path must be an existing .safetensors file"):
        ServeConfig(model_path="tiny/flux", lora_paths=("missing.safetensors",))
