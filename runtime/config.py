"""Server-wide settings, declared once: ``ServeConfig`` and its nested ``VaeConfig``.

Every field is a ``setting(...)`` with a docstring; ``runtime/settings.py`` derives the flags of
``tilecast serve``/``generate``, their help, the ``--config`` file keys, the per-field checks and
the start-up log from this one declaration. ``BatchingConfig`` (scheduler), ``WatchdogConfig``
and ``PlacementConfig`` are views built from its fields (``batching``, ``watchdog``, ``placement``).

Every rank builds the same ``ServeConfig`` from the same command line (torchrun passes it on),
so no setting is ever negotiated between ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
from pathlib import Path
from typing import Any, Collection

from tilecast.runtime.placement_config import PlacementConfig
from tilecast.runtime.settings import Declared, check_declared, coerce_declared, declared, setting

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE_MODES = ("fp8",)
"""``--quantize`` values (a pipeline that does not honour ``quantize`` refuses them all)."""
PARALLEL_DECODE_MODES = ("spatial_shard",)
BATCHING_MODES = ("off", "dynamic")


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


@dataclasses.dataclass(kw_only=True, frozen=True)
class VaeConfig:
    """The ``--vae-config.*`` settings: how the VAE decodes tiles."""

    use_parallel_tiling: bool = setting(False, section="vae", pipeline=True)
    """Deal whole tiles to the ranks of the decode group (bit-exact to serial)."""
    use_parallel_decode: bool = setting(False, section="vae", pipeline=True)
    """Split each tile's height across the decode group (halo exchange; not bit-exact)."""
    parallel_decode_mode: str = setting("spatial_shard", section="vae", choices=PARALLEL_DECODE_MODES, pipeline=True)
    """How ``use_parallel_decode`` splits a tile; only ``spatial_shard`` exists."""
    fast_decode: bool = setting(True, section="vae", pipeline=True)
    """Decode with tilecast's channels-last K-VAE decoder (diffusers' weights and arithmetic, about
    2x faster); false: diffusers' own ``Kandinsky6SRVAE.decode``. Spatial-shard decode and a
    streamed or offloaded VAE always use diffusers' decode."""
    fp8_convs: bool = setting(False, section="vae", pipeline=True)
    """Run the K-VAE decoder's convolutions wider than 16 channels in FP8 (e4m3, float32
    accumulation; Hopper GPUs; on ``fast_decode``'s decoder, so refused where that does not run).
    Opt-in: a faster decode whose output moves (``tilecast bench fp8-conv`` reports by how much)."""

    def __post_init__(self) -> None:
        check_declared(self)


@dataclasses.dataclass(kw_only=True, frozen=True)
class ServeConfig:
    """Everything ``tilecast serve`` and ``generate`` can be told (a section per ``--help`` group)."""

    # -- model and device
    model_path: str = setting("tiny/k6sr", section="model", metavar="PATH")
    """A built-in model name (``tiny/k6sr``, ...), a released hub id or a local diffusers-format directory."""
    model_id: str | None = setting(None, section="model", metavar="ID")
    """Routing hint for a renamed checkpoint directory (e.g. ``Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers``)."""
    transformer_weights_path: str | None = setting(None, section="model", metavar="PATH", pipeline=True)
    """Single-file transformer weights that replace the ``--model-path`` pipeline's own (SGLang's
    flag): a ``.safetensors`` file, its folder or a Hub id. FLUX.2-dev reads BFL-format NVFP4 weights
    here (``black-forest-labs/FLUX.2-dev-NVFP4``), dequantized at load on GPUs without FP4 tensor cores."""
    device: str = setting("cuda", section="model", choices=("cpu", "cuda"))
    """Where the ranks compute."""
    dtype: str | None = setting(None, section="model", choices=DTYPES, pipeline=True)
    """Compute dtype (default: bfloat16 on CUDA, float32 on CPU)."""
    # -- parallelism
    num_gpus: int = setting(1, section="parallel", ge=1, metavar="N")
    """Number of ranks to run (GPUs on CUDA, processes on CPU)."""
    tp_size: int = setting(1, section="parallel", ge=1, picked=True, metavar="N", pipeline=True)
    """Tensor-parallel degree of the DiT's linear layers."""
    ulysses_degree: int = setting(1, section="parallel", ge=1, picked=True, metavar="N", pipeline=True)
    """Ulysses (all-to-all) sequence-parallel degree."""
    ring_degree: int = setting(1, section="parallel", ge=1, picked=True, metavar="N", pipeline=True)
    """Ring sequence-parallel degree."""
    dp_degree: int | None = setting(None, section="parallel", ge=1, metavar="N")
    """Data-parallel replica groups, each a full copy of the model serving its own batches (``serve``:
    rank 0 dispatches different batches to different groups at once). Must equal ``num_gpus / (TP x
    Ulysses x Ring)``; unset: that quotient (``--tile-parallel`` then keeps one group of all ranks)."""
    tile_parallel: bool = setting(False, section="parallel", pipeline=True)
    """Deal whole tile chunks to data-parallel groups for the DiT too (identical output)."""
    # -- VAE decode
    vae: VaeConfig = setting(default_factory=VaeConfig, section="vae", flag="--vae-config")
    """Parallel decode settings (``--vae-config.*``)."""
    # -- weight placement (the PlacementConfig view checks the values)
    layerwise_offload_components: str | None = setting(None, section="placement", metavar="LIST", pipeline=True)
    """Components whose blocks stream from host memory just before they run: ``all``, or
    ``transformer``/``vae``/``latent_upscaler``, space or comma separated. Non-block weights and
    temporal caches stay on the device. See ``runtime/placement.py``."""
    cpu_offload_components: str | None = setting(None, section="placement", metavar="LIST", pipeline=True)
    """Components kept in host memory and moved to the device whole around their use (same
    syntax; disjoint from ``layerwise_offload_components``)."""
    dit_offload_prefetch_size: int = setting(1, section="placement", metavar="N", pipeline=True)
    """DiT blocks prefetched ahead while streaming the DiT (1-4; refused unless
    ``layerwise_offload_components`` includes the transformer)."""
    dit_layerwise_resident_layers: int = setting(0, section="placement", metavar="N", pipeline=True)
    """Leading DiT blocks kept on the device while streaming the DiT (0-8; refused unless
    ``layerwise_offload_components`` includes the transformer)."""
    use_fsdp_inference: bool = setting(False, section="placement", pipeline=True)
    """Shard the DiT's weights across all ranks with FSDP2 (at least 2 ranks; not with TP, not
    with the DiT offloaded)."""
    # -- performance
    attention_backend: str | None = setting(None, section="performance", metavar="NAME", pipeline=True)
    """Attention backend name (default: the fastest correct one for the device)."""
    compile: bool = setting(False, section="performance", pipeline=True)
    """``torch.compile`` the DiT's repeated blocks (CUDA; the first request pays the compile time)."""
    quantize: str | None = setting(None, section="performance", choices=QUANTIZE_MODES, pipeline=True)
    """``fp8``: FP8 weights and activations in the DiT blocks' linear layers (FLUX; opt-in: faster,
    and the output moves by a few percent). Unset: the model's dtype throughout."""
    allow_dense_attention_fallback: bool = setting(False, section="performance", pipeline=True)
    """Serve a checkpoint released with a sparse attention tilecast lacks (FastWan's video sparse
    attention, TurboWan's SLA) with dense attention instead, with a warning in the log: the output
    differs from the release's. Unset: such a checkpoint is refused at load, naming the attention."""
    cuda_graphs: bool = setting(False, section="performance", pipeline=True)
    """Replay the DiT's forward as CUDA graphs, one per batch shape (FLUX; CUDA only): each step is
    then one launch, so its time no longer depends on how fast the host issues kernels."""
    # -- watchdog
    heartbeat_timeout_s: float = setting(10.0, section="watchdog", gt=1.0, metavar="S")
    """A rank silent this long is declared dead and every job fails."""
    stuck_timeout_s: float = setting(300.0, section="watchdog", gt=0.0, metavar="S")
    """A busy rank without progress this long is declared stuck and every job fails."""
    # -- scheduler (serve only)
    host: str = setting("127.0.0.1", section="server")
    """Interface the scheduler's ZeroMQ ROUTER socket binds (another one only when asked)."""
    port: int = setting(30010, section="server", ge=0, le=65535)
    """Port of the scheduler's ROUTER socket (0: pick a free one)."""
    max_queued_requests: int = setting(256, section="server", ge=1, metavar="N")
    """Queue bound; a submit beyond it is refused at once as overloaded."""
    max_message_mb: float = setting(512.0, section="server", gt=0.0, metavar="MB")
    """Largest accepted ZeroMQ message (ZMQ_MAXMSGSIZE); bigger ones are dropped."""
    max_queued_upload_mb: float = setting(2048.0, section="server", gt=0.0, metavar="MB")
    """Total size of the uploads held by queued jobs; a submit beyond it is refused as overloaded
    (HTTP 503 with Retry-After) instead of growing rank 0's memory."""
    ready_file: Path | None = setting(None, section="server", metavar="FILE")
    """Written by rank 0 once it serves (JSON: the bound ZeroMQ endpoint, the HTTP URL, the pid),
    so a supervisor learns the ports of ``--port 0`` / ``--http-port 0`` without racing for them."""
    # -- dynamic batching (serve only; the BatchingConfig view)
    batching_mode: str = setting("off", section="batching", choices=BATCHING_MODES)
    """``off``: every request runs alone; ``dynamic``: compatible queued requests merge."""
    batching_max_size: int = setting(1, section="batching", ge=1, metavar="N")
    """Largest merged batch (1: no batching; above 1 only with ``batching_mode`` dynamic)."""
    batching_delay_ms: float = setting(5.0, section="batching", ge=0.0, metavar="MS")
    """How long the head of the queue may wait for companions."""
    batching_config: Path | None = setting(None, section="batching", metavar="FILE")
    """JSON rules file with per-model/resolution caps (only with ``batching_mode`` dynamic)."""
    enable_batching_metrics: bool = setting(False, section="batching")
    """Log one line per dispatch and a summary every few dispatches."""
    # -- HTTP API (serve only)
    http_port: int | None = setting(None, section="http", ge=0, le=65535)
    """Serve rank 0's OpenAI-style HTTP API on this port (off unless given; 0: pick a free one)."""
    http_host: str = setting("127.0.0.1", section="http")
    """Interface the HTTP API binds (another one only when asked)."""
    max_upload_mb: float = setting(512.0, section="http", gt=0.0, metavar="MB")
    """Largest HTTP request body (uploaded video and fields); a larger one is refused with 413
    before it is read. At most ``max_message_mb``, since the upload travels to the scheduler in one message."""
    # -- security (serve only)
    api_key: str | None = setting(None, section="security", envvar="TILECAST_API_KEY", secret=True, metavar="KEY")
    """Shared secret every client must present: HTTP as ``Authorization: Bearer <key>``, ZeroMQ
    through CURVE keys derived from it. Unset: no authentication, which is allowed only on
    loopback addresses unless ``allow_unauthenticated``."""
    allow_unauthenticated: bool = setting(False, section="security")
    """Serve a non-loopback ``host`` / ``http_host`` without ``api_key`` (anyone who reaches the port
    can submit and read results)."""
    allowed_video_dirs: tuple[Path, ...] = setting(
        (), section="security", flag="--allowed-video-dir", metavar="DIR", pipeline=True
    )
    """Directories whose files a request's ``video_path`` may name (the flag repeats)."""
    lora_paths: tuple[str, ...] = setting((), section="model", flag="--lora-path", metavar="[NAME=]PATH", pipeline=True)
    """LoRA adapters to load at start (diffusers' ``load_lora_weights`` format, ``.safetensors``;
    the flag repeats; NAME defaults to the file's stem). The first is active and merged, as after
    SGLang's ``set_lora``."""
    lora_dirs: tuple[Path, ...] = setting((), section="security", flag="--lora-dir", metavar="DIR", pipeline=True)
    """Directories whose ``.safetensors`` files ``set_lora`` may load while serving (the flag repeats)."""
    # -- outputs (serve only)
    output_dir: Path = setting(Path("outputs"), section="outputs", metavar="DIR")
    """Where the output rank writes result files."""
    output_retention_s: float | None = setting(None, section="outputs", gt=0.0, metavar="S")
    """Delete a finished job's output files this long after it finished (unset: keep them until
    ``max_stored_outputs`` pushes them out)."""
    max_stored_outputs: int = setting(10_000, section="outputs", ge=1, metavar="N")
    """Keep the output files of at most this many finished jobs; the oldest go first."""

    def __post_init__(self) -> None:
        if isinstance(self.vae, dict):  # a config file's [vae] table
            object.__setattr__(self, "vae", VaeConfig(**self.vae))
        coerce_declared(self)
        check_declared(self)
        if self.cuda_graphs and self.device != "cuda":
            raise ValueError(f"--cuda-graphs needs --device cuda, got --device {self.device}")
        if self.lora_enabled:
            from tilecast.scheduler.lora import LoraRegistry

            try:
                LoraRegistry.from_settings(self.lora_paths, self.lora_dirs)
            except ValueError as exc:
                raise ValueError(f"--lora-path: {exc}") from None
            missing = [str(d) for d in self.lora_dirs if not Path(d).is_dir()]
            if missing:
                raise ValueError(f"--lora-dir {missing[0]!r} is not a directory")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        exposed = [
            f"--{name.replace('_', '-')} {value}"
            for name, value in (
                ("host", self.host),
                ("http_host", self.http_host if self.http_port is not None else None),
            )
            if value is not None and not is_loopback(value)
        ]
        if exposed and self.api_key is None and not self.allow_unauthenticated:
            raise ValueError(
                f"{exposed[0]} is reachable from other machines but no --api-key (or TILECAST_API_KEY) is set:"
                " anyone could submit jobs, read results and stop the server. Set a key, or pass"
                " --allow-unauthenticated to serve it open on purpose"
            )
        placement = self.placement  # ValueError naming the flag
        for name in ("layerwise_offload_components", "cpu_offload_components"):
            object.__setattr__(self, name, placement.as_fields()[name])  # the canonical spelling
        placement.check_topology(
            world_size=self.num_gpus,
            check_rank_count=False,  # FSDP on one GPU: the picker's rule (cli)
            tp_size=self.tp_size,
            unit_size=self.tp_size * self.ulysses_degree * self.ring_degree,
            tile_parallel=self.tile_parallel,
        )
        if self.batching_mode == "off" and self.batching_max_size > 1:
            raise ValueError(
                f"--batching-max-size {self.batching_max_size} needs --batching-mode dynamic"
                " (with --batching-mode off every request runs alone)"
            )
        if self.batching_mode == "off" and self.batching_config is not None:
            raise ValueError(
                f"--batching-config {self.batching_config} needs --batching-mode dynamic"
                " (with --batching-mode off no rules apply)"
            )
        if self.http_port is not None and self.max_upload_mb > self.max_message_mb:
            raise ValueError(
                f"--max-upload-mb {self.max_upload_mb:g} exceeds --max-message-mb {self.max_message_mb:g}: an upload"
                " travels to the scheduler in one message, so raise --max-message-mb too"
            )

    @property
    def placement(self):
        """The validated ``tilecast.runtime.placement_config.PlacementConfig`` of the placement fields (its
        fields carry the names of this class's)."""
        return PlacementConfig(
            **{field.name: getattr(self, field.name) for field in dataclasses.fields(PlacementConfig)}
        )

    @property
    def batching(self):
        """The scheduler's ``BatchingConfig`` of the batching fields (``--batching-config`` read now)."""
        from tilecast.scheduler.batching import BatchingConfig
        from tilecast.scheduler.batching_rules import BatchingRules

        return BatchingConfig(
            mode=self.batching_mode,
            max_size=self.batching_max_size,
            delay_ms=self.batching_delay_ms,
            rules=BatchingRules.load(self.batching_config) if self.batching_config else None,
            enable_metrics=self.enable_batching_metrics,
        )

    @property
    def watchdog(self):
        """The ``WatchdogConfig`` of the watchdog fields."""
        from tilecast.runtime.watchdog import WatchdogConfig

        return WatchdogConfig(heartbeat_timeout_s=self.heartbeat_timeout_s, stuck_timeout_s=self.stuck_timeout_s)

    @property
    def lora_enabled(self) -> bool:
        """LoRA adapters were asked for (``--lora-path`` or ``--lora-dir``)."""
        return bool(self.lora_paths or self.lora_dirs)

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or default_dtype(self.device)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port if self.port else '*'}"


class UnsupportedSettingError(ValueError):
    """A setting set away from its default that the chosen pipeline cannot honour (start-up stops)."""


def pipeline_settings() -> tuple[Declared, ...]:
    """The declared settings a pipeline reads (``setting(..., pipeline=True)``), leaves of ``vae`` included."""
    return tuple(item for item in declared(ServeConfig) if item.setting.pipeline)


def _flag_text(item: Declared, value: Any) -> str:
    """``item`` as written on the command line with ``value``: ``--compile``, ``--ulysses-degree 2``,
    ``--vae-config.fast-decode false``, ``--allowed-video-dir a --allowed-video-dir b``."""
    if item.kind is bool:
        return item.flag if value and item.default is False else f"{item.flag} {str(value).lower()}"
    if item.multiple:
        return " ".join(f"{item.flag} {one}" for one in value)
    return f"{item.flag} {value}"


def _honours(item: Declared, honoured: Collection[str]) -> bool:
    return item.name in honoured or item.path[0] in honoured


def check_honoured_names(honoured: Collection[str], owner: str) -> None:
    """``TypeError`` when ``honoured`` names something that is not a pipeline setting (a typo in a
    pipeline's ``honoured_settings`` would otherwise refuse the setting it meant to honour)."""
    known = {item.name for item in pipeline_settings()} | {item.path[0] for item in pipeline_settings()}
    unknown = sorted(set(honoured) - known)
    if unknown:
        raise TypeError(f"{owner}.honoured_settings names {', '.join(unknown)}: not pipeline settings of ServeConfig")


def _unsupported(config: ServeConfig, honoured: Collection[str]) -> list[tuple[Declared, Any]]:
    return [
        (item, value)
        for item in pipeline_settings()
        if (value := functools.reduce(getattr, item.path, config)) != item.default and not _honours(item, honoured)
    ]


def unsupported_settings(config: ServeConfig, honoured: Collection[str]) -> list[str]:
    """The pipeline settings of ``config`` set away from their defaults that a pipeline honouring
    only ``honoured`` (field names; ``vae`` for all of ``VaeConfig``, ``vae.<field>`` for one) cannot
    honour, written as their flags (``--ulysses-degree 2``, ``--vae-config.fast-decode false``)."""
    return [_flag_text(item, value) for item, value in _unsupported(config, honoured)]


def honoured_flags(honoured: Collection[str]) -> list[str]:
    """The flags of the pipeline settings ``honoured`` names, in declaration order."""
    return [item.flag for item in pipeline_settings() if _honours(item, honoured)]


def check_honoured(
    config: ServeConfig,
    honoured: Collection[str],
    *,
    pipeline: str,
    model: str | None = None,
    reasons: dict[str, str] | None = None,
) -> None:
    """Raise ``UnsupportedSettingError`` naming every setting of ``config`` that the pipeline
    ``pipeline`` (its family name; ``model``: the ``--model-path``) does not honour, and listing what
    it does honour. ``reasons``: field name → why that setting cannot apply (added to the message)."""
    check_honoured_names(honoured, pipeline)
    reasons = reasons or {}
    refused = []
    for item, value in _unsupported(config, honoured):
        why = reasons.get(item.name) or reasons.get(item.path[0])
        refused.append(_flag_text(item, value) + (f" ({why})" if why else ""))
    if refused:
        supported = ", ".join(honoured_flags(honoured)) or "none of the pipeline settings"
        verb = "is" if len(refused) == 1 else "are"
        raise UnsupportedSettingError(
            f"{'; '.join(refused)} {verb} not supported by {model or config.model_path} ({pipeline} honours: "
            f"{supported}; leave the others at their defaults)"
        )
