"""Flags shared by ``serve`` and ``generate`` (SGLang's names), and their mapping onto ``ServeConfig``."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from tilecast.runtime.config import ServeConfig, VaeConfig

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_bool(value: str | bool, flag: str) -> bool:
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise typer.BadParameter(f"{flag} takes true or false, got {value!r}")


ModelPath = Annotated[str, typer.Option("--model-path", help="Built-in model (tiny/k6sr, ...) or a local diffusers directory.")]
ModelId = Annotated[Optional[str], typer.Option("--model-id", help="Model id that routes a renamed checkpoint directory.")]
NumGpus = Annotated[int, typer.Option("--num-gpus", help="Number of ranks (GPUs, or CPU processes with --device cpu).")]
TpSize = Annotated[Optional[int], typer.Option("--tp-size", help="Tensor-parallel degree (default 1).")]
UlyssesDegree = Annotated[Optional[int], typer.Option("--ulysses-degree", help="Ulysses degree (default: picked from the GPU count and heads).")]
RingDegree = Annotated[Optional[int], typer.Option("--ring-degree", help="Ring degree (default: picked from the GPU count and heads).")]
Device = Annotated[str, typer.Option("--device", help="cuda or cpu.")]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU).")]
AttentionBackend = Annotated[Optional[str], typer.Option("--attention-backend", help="Attention backend (default: fastest correct one).")]
ParallelTiling = Annotated[str, typer.Option("--vae-config.use-parallel-tiling", help="Whole-tile parallel decode: true|false.")]
ParallelDecode = Annotated[str, typer.Option("--vae-config.use-parallel-decode", help="Spatial-shard decode: true|false.")]
ParallelDecodeMode = Annotated[str, typer.Option("--vae-config.parallel-decode-mode", help="spatial_shard.")]
FastDecode = Annotated[str, typer.Option("--vae-config.fast-decode", help="tilecast's channels-last VAE decode (true) or diffusers' own (false).")]
AllowedVideoDir = Annotated[Optional[list[Path]], typer.Option("--allowed-video-dir", help="Directory whose files requests may name as video_path (repeatable).")]
HeartbeatTimeout = Annotated[float, typer.Option("--heartbeat-timeout-s", help="A silent rank is dead after this many seconds.")]
StuckTimeout = Annotated[float, typer.Option("--stuck-timeout-s", help="A busy rank without progress is stuck after this many seconds.")]
Compile = Annotated[bool, typer.Option("--compile", help="torch.compile the DiT blocks (the first request pays the compile time).")]
Quantize = Annotated[Optional[str], typer.Option("--quantize", help="fp8: FP8 linear layers in the DiT blocks (FLUX; faster, output moves by a few percent).")]
CudaGraphs = Annotated[bool, typer.Option("--cuda-graphs", help="Replay the DiT's forward as CUDA graphs, one per batch shape (FLUX, CUDA).")]
TileParallel = Annotated[bool, typer.Option("--tile-parallel", help="Deal whole tile chunks to data-parallel groups for the DiT too (same output).")]
LayerwiseOffload = Annotated[Optional[str], typer.Option("--layerwise-offload-components", help="Stream these components' blocks from host memory: all, or transformer/vae/latent_upscaler (space or comma separated).")]
CpuOffload = Annotated[Optional[str], typer.Option("--cpu-offload-components", help="Move these components to the device whole around their use: all, or transformer/vae/latent_upscaler.")]
DitPrefetch = Annotated[int, typer.Option("--dit-offload-prefetch-size", help="DiT blocks prefetched ahead while streaming the DiT (1-4).")]
DitResidentLayers = Annotated[int, typer.Option("--dit-layerwise-resident-layers", help="Leading DiT blocks kept on the device while streaming the DiT (0-8).")]
UseFsdp = Annotated[str, typer.Option("--use-fsdp-inference", help="Shard the DiT's weights across the ranks with FSDP2: true|false (2+ GPUs).")]
LogLevel = Annotated[str, typer.Option("--log-level", help="Rank 0 log level.")]


def _shared(
    model_path: ModelPath = "tiny/k6sr", model_id: ModelId = None, num_gpus: NumGpus = 1, tp_size: TpSize = None,
    ulysses_degree: UlyssesDegree = None, ring_degree: RingDegree = None, device: Device = "cuda",
    dtype: Dtype = None, attention_backend: AttentionBackend = None, parallel_tiling: ParallelTiling = "false",
    parallel_decode: ParallelDecode = "false", parallel_decode_mode: ParallelDecodeMode = "spatial_shard",
    fast_decode: FastDecode = "true", heartbeat_timeout_s: HeartbeatTimeout = 10.0,
    stuck_timeout_s: StuckTimeout = 300.0, layerwise_offload_components: LayerwiseOffload = None,
    cpu_offload_components: CpuOffload = None, dit_offload_prefetch_size: DitPrefetch = 1,
    dit_layerwise_resident_layers: DitResidentLayers = 0, use_fsdp_inference: UseFsdp = "false",
    tile_parallel: TileParallel = False, compile_dit: Compile = False, quantize: Quantize = None,
    cuda_graphs: CudaGraphs = False,
) -> None:
    """Declares the options ``serve`` and ``generate`` share, with their defaults (``with_shared_options``)."""


def shared_options(template: Callable[..., None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator giving typer commands the options declared by ``template``'s signature, before
    their own; a decorated command takes them as one dict, its parameter ``shared``."""
    shared = list(inspect.signature(template, eval_str=True).parameters.values())
    names = [p.name for p in shared]

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "shared"]

        @functools.wraps(command)
        def run(**kwargs):
            return command(shared={name: kwargs.pop(name) for name in names}, **kwargs)

        parameters = [*shared, *own]
        run.__signature__ = inspect.Signature(parameters)
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        del run.__wrapped__  # typer must see the combined signature, not the command's own
        return run

    return decorate


with_shared_options = shared_options(_shared)
"""``serve``'s and ``generate``'s common options (``common_config(**shared, ...)`` takes them)."""


def model_num_heads(model_path: str) -> int | None:
    """The DiT's attention heads (None for a built-in without a DiT, such as the test pipelines)."""
    from tilecast.runtime.registry import BUILTIN_MODELS
    from tilecast.runtime.topology import num_heads_from_checkpoint

    if model_path.startswith("test/") and model_path in BUILTIN_MODELS:
        return None
    return num_heads_from_checkpoint(model_path)


def common_config(
    *, model_path: str, model_id: str | None, num_gpus: int, tp_size: int, ulysses_degree: int, ring_degree: int,
    device: str, dtype: str | None, attention_backend: str | None, parallel_tiling: str, parallel_decode: str,
    parallel_decode_mode: str, fast_decode: str = "true", allowed_video_dir: list[Path] | None, heartbeat_timeout_s: float,
    stuck_timeout_s: float, output_dir: Path, layerwise_offload_components: str | None = None,
    cpu_offload_components: str | None = None, dit_offload_prefetch_size: int = 1,
    dit_layerwise_resident_layers: int = 0, use_fsdp_inference: str | bool = False, tile_parallel: bool = False,
    compile_dit: bool = False, quantize: str | None = None, cuda_graphs: bool = False, **extra,
) -> ServeConfig:
    """Build the validated config; ``ValueError`` (shown as a usage error) names the bad value.

    With none of the three degrees given, the layout is picked: the largest Ulysses degree that
    divides both the GPU count and the model's heads, the rest in Ring."""
    num_heads = model_num_heads(model_path)
    if tp_size is None and ulysses_degree is None and ring_degree is None:
        from tilecast.runtime.picker import suggest_topology

        layout = suggest_topology(num_gpus, num_heads=num_heads or 0) if num_gpus >= 1 else None
        tp_size, ulysses_degree, ring_degree = (1, layout.ulysses_degree, layout.ring_degree) if layout else (1, 1, 1)
    tp_size, ulysses_degree, ring_degree = tp_size or 1, ulysses_degree or 1, ring_degree or 1
    vae = VaeConfig(
        use_parallel_tiling=parse_bool(parallel_tiling, "--vae-config.use-parallel-tiling"),
        use_parallel_decode=parse_bool(parallel_decode, "--vae-config.use-parallel-decode"),
        parallel_decode_mode=parallel_decode_mode,
        fast_decode=parse_bool(fast_decode, "--vae-config.fast-decode"),
    )
    return ServeConfig(
        model_path=model_path, model_id=model_id, num_gpus=num_gpus, tp_size=tp_size,
        ulysses_degree=ulysses_degree, ring_degree=ring_degree, device=device, dtype=dtype,
        attention_backend=attention_backend, vae=vae,
        allowed_video_dirs=tuple(p.resolve() for p in (allowed_video_dir or [])),
        heartbeat_timeout_s=heartbeat_timeout_s, stuck_timeout_s=stuck_timeout_s, output_dir=output_dir,
        layerwise_offload_components=layerwise_offload_components, cpu_offload_components=cpu_offload_components,
        dit_offload_prefetch_size=dit_offload_prefetch_size, dit_layerwise_resident_layers=dit_layerwise_resident_layers,
        use_fsdp_inference=parse_bool(use_fsdp_inference, "--use-fsdp-inference"), tile_parallel=tile_parallel,
        compile=compile_dit, quantize=quantize, cuda_graphs=cuda_graphs, **extra,
    )
