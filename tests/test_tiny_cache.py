"""Built-in checkpoints are generated once, by one process, and verified on every use (issue 18 item 8).

``tiny/flux`` is the model here: it has two transformers text encoders, the components whose
``save_pretrained`` writes nothing on a process whose ``torch.distributed`` rank is not 0.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest

from tests.distributed import run_ranks
from tilecast.runtime.cache import MARKER, check_model_dir, check_structure
from tilecast.runtime.models.families.flux import TINY_FLUX

TEXT_ENCODER_WEIGHTS = ("text_encoder/model.safetensors", "text_encoder_2/model.safetensors")


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a checkpoint except the completion marker."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, bytes]:
    """The files of one plain build (no process group, no cache): what every cached copy must hold."""
    files = _files(TINY_FLUX.write(tmp_path_factory.mktemp("reference") / "ckpt"))
    assert set(TEXT_ENCODER_WEIGHTS) <= set(files)
    return files


def _assert_text_encoders_load(directory: Path) -> None:
    from transformers import CLIPTextModel, T5EncoderModel

    for cls, sub in ((CLIPTextModel, "text_encoder"), (T5EncoderModel, "text_encoder_2")):
        model, info = cls.from_pretrained(str(directory / sub), local_files_only=True, output_loading_info=True)
        assert not info["missing_keys"], (sub, info["missing_keys"])


# ---------------------------------------------------------------------------- concurrent builders


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.built = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.built += record.getMessage().startswith("wrote the tiny checkpoint")


def _build_on_rank(rank: int, world_size: int, cache: str) -> int:
    """Both ranks (gloo group initialised) ask for the checkpoint; rank 1 first, so the rank whose
    ``save_pretrained`` skips the text encoders is the one that gets to build. Returns builds done here."""
    counter = _Count()
    logging.getLogger("tilecast.runtime.cache").addHandler(counter)
    logging.getLogger("tilecast.runtime.cache").setLevel(logging.INFO)
    if rank == 0:
        time.sleep(1.0)  # arrives while rank 1 is building
    directory = TINY_FLUX.ensure(Path(cache))
    assert directory == Path(cache) / "models" / TINY_FLUX.name
    return counter.built


@pytest.mark.timeout(150)
def test_two_ranks_on_a_fresh_cache_build_one_complete_checkpoint(tmp_path, reference):
    builds = run_ranks(_build_on_rank, 2, str(tmp_path), timeout=120)
    assert sum(builds) == 1, builds  # one builder; the other waited and found it finished
    directory = tmp_path / "models" / TINY_FLUX.name
    assert sorted(_files(directory)) == sorted(reference)  # the text encoders' weights are there
    assert _files(directory) == reference  # byte for byte
    _assert_text_encoders_load(directory)
    assert check_model_dir(directory) is None
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [TINY_FLUX.name]  # no staging left


def test_a_weightless_build_is_refused_before_it_is_marked(tmp_path, reference):
    built = TINY_FLUX.write(tmp_path / "ckpt")
    assert check_structure(built) is None
    (built / "text_encoder" / "model.safetensors").unlink()  # what a rank-1 save_pretrained leaves
    assert check_structure(built) == "component text_encoder/ has a config.json but no weights"


# ---------------------------------------------------------------------------- broken caches


def _truncate(directory: Path) -> None:
    weights = directory / "text_encoder" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _no_marker(directory: Path) -> None:
    (directory / MARKER).unlink()


def _flip_a_byte(directory: Path) -> None:
    weights = directory / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))


def _weightless_legacy(directory: Path) -> None:
    """Today's broken cache: the rank-1 copy (text encoders empty) without a marker."""
    _no_marker(directory)
    for sub in ("text_encoder", "text_encoder_2"):
        shutil.rmtree(directory / sub)
        (directory / sub).mkdir()


@pytest.mark.parametrize(
    "damage, fault",
    [
        (_truncate, "text_encoder/model.safetensors has"),
        (_no_marker, "no completion marker"),
        (_flip_a_byte, "transformer/diffusion_pytorch_model.safetensors does not match its sha256"),
        (_weightless_legacy, "no completion marker"),
    ],
)
def test_a_broken_cache_is_detected_logged_and_rebuilt(tmp_path, reference, damage, fault, caplog):
    directory = TINY_FLUX.ensure(tmp_path)
    assert check_model_dir(directory) is None
    damage(directory)
    assert fault in check_model_dir(directory)
    with caplog.at_level(logging.WARNING, logger="tilecast.runtime.cache"):
        again = TINY_FLUX.ensure(tmp_path)
    assert again == directory
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(directory) in w and fault in w for w in warnings), warnings
    assert check_model_dir(directory) is None
    assert _files(directory) == reference
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [TINY_FLUX.name]  # broken copy gone


# ---------------------------------------------------------------------------- the served path


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_serve_on_a_fresh_cache_serves(tmp_path, reference):
    from tests.harness import ServerProcess, serve_args

    cache = tmp_path / "cache"
    server = ServerProcess(
        *serve_args("tiny/flux", tmp_path / "out", num_gpus=2),
        env={"TILECAST_CACHE": str(cache), "OMP_NUM_THREADS": "1"},
        ready_timeout=200.0,
    )
    try:
        with server.client(timeout=120.0) as client:
            result = client.generate(
                timeout=120.0, prompt="a fresh cache", width=32, height=32, num_inference_steps=1, seed=3
            )
            assert result.job.state == "completed", result
            assert result.files and len(result.files[0].data) > 100
    finally:
        server.stop()
    directory = cache / "models" / TINY_FLUX.name
    assert check_model_dir(directory) is None
    assert _files(directory) == reference
