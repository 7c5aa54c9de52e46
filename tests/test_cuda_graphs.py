"""``--cuda-graphs`` (``runtime.cuda_graphs``) on CPU: what is refused, and how calls are told apart.

Capture and replay need a GPU: ``tests/test_cuda_fast_paths.py`` shows a graphed FLUX pipeline
bit-exact to the same pipeline without graphs.
"""

from __future__ import annotations

import pytest
import torch

from tilecast.runtime import cuda_graphs


def test_signature_tells_shapes_and_values_apart_but_not_tensor_contents():
    a = cuda_graphs._signature((torch.zeros(2, 3),), {"t": torch.ones(2), "return_dict": False})
    assert a == cuda_graphs._signature((torch.ones(2, 3),), {"return_dict": False, "t": torch.zeros(2)})
    assert a != cuda_graphs._signature((torch.zeros(1, 3),), {"t": torch.ones(2), "return_dict": False})
    assert a != cuda_graphs._signature(
        (torch.zeros(2, 3, dtype=torch.float16),), {"t": torch.ones(2), "return_dict": False}
    )
    assert a != cuda_graphs._signature((torch.zeros(2, 3),), {"t": torch.ones(2), "return_dict": True})
    # FluxPipeline passes joint_attention_kwargs={}: plain containers are part of the key
    assert cuda_graphs._signature((), {"k": {}}) != cuda_graphs._signature((), {"k": {"scale": 1.0}})


def test_arguments_and_outputs_it_cannot_replay_are_named():
    with pytest.raises(TypeError, match="takes tensors and plain values .* got Tensor"):
        cuda_graphs._signature((), {"joint_attention_kwargs": {"ip_adapter_image_embeds": [torch.zeros(1)]}})
    with pytest.raises(TypeError, match="takes tensors and plain values .* got object"):
        cuda_graphs._signature((object(),), {})
    with pytest.raises(TypeError, match="must return a tensor or a tuple/list of tensors, got dict"):
        cuda_graphs._clone_out({"sample": torch.zeros(1)})
    out = (torch.zeros(2),)
    cloned = cuda_graphs._clone_out(out)
    assert isinstance(cloned, tuple) and cloned[0].data_ptr() != out[0].data_ptr()


def test_install_refuses_a_model_off_the_gpu():
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device; the model is on cpu"):
        cuda_graphs.install(torch.nn.Linear(2, 2))


def test_serve_refuses_cuda_graphs_on_cpu_naming_the_flag():
    from typer.testing import CliRunner

    from tilecast.launcher.cli import app

    result = CliRunner().invoke(app, ["serve", "--device", "cpu", "--cuda-graphs"])
    assert result.exit_code == 2 and "--cuda-graphs needs --device cuda, got --device cpu" in " ".join(
        result.output.split()
    )


def test_k6sr_refuses_cuda_graphs_instead_of_ignoring_it(tmp_path):
    from tests.harness import make_context
    from tilecast.runtime.config import ServeConfig
    from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline

    ctx = make_context(tmp_path, settings=ServeConfig(device="cuda", cuda_graphs=True))  # refused before any CUDA call
    with pytest.raises(ValueError, match=r"--cuda-graphs \(one DiT call is seconds.*\) is not supported by tiny/k6sr"):
        K6SRPipeline.load("tiny/k6sr", ctx)


def test_flux_installs_cuda_graphs_and_refuses_them_off_the_gpu(tiny_cache):
    from tilecast.runtime.config import ServeConfig
    from tilecast.runtime.models.families.flux import FluxT2IPipeline

    pipe = FluxT2IPipeline.build_diffusers("tiny/flux", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device; the model is on cpu"):
        FluxT2IPipeline.install_fast_paths(pipe, ServeConfig(device="cuda", dtype="float32", cuda_graphs=True))
