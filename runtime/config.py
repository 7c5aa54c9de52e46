"""Server-wide settings: one validated value the CLI maps its flags onto.

Every rank builds the same ``ServeConfig`` from the same command line (torchrun passes it on),
so no setting is ever negotiated between ranks.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from pathlib import Path
from typing import Collection

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE_MODES = ("fp8",)
"""``--quantize`` values (the families that read the option say which they take)."""
PARALLEL_DECODE_MODES = ("spatial_shard",)


def check_quantize(value: str | None) -> None:
    """Raise ``ValueError`` naming a ``--quantize`` value that is not one of ``QUANTIZE_MODES``."""
    if value is not None and value not in QUANTIZE_MODES:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_MODES)}, got {value!r}")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable only from this machine."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name or a wildcard ("*", "0.0.0.0" parses and is not loopback)
        return False


def default_dtype(device: str) -> str:
    """The compute dtype when ``--dtype`` is not given: bfloat16 on CUDA, float32 on CPU."""
    return "bfloat16" if device == "cuda" else "float32"


@dataclasses.dataclass(kw_only=True)
class VaeConfig:
    use_parallel_tiling: bool = False
    """Deal whole tiles to the ranks of the decode group (bit-exact to serial)."""
    use_parallel_decode: bool = False
    """Split each tile's height across the decode group (halo exchange; not bit-exact)."""
    parallel_decode_mode: str = "spatial_shard"
    """How ``use_parallel_decode`` splits a tile; only ``spatial_shard`` exists."""
    fast_decode: bool = True
    """Decode with tilecast's channels-last K-VAE decoder (``runtime/k6sr/vae_decode.py``: diffusers'
    weights and arithmetic, about 2x faster); false: diffusers' own ``Kandinsky6SRVAE.decode``.
    Spatial-shard decode and a streamed or offloaded VAE always use diffusers' decode."""

    def __post_init__(self) -> None:
        if self.parallel_decode_mode not in PARALLEL_DECODE_MODES:
            raise ValueError(
                f"--vae-config.parallel-decode-mode must be one of {PARALLEL_DECODE_MODES},"
                f" got {self.parallel_decode_mode!r}"
            )


@dataclasses.dataclass(kw_only=True)
class ServeConfig:
    model_path: str = "tiny/k6sr"
    """A built-in model name (``tiny/k6sr``, ...) or a local diffusers-format directory."""
    model_id: str | None = None
    """Routing hint for a renamed checkpoint directory (e.g. ``Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers``)."""
    num_gpus: int = 1
    """Number of ranks to run (GPUs on CUDA, processes on CPU)."""
    tp_size: int = 1
    """Tensor-parallel degree of the DiT's linear layers."""
    ulysses_degree: int = 1
    """Ulysses (all-to-all) sequence-parallel degree."""
    ring_degree: int = 1
    """Ring sequence-parallel degree."""
    device: str = "cuda"
    """``cuda`` or ``cpu``."""
    dtype: str | None = None
    """Compute dtype; default bfloat16 on CUDA, float32 on CPU."""
    host: str = "127.0.0.1"
    """Interface the scheduler's ROUTER socket binds (another one only when asked)."""
    port: int = 30010
    """Port of the scheduler's ROUTER socket (0: pick a free one)."""
    attention_backend: str | None = None
    """Attention backend name (None: the fastest correct one for the device)."""
    vae: VaeConfig = dataclasses.field(default_factory=VaeConfig)
    """Parallel decode settings (``--vae-config.*``)."""
    compile: bool = False
    """``torch.compile`` the DiT's repeated blocks (CUDA; the first request pays the compile time)."""
    quantize: str | None = None
    """``fp8``: FP8 weights and activations in the DiT blocks' linear layers (FLUX; opt-in: faster,
    and the output moves by a few percent). None: the model's dtype throughout."""
    cuda_graphs: bool = False
    """Replay the DiT's forward as CUDA graphs, one per batch shape (FLUX; CUDA only): each step is
    then one launch, so its time no longer depends on how fast the host issues kernels."""
    tile_parallel: bool = False
    """Deal whole tile chunks to data-parallel groups for the DiT too (identical output)."""
    batching_mode: str = "off"
    """``off`` or ``dynamic``."""
    batching_max_size: int = 1
    """Largest merged batch (1: no batching)."""
    batching_delay_ms: float = 5.0
    """How long the head of the queue may wait for companions."""
    batching_config: Path | None = None
    """JSON rules file with per-model/resolution caps."""
    enable_batching_metrics: bool = False
    """Log one line per dispatch and a summary every few dispatches."""
    max_queued_requests: int = 256
    """Queue bound; a submit beyond it is refused at once as overloaded."""
    max_message_mb: float = 512.0
    """Largest accepted ZeroMQ message (ZMQ_MAXMSGSIZE); bigger ones are dropped."""
    heartbeat_timeout_s: float = 10.0
    """A rank silent this long is declared dead and every job fails."""
    stuck_timeout_s: float = 300.0
    """A busy rank without progress this long is declared stuck and every job fails."""
    output_dir: Path = Path("outputs")
    """Where the output rank writes result files."""
    allowed_video_dirs: tuple[Path, ...] = ()
    """Directories whose files a request's ``video_path`` may name."""
    http_port: int | None = None
    """Port of rank 0's OpenAI-style HTTP front end (None: no HTTP; 0: pick a free one)."""
    http_host: str = "127.0.0.1"
    """Interface the HTTP front end binds (another one only when asked)."""
    api_key: str | None = dataclasses.field(default=None, repr=False)
    """Shared secret every client must present (``--api-key`` or ``$TILECAST_API_KEY``): HTTP as
    ``Authorization: Bearer <key>``, ZeroMQ through CURVE keys derived from it. None: no
    authentication, which is allowed only on loopback addresses unless ``allow_unauthenticated``."""
    allow_unauthenticated: bool = False
    """Serve a non-loopback ``host`` / ``http_host`` without ``api_key`` (anyone who reaches the port
    can submit and read results)."""
    ready_file: Path | None = None
    """Written by rank 0 once it serves (JSON: the bound ZeroMQ endpoint, the HTTP URL, the pid),
    so a supervisor learns the ports of ``--port 0`` / ``--http-port 0`` without racing for them."""
    output_retention_s: float | None = None
    """Delete a finished job's output files this long after it finished (None: keep them until
    ``max_stored_outputs`` pushes them out)."""
    max_stored_outputs: int = 10_000
    """Keep the output files of at most this many finished jobs; the oldest go first."""
    max_queued_upload_mb: float = 2048.0
    """Total size of the uploads held by queued jobs; a submit beyond it is refused as overloaded
    (HTTP 503 with Retry-After) instead of growing rank 0's memory."""
    max_upload_mb: float = 512.0
    """Largest HTTP request body (uploaded video and fields); a larger one is refused with 413
    before it is read. At most ``max_message_mb``, since the upload travels to the scheduler in one message."""
    layerwise_offload_components: str | None = None
    """Components whose blocks stream from host memory just before they run (``all``, or
    ``transformer``/``vae``/``latent_upscaler``, space or comma separated; None: none). Non-block
    weights and temporal caches stay on the device. See ``runtime/placement.py``."""
    cpu_offload_components: str | None = None
    """Components kept in host memory and moved to the device whole around their use (same
    syntax; disjoint from ``layerwise_offload_components``; None: none)."""
    dit_offload_prefetch_size: int = 1
    """DiT blocks prefetched ahead while streaming the DiT (1-4; ignored, with a warning, unless
    ``layerwise_offload_components`` includes the transformer)."""
    dit_layerwise_resident_layers: int = 0
    """Leading DiT blocks kept on the device while streaming the DiT (0-8; ignored, with a
    warning, unless ``layerwise_offload_components`` includes the transformer)."""
    use_fsdp_inference: bool = False
    """Shard the DiT's weights across all ranks with FSDP2 (at least 2 ranks; not with TP, not
    with the DiT offloaded)."""

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        if self.batching_config is not None:
            self.batching_config = Path(self.batching_config)
        self.allowed_video_dirs = tuple(Path(p) for p in self.allowed_video_dirs)
        for name in ("num_gpus", "tp_size", "ulysses_degree", "ring_degree", "batching_max_size",
                     "max_queued_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        check_quantize(self.quantize)
        if self.cuda_graphs and self.device != "cuda":
            raise ValueError(f"--cuda-graphs needs --device cuda, got --device {self.device}")
        if self.batching_mode not in ("off", "dynamic"):
            raise ValueError(f"--batching-mode must be off or dynamic, got {self.batching_mode!r}")
        if self.batching_delay_ms < 0:
            raise ValueError(f"--batching-delay-ms must be >= 0, got {self.batching_delay_ms}")
        if self.max_message_mb <= 0:
            raise ValueError(f"--max-message-mb must be > 0, got {self.max_message_mb}")
        if self.heartbeat_timeout_s <= 1.0:
            raise ValueError(f"--heartbeat-timeout-s must be > 1, got {self.heartbeat_timeout_s}")
        if self.stuck_timeout_s <= 0:
            raise ValueError(f"--stuck-timeout-s must be > 0, got {self.stuck_timeout_s}")
        if self.http_port is not None and (isinstance(self.http_port, bool) or not isinstance(self.http_port, int)
                                           or not 0 <= self.http_port <= 65535):
            raise ValueError(f"--http-port must be in 0..65535, got {self.http_port!r}")
        if self.output_retention_s is not None and not self.output_retention_s > 0:
            raise ValueError(f"--output-retention-s must be > 0, got {self.output_retention_s}")
        if isinstance(self.max_stored_outputs, bool) or not isinstance(self.max_stored_outputs, int) \
                or self.max_stored_outputs < 1:
            raise ValueError(f"--max-stored-outputs must be a positive integer, got {self.max_stored_outputs!r}")
        if not self.max_queued_upload_mb > 0:
            raise ValueError(f"--max-queued-upload-mb must be > 0, got {self.max_queued_upload_mb}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        if self.ready_file is not None:
            self.ready_file = Path(self.ready_file)
        exposed = [f"--{name.replace('_', '-')} {value}" for name, value in
                   (("host", self.host), ("http_host", self.http_host if self.http_port is not None else None))
                   if value is not None and not is_loopback(value)]
        if exposed and self.api_key is None and not self.allow_unauthenticated:
            raise ValueError(
                f"{exposed[0]} is reachable from other machines but no --api-key (or TILECAST_API_KEY) is set:"
                " anyone could submit jobs, read results and stop the server. Set a key, or pass"
                " --allow-unauthenticated to serve it open on purpose"
            )
        if not self.max_upload_mb > 0:
            raise ValueError(f"--max-upload-mb must be > 0, got {self.max_upload_mb}")
        placement = self.placement  # ValueError naming the flag
        self.layerwise_offload_components = placement.as_options()["layerwise_offload_components"]
        self.cpu_offload_components = placement.as_options()["cpu_offload_components"]
        placement.check_topology(
            world_size=self.num_gpus, check_rank_count=False,  # FSDP on one GPU: the picker's rule (cli)
            tp_size=self.tp_size, unit_size=self.tp_size * self.ulysses_degree * self.ring_degree,
            tile_parallel=self.tile_parallel,
        )
        if self.http_port is not None and self.max_upload_mb > self.max_message_mb:
            raise ValueError(
                f"--max-upload-mb {self.max_upload_mb:g} exceeds --max-message-mb {self.max_message_mb:g}: an upload"
                " travels to the scheduler in one message, so raise --max-message-mb too"
            )

    @property
    def placement(self):
        """The validated ``tilecast.runtime.placement.PlacementConfig`` of the placement fields."""
        from tilecast.runtime.placement import PlacementConfig  # imports torch: only when used

        return PlacementConfig(
            layerwise_offload_components=self.layerwise_offload_components,
            cpu_offload_components=self.cpu_offload_components,
            dit_offload_prefetch_size=self.dit_offload_prefetch_size,
            dit_layerwise_resident_layers=self.dit_layerwise_resident_layers,
            use_fsdp_inference=self.use_fsdp_inference,
        )

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or default_dtype(self.device)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port if self.port else '*'}"

    def pipeline_options(self) -> dict:
        """What pipelines read from ``RankContext.options``."""
        return {
            "model_id": self.model_id,
            "dtype": self.resolved_dtype,
            "attention_backend": self.attention_backend,
            "allowed_video_dirs": [str(p) for p in self.allowed_video_dirs],
            "tp_size": self.tp_size,
            "ulysses_degree": self.ulysses_degree,
            "ring_degree": self.ring_degree,
            "vae": dataclasses.asdict(self.vae),
            "tile_parallel": self.tile_parallel,
            "compile": self.compile,
            "quantize": self.quantize,
            "cuda_graphs": self.cuda_graphs,
            **self.placement.as_options(),
        }


_SWITCHES = {"tile_parallel", "compile", "cuda_graphs"}
"""Options given as bare on/off flags (no value)."""
_FLAG_NAMES = {"allowed_video_dirs": "--allowed-video-dir", "vae": "--vae-config"}


def _flag_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def ignored_settings(options: dict, honoured: Collection[str]) -> list[str]:
    """The settings in ``options`` (``ServeConfig.pipeline_options``) that differ from a plain
    ``tilecast serve`` and that a pipeline reading only the option keys ``honoured`` would ignore,
    named as their flags (``--ulysses-degree 2``, ``--vae-config.fast-decode false``, ``--compile``)."""
    notes = []
    for key, default in ServeConfig().pipeline_options().items():
        if key in honoured or key not in options:
            continue
        given, flag = options[key], _FLAG_NAMES.get(key, "--" + key.replace("_", "-"))
        if isinstance(default, dict):
            notes += [f"{flag}.{sub.replace('_', '-')} {_flag_value(value)}"
                      for sub, value in (given or {}).items() if sub in default and value != default[sub]]
        elif given != default:
            notes.append(flag if key in _SWITCHES else f"{flag} {_flag_value(given)}")
    return notes
