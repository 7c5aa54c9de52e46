"""The Kandinsky 6 SR deployment picker's recipe rules, for ``tilecast topology`` and start-up warnings.

These are the deployment guide's recipes, not what tilecast can run: ``runtime/topology.py``
(``Topology.check``) is the one rule set that decides that, and ``serve``/``generate`` refuse
only on its errors. The picker's findings for a command line (``recipe_findings``) are logged
at start as warnings; ``tilecast topology check|auto|plan`` shows them beside the rule set's.

The reference cookbook page ships an interactive picker (hardware, GPU count, topology,
attention, decode, weight placement, request options) that validates a selection, picks an
automatic layout, lists warnings and builds a serve command. This module reproduces those
rules; the warning and error texts are the picker's own, kept verbatim because operators
compare them with the page. Where tilecast differs, the difference is named below and in
the function that makes it:

- ``num_heads`` is a parameter (the picker hard-codes the 28 heads of Kandinsky 6 SR); the
  heads message names the given count, and is the picker's exact text for 28.
- ``auto_topology`` reproduces the picker for 28 heads and 1-8 GPUs, including its layouts for
  3, 5 and 6 GPUs, which ``validate_topology`` then rejects, as the picker does. For other head
  counts or GPU counts it takes the largest Ulysses degree dividing both, the rest to Ring.
- The picker's UI clamps GPUs per node to 1-8; here that limit is a recipe error (one node).
- ``gpus_per_node`` holds the world size; with ``nodes`` > 1 the picker's one-node rule fires.
- ``notes`` also lists the picker's per-option cautions (soft reasons, hints, "unverified"
  descriptions) and settings that the selection ignores; the picker shows those beside the
  options rather than in its warnings list.
- The serve flags are tilecast's: no ``--performance-mode``/``--warmup-mode``/``--host``/
  ``--port`` (sglang-only or defaulted), and the decode/placement option flags are included.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import shlex
from typing import Any

logger = logging.getLogger(__name__)

PICKER_NUM_HEADS = 28
"""Attention heads of the Kandinsky 6 SR DiT, which the picker hard-codes."""
HARDWARE: tuple[str, ...] = ("gb300", "b200", "h200", "h100", "rtxpro6000", "rtx5090")
HARDWARE_LABELS = {
    "gb300": "GB300",
    "b200": "B200",
    "h200": "H200",
    "h100": "H100",
    "rtxpro6000": "RTX PRO 6000 (96GB)",
    "rtx5090": "RTX 5090 (32GB)",
}
SM120_HARDWARE: tuple[str, ...] = ("rtxpro6000", "rtx5090")
"""RTX Blackwell parts: the platform attention is SDPA, FA maps to SDPA, no Ring."""
MEASURED_HARDWARE: tuple[str, ...] = ("gb300", "rtxpro6000")
ATTENTION_CHOICES: tuple[str, ...] = ("platform", "fa", "torch_sdpa")
DECODE_CHOICES: tuple[str, ...] = ("serial", "tiles", "spatial")
PLACEMENT_CHOICES: tuple[str, ...] = ("resident", "component", "offload", "fsdp")
OFFLOAD_COMPONENT_CHOICES: tuple[str, ...] = (
    "all",
    "transformer",
    "vae",
    "latent_upscaler",
    "transformer vae",
    "transformer latent_upscaler",
    "vae latent_upscaler",
)
_COMPONENT_ORDER = ("transformer", "transformer_2", "vae", "latent_upscaler")
SCALE_CHOICES: tuple[str, ...] = ("2", "4", "2.25")
TILE_BATCH_CHOICES: tuple[str, ...] = ("1", "2")
GPUS_PER_NODE_RANGE = (1, 8)
PREFETCH_RANGE = (1, 4)
RESIDENT_LAYERS_RANGE = (0, 8)
DEFAULT_MODEL_NAME = "Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"


def _vae_flags(*, tiling: bool, decode: bool) -> tuple[str, ...]:
    return (
        "--vae-config.use-parallel-tiling",
        str(tiling).lower(),
        "--vae-config.use-parallel-decode",
        str(decode).lower(),
    )


DECODE_FLAGS: dict[str, tuple[str, ...]] = {
    "serial": _vae_flags(tiling=False, decode=False),
    "tiles": _vae_flags(tiling=True, decode=False),
    "spatial": _vae_flags(tiling=False, decode=True) + ("--vae-config.parallel-decode-mode", "spatial_shard"),
}
"""The ``serve`` flags of each decode id (``decode_choice`` maps the switches back to the id)."""

# The picker's texts, verbatim (data, not prose of ours).
ERR_DEGREES = "Parallel degrees must be positive integers."
ERR_NODES = "This picker covers one node."
ERR_PRODUCT = "GPU count must equal TP times Ulysses times Ring."
ERR_HEADS = "TP times Ulysses must divide the {num_heads} DiT heads."
ERR_FSDP = "FSDP requires multiple GPUs."
ERR_SDPA_RING = "SDPA does not support Ring rotation."
ERR_FA_SM120 = "FA resolves to SDPA on this SM120 platform; select SDPA instead."
ERR_GPU_RANGE = "This picker covers 1 to 8 GPUs per node."  # ours: the picker's UI clamps instead

WARN_SCOPE = (
    "Verification describes execution, not lossless output. Arbitrary uploaded videos are "
    "outside the fixed HTTP test workload."
)
WARN_UNVERIFIED = (
    "This exact HTTP recipe is unverified. Offline timing does not verify every server and uploaded-video combination."
)
WARN_EXTRAPOLATED_HW = (
    "Extrapolated hardware recipe: no SR latency or peak-memory measurement on this GPU. "
    "Validate a short clip before scaling up."
)
WARN_BACKEND_OVERRIDE = (
    "This backend override is a different numerical path; its full-checkpoint output and performance are unverified."
)
WARN_RTX5090 = (
    "32GB VRAM: start with layerwise offload, tile batch 1 and a short 384 x 256 source. "
    "Offload does not bound activation memory; full-size video may still OOM."
)
WARN_MANY_GPUS = (
    "More than four GPUs is extrapolated. Eight GPUs use Ulysses4 x Ring2 with FA; Ulysses8 cannot divide 28 heads."
)
WARN_RTXPRO_GPUS = "RTX PRO 6000 measurements cover one or two GPUs only; larger GPU counts are extrapolated."
WARN_OFFLOAD = "Offload uses host RAM and transfer bandwidth; prefetch and resident layers additionally consume VRAM."
WARN_SPATIAL = (
    "Not bitwise lossless: spatial decode changes rounding. Tested PSNR 57.51 dB, max pixel "
    "difference 4/255; validate your video."
)
WARN_TILES = (
    "Whole-tile decode matched serial RGB/audio exactly on tested workloads within each "
    "topology, not across different TP/Ring settings."
)
WARN_TP_RING = "TP/Ring can change output numerics independently of the VAE decode mode."
WARN_TILE_BATCH = "Tile batch 2 changes seeded noise and output; it is not lossless."
WARN_ONE_GPU = "One GPU uses serial decoding; this selection provides no parallel speedup."

# Per-option cautions the picker shows beside an option (soft reasons, hints, descriptions).
NOTE_SDPA_SOFT = "SDPA measurements apply to RTX PRO 6000, not every GPU or workload."
NOTE_COMPONENT = (
    "Component offload transfers each selected component whole around its use. This exact SR recipe is unverified."
)
NOTE_FSDP = "SR weight sharding has not completed full-checkpoint E2E validation."
NOTE_PARTIAL_OFFLOAD = "Partial offload selections are unverified recipes."
NOTE_PREFETCH = "DiT prefetch values above 1 are unverified here; more prefetched layers use more VRAM."
NOTE_RESIDENT = "Nonzero DiT resident-layer recipes are unverified; resident layers trade VRAM for fewer transfers."
NOTE_TILES = "Whole-tile decode matched serial RGB/audio in tested same-topology runs."
NOTE_SPATIAL = "Not bitwise lossless: spatial decode changes rounding; GB300 PSNR 57.51 dB, max pixel difference 4/255."
NOTE_TILE_BATCH = "Tile batch 2 uses more activation memory. Not an output-preserving acceleration."


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """TP x Ulysses x Ring degrees as the picker computes them (may be invalid; see ``validate_topology``)."""

    tp_size: int = 1
    """Tensor-parallel degree."""
    ulysses_degree: int = 1
    """Ulysses sequence-parallel degree."""
    ring_degree: int = 1
    """Ring-attention degree."""

    @property
    def product(self) -> int:
        return self.tp_size * self.ulysses_degree * self.ring_degree

    def describe(self) -> str:
        """``TP 1, Ulysses 4, Ring 1`` (the picker's topology summary)."""
        return f"TP {self.tp_size}, Ulysses {self.ulysses_degree}, Ring {self.ring_degree}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Selection:
    """One choice of every picker field. Defaults are the picker's default selection.

    Choice fields are checked here (``ValueError`` naming the value); GPU counts and degrees
    are not, so that ``validate_topology`` can report every broken rule at once.
    """

    hw: str = "gb300"
    """Hardware id, one of ``HARDWARE``."""
    nodes: int = 1
    """Number of nodes; the picker covers one."""
    gpus_per_node: int = 4
    """GPUs (ranks) on the node."""
    topology_mode: str = "auto"
    """``auto`` (``auto_topology`` decides) or ``manual`` (the three degrees below)."""
    tp_size: int = 1
    """Manual TP degree."""
    ulysses_degree: int = 4
    """Manual Ulysses degree."""
    ring_degree: int = 1
    """Manual Ring degree."""
    attention: str = "platform"
    """``platform`` (FA on datacenter GPUs, SDPA on RTX), ``fa`` or ``torch_sdpa``."""
    decode: str = "tiles"
    """VAE decode: ``serial``, ``tiles`` (whole-tile parallel) or ``spatial`` (spatial shard)."""
    placement: str = "resident"
    """Weights: ``resident``, ``component`` (whole-component CPU offload), ``offload`` (layerwise), ``fsdp``."""
    offload_components: str = "all"
    """Which components leave the GPU under component/layerwise offload (``OFFLOAD_COMPONENT_CHOICES``)."""
    prefetch: int = 1
    """DiT layers prefetched while streaming the DiT (1-4)."""
    resident_layers: int = 0
    """Leading DiT layers kept on the GPU while streaming the DiT (0-8)."""
    scale: str = "2"
    """Request upscale factor: ``2``, ``4`` or ``2.25``."""
    tile_batch: str = "1"
    """Request tiles per DiT call: ``1`` or ``2`` (2 changes the seeded noise)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload_components", normalize_offload_components(self.offload_components))
        object.__setattr__(self, "scale", _number_text(self.scale))
        object.__setattr__(self, "tile_batch", _number_text(self.tile_batch))
        for name, choices in (
            ("hw", HARDWARE),
            ("topology_mode", ("auto", "manual")),
            ("attention", ATTENTION_CHOICES),
            ("decode", DECODE_CHOICES),
            ("placement", PLACEMENT_CHOICES),
            ("offload_components", OFFLOAD_COMPONENT_CHOICES),
            ("scale", SCALE_CHOICES),
            ("tile_batch", TILE_BATCH_CHOICES),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not one of: {', '.join(map(repr, choices))}")
        for name, (low, high) in (("prefetch", PREFETCH_RANGE), ("resident_layers", RESIDENT_LAYERS_RANGE)):
            value = getattr(self, name)
            if not (isinstance(value, int) and low <= value <= high):
                raise ValueError(f"{name}={value!r} must be an integer from {low} to {high}")

    @property
    def streaming_dit(self) -> bool:
        """Layerwise offload that includes the DiT: prefetch and resident layers apply."""
        return self.placement == "offload" and (
            self.offload_components == "all" or "transformer" in self.offload_components.split()
        )


def normalize_offload_components(value: str) -> str:
    """``"vae,transformer"`` -> ``"transformer vae"``: space/comma separated, canonical order."""
    parts = [p for p in re.split(r"[\s,]+", str(value).strip()) if p]
    if parts == ["all"]:
        return "all"
    known = [c for c in _COMPONENT_ORDER if c in parts]
    unknown = [p for p in parts if p not in _COMPONENT_ORDER]
    if unknown or len(set(parts)) != len(parts):
        return " ".join(parts)  # left as given; Selection reports it
    return " ".join(known)


def _number_text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def platform_attention(hw: str | None) -> str:
    """The backend ``platform`` resolves to: SDPA on RTX (SM120), FA elsewhere."""
    return "torch_sdpa" if hw in SM120_HARDWARE else "fa"


def auto_topology(num_gpus: int, *, num_heads: int = PICKER_NUM_HEADS) -> Layout:
    """The picker's automatic layout.

    For 28 heads and 1-8 GPUs this is the picker verbatim: every GPU in Ulysses, except 8 GPUs
    as Ulysses 4 x Ring 2. That includes Ulysses 3, 5 and 6, which do not divide 28 heads and
    which ``validate_topology`` rejects, exactly as the picker does (``suggest_topology`` gives
    a valid alternative). Otherwise: the largest Ulysses degree dividing both ``num_heads`` and
    the GPU count, the rest to Ring; this agrees with the picker wherever the picker is valid.
    """
    if num_heads == PICKER_NUM_HEADS and GPUS_PER_NODE_RANGE[0] <= num_gpus <= GPUS_PER_NODE_RANGE[1]:
        if num_gpus == 8:
            return Layout(tp_size=1, ulysses_degree=4, ring_degree=2)
        return Layout(tp_size=1, ulysses_degree=num_gpus, ring_degree=1)
    return _largest_ulysses(num_gpus, num_heads)


def suggest_topology(num_gpus: int, *, num_heads: int = PICKER_NUM_HEADS, ring_allowed: bool = True) -> Layout | None:
    """A valid layout for ``num_gpus`` under the head rule (largest Ulysses, rest Ring), or None.

    With ``ring_allowed=False`` (SDPA / RTX) only an all-Ulysses layout qualifies.
    """
    if not (isinstance(num_gpus, int) and num_gpus >= 1):
        return None
    layout = _largest_ulysses(num_gpus, num_heads)
    if layout.ring_degree > 1 and not ring_allowed:
        return None
    return layout


def _largest_ulysses(num_gpus: int, num_heads: int | None) -> Layout:
    if not (isinstance(num_gpus, int) and num_gpus >= 1):
        return Layout(tp_size=1, ulysses_degree=num_gpus, ring_degree=1)
    ulysses = num_gpus if not num_heads else math.gcd(num_gpus, num_heads)
    return Layout(tp_size=1, ulysses_degree=ulysses, ring_degree=num_gpus // ulysses)


def resolve_layout(selection: Selection, *, num_heads: int = PICKER_NUM_HEADS) -> Layout:
    """The selection's layout: its manual degrees, or ``auto_topology`` of its GPU count."""
    if selection.topology_mode == "manual":
        return Layout(
            tp_size=selection.tp_size,
            ulysses_degree=selection.ulysses_degree,
            ring_degree=selection.ring_degree,
        )
    return auto_topology(selection.gpus_per_node, num_heads=num_heads)


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def validate_topology(selection: Selection, topology: Layout, *, num_heads: int | None = PICKER_NUM_HEADS) -> list[str]:
    """Every picker rule ``topology`` breaks for ``selection``, in the picker's order and words.

    ``num_heads=None`` skips the head rule (count unknown).
    """
    num_gpus, sm120 = selection.gpus_per_node, selection.hw in SM120_HARDWARE
    errors: list[str] = []
    degrees = (topology.tp_size, topology.ulysses_degree, topology.ring_degree)
    if not all(_is_positive_int(d) for d in degrees):
        errors.append(ERR_DEGREES)
    if selection.nodes != 1:
        errors.append(ERR_NODES)
    elif not (isinstance(num_gpus, int) and GPUS_PER_NODE_RANGE[0] <= num_gpus <= GPUS_PER_NODE_RANGE[1]):
        errors.append(ERR_GPU_RANGE)  # over several nodes ERR_NODES already says it
    if math.prod(degrees) != num_gpus:
        errors.append(ERR_PRODUCT)
    if num_heads is not None:
        split = topology.tp_size * topology.ulysses_degree
        # The picker computes 28 % split: a zero split gives NaN there, which counts as an error.
        if split == 0 or num_heads % split:
            errors.append(ERR_HEADS.format(num_heads=num_heads))
    if selection.placement == "fsdp" and num_gpus < 2:
        errors.append(ERR_FSDP)
    if (selection.attention == "torch_sdpa" or sm120) and topology.ring_degree > 1:
        errors.append(ERR_SDPA_RING)
    if selection.attention == "fa" and sm120:
        errors.append(ERR_FA_SM120)
    return errors


def picker_attention(name: str | None) -> str:
    """An ``--attention-backend`` name in the picker's terms: ``platform`` (auto), ``fa`` (flash-attn),
    or ``torch_sdpa`` (any other kernel: the picker knows only these two paths)."""
    if name is None or name in ("auto", "platform"):
        return "platform"
    if name in ("fa", "flash_attn"):
        return "fa"
    return "torch_sdpa"


def decode_choice(*, use_parallel_tiling: bool, use_parallel_decode: bool) -> str:
    """The picker's decode id of the ``--vae-config.*`` switches (spatial wins when both are on)."""
    if use_parallel_decode:
        return "spatial"
    return "tiles" if use_parallel_tiling else "serial"


def recipe_findings(
    *,
    num_gpus: int,
    tp_size: int = 1,
    ulysses_degree: int = 1,
    ring_degree: int = 1,
    nodes: int = 1,
    num_heads: int | None,
    attention_backend: str | None = None,
    placement: str = "resident",
    decode: str = "serial",
    hardware: str,
) -> list[str]:
    """The picker's errors and warnings for a ``tilecast serve`` command line, as warnings.

    ``hardware`` is a ``HARDWARE`` id (``detect_hardware``); ``num_gpus`` is the world size over
    ``nodes`` nodes. Errors come first, each prefixed ``outside the deployment guide's recipes:``
    (tilecast runs them; the guide has no recipe for them), then the picker's warnings verbatim.
    """
    selection = Selection(
        hw=hardware,
        nodes=nodes,
        gpus_per_node=num_gpus,
        topology_mode="manual",
        tp_size=tp_size,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        attention=picker_attention(attention_backend),
        placement=placement,
        decode=decode,
    )
    deployment = resolve_deployment(selection, num_heads=num_heads)
    return [RECIPE_PREFIX + error for error in deployment.errors] + deployment.warnings


RECIPE_PREFIX = "outside the deployment guide's recipes: "
"""Put before a picker error that is only a warning (``recipe_findings``)."""


_HARDWARE_PATTERNS = (
    ("rtxpro6000", re.compile(r"\bRTX\s*PRO\s*6000\b", re.I)),
    ("rtx5090", re.compile(r"\bRTX\s*5090\b", re.I)),
    ("gb300", re.compile(r"\bGB300\b", re.I)),
    ("b200", re.compile(r"\bB200\b", re.I)),
    ("h200", re.compile(r"\bH200\b", re.I)),
    ("h100", re.compile(r"\bH100\b", re.I)),
)


def detect_hardware(device_name: str | None) -> str | None:
    """Map a CUDA device name (``torch.cuda.get_device_name()``) to a ``HARDWARE`` id, or None."""
    if not device_name:
        return None
    for hw, pattern in _HARDWARE_PATTERNS:
        if pattern.search(device_name):
            return hw
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Deployment:
    """What the picker resolves a selection to."""

    selection: Selection
    """The selection it was resolved from."""
    topology: Layout
    """The layout (manual or automatic)."""
    num_heads: int | None
    """Heads the head rule used (None: rule skipped)."""
    attention: str
    """Resolved backend: ``fa`` or ``torch_sdpa``."""
    platform_attention: str
    """What ``platform`` means on this hardware."""
    errors: list[str]
    """Broken rules (``validate_topology``); non-empty means no command."""
    warnings: list[str]
    """The picker's warnings, in its order."""
    notes: list[str]
    """Per-option cautions and ignored settings (see the module docstring)."""
    served: bool
    """The selection matches an HTTP-verified recipe."""
    verification: dict[str, str]
    """``{"serve": verified|unverified|error, "request": unverified|error}``."""
    suggestion: Layout | None = None
    """A valid layout for the same GPU count when the automatic one breaks the head rule."""

    @property
    def valid(self) -> bool:
        return not self.errors

    @property
    def summary(self) -> str:
        return self.topology.describe()

    def serve_flags(self) -> list[str]:
        """``tilecast serve`` arguments after ``--model-path`` (argv tokens).

        Offload components are one token, space separated as the picker writes them
        (``"transformer vae"``); ``serve`` splits it with ``normalize_offload_components``.
        """
        s, t = self.selection, self.topology
        argv = [
            "--num-gpus",
            str(s.gpus_per_node),
            "--tp-size",
            str(t.tp_size),
            "--ulysses-degree",
            str(t.ulysses_degree),
            "--ring-degree",
            str(t.ring_degree),
            "--attention-backend",
            self.attention,
            *DECODE_FLAGS[s.decode],
        ]
        if s.placement == "component":
            argv += ["--cpu-offload-components", s.offload_components]
        elif s.placement == "offload":
            argv += ["--layerwise-offload-components", s.offload_components]
        elif s.placement == "fsdp":
            argv += ["--use-fsdp-inference", "true"]
        if s.streaming_dit and s.prefetch != 1:
            argv += ["--dit-offload-prefetch-size", str(s.prefetch)]
        if s.streaming_dit and s.resident_layers != 0:
            argv += ["--dit-layerwise-resident-layers", str(s.resident_layers)]
        return argv

    def serve_argv(self, model_path: str) -> list[str]:
        """The full ``tilecast serve`` argv. ``ValueError`` listing the errors when invalid."""
        if self.errors:
            raise ValueError("invalid selection: " + " ".join(self.errors))
        return ["tilecast", "serve", "--model-path", str(model_path), *self.serve_flags()]

    def serve_command(self, model_path: str) -> str:
        """``serve_argv`` as one shell-quoted line."""
        return shlex.join(self.serve_argv(model_path))

    def resolved_settings(self) -> dict[str, str]:
        s = self.selection
        return {
            "attention": "FlashAttention" if self.attention == "fa" else "PyTorch SDPA",
            "prefetch": f"{s.prefetch} {'layer' if s.prefetch == 1 else 'layers'}",
            "resident_layers": f"{s.resident_layers} {'layer' if s.resident_layers == 1 else 'layers'}",
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view (the CLI's ``--json``)."""
        return {
            "valid": self.valid,
            "selection": dataclasses.asdict(self.selection),
            "topology": dataclasses.asdict(self.topology),
            "summary": self.summary,
            "num_heads": self.num_heads,
            "attention": self.attention,
            "platform_attention": self.platform_attention,
            "resolved_settings": self.resolved_settings(),
            "errors": list(self.errors),
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "served": self.served,
            "verification": dict(self.verification),
            "suggestion": dataclasses.asdict(self.suggestion) if self.suggestion else None,
            "serve_flags": self.serve_flags(),
        }


def _served(s: Selection, t: Layout, attention: str) -> bool:
    """The picker's HTTP-verified recipes."""
    layout = (t.tp_size, t.ulysses_degree, t.ring_degree)
    gb300 = (
        s.hw == "gb300"
        and attention == "fa"
        and s.decode != "spatial"
        and (
            (layout == (2, 2, 1) and s.placement == "resident")
            or (
                layout == (1, 1, 2)
                and s.placement == "offload"
                and s.offload_components == "all"
                and s.prefetch == 1
                and s.resident_layers == 0
            )
        )
    )
    rtx = (
        s.hw == "rtxpro6000"
        and attention == "torch_sdpa"
        and s.placement == "resident"
        and (layout, s.decode) in {((1, 1, 1), "serial"), ((1, 2, 1), "tiles")}
    )
    return gb300 or rtx


def _warnings(s: Selection, t: Layout, attention: str, served: bool) -> list[str]:
    warnings = [WARN_SCOPE]
    if not served:
        warnings.append(WARN_UNVERIFIED)
    if s.hw not in MEASURED_HARDWARE:
        warnings.append(WARN_EXTRAPOLATED_HW)
    if attention != platform_attention(s.hw):
        warnings.append(WARN_BACKEND_OVERRIDE)
    if s.hw == "rtx5090":
        warnings.append(WARN_RTX5090)
    if s.gpus_per_node > 4:
        warnings.append(WARN_MANY_GPUS)
    if s.hw == "rtxpro6000" and s.gpus_per_node > 2:
        warnings.append(WARN_RTXPRO_GPUS)
    if s.placement in ("component", "offload"):
        warnings.append(WARN_OFFLOAD)
    if s.decode == "spatial":
        warnings.append(WARN_SPATIAL)
    if s.decode == "tiles":
        warnings.append(WARN_TILES)
    if t.tp_size > 1 or t.ring_degree > 1:
        warnings.append(WARN_TP_RING)
    if s.tile_batch != "1":
        warnings.append(WARN_TILE_BATCH)
    if s.gpus_per_node == 1 and s.decode != "serial":
        warnings.append(WARN_ONE_GPU)
    return warnings


def _notes(s: Selection) -> list[str]:
    notes = []
    if s.attention == "torch_sdpa" and s.hw != "rtxpro6000":
        notes.append(NOTE_SDPA_SOFT)
    if s.placement == "component":
        notes.append(NOTE_COMPONENT)
    if s.placement == "fsdp":
        notes.append(NOTE_FSDP)
    offloading = s.placement in ("component", "offload")
    if offloading and s.offload_components != "all":
        notes.append(NOTE_PARTIAL_OFFLOAD)
    if not offloading and s.offload_components != "all":
        notes.append(f"offload components {s.offload_components!r} are ignored: placement is {s.placement!r}.")
    for name, value, default, note in (
        ("prefetch", s.prefetch, 1, NOTE_PREFETCH),
        ("resident layers", s.resident_layers, 0, NOTE_RESIDENT),
    ):
        if value == default:
            continue
        if s.streaming_dit:
            notes.append(note)
        else:
            notes.append(f"DiT {name} {value} is ignored: it applies only to layerwise offload that includes the DiT.")
    if s.decode == "tiles":
        notes.append(NOTE_TILES)
    if s.decode == "spatial":
        notes.append(NOTE_SPATIAL)
    if s.tile_batch == "2":
        notes.append(NOTE_TILE_BATCH)
    return notes


def resolve_deployment(selection: Selection, *, num_heads: int | None = PICKER_NUM_HEADS) -> Deployment:
    """Resolve ``selection`` as the picker does: layout, errors, backend, warnings, verification."""
    s = selection
    layout = resolve_layout(s, num_heads=PICKER_NUM_HEADS if num_heads is None else num_heads)
    errors = validate_topology(s, layout, num_heads=num_heads)
    platform = platform_attention(s.hw)
    attention = platform if s.attention == "platform" else s.attention
    served = not errors and _served(s, layout, attention)
    suggestion = None
    if errors and s.topology_mode == "auto" and ERR_HEADS.format(num_heads=num_heads) in errors:
        ring_allowed = not (attention == "torch_sdpa" or s.hw in SM120_HARDWARE)
        suggestion = suggest_topology(
            s.gpus_per_node, num_heads=num_heads or PICKER_NUM_HEADS, ring_allowed=ring_allowed
        )
    return Deployment(
        selection=s,
        topology=layout,
        num_heads=num_heads,
        attention=attention,
        platform_attention=platform,
        errors=errors,
        warnings=_warnings(s, layout, attention, served),
        notes=_notes(s),
        served=served,
        verification={
            "serve": "error" if errors else ("verified" if served else "unverified"),
            "request": "error" if errors else "unverified",
        },
        suggestion=suggestion,
    )
