"""The weight-placement settings, validated: which components are offloaded and how (no torch).

``ServeConfig`` checks its placement flags through ``PlacementConfig`` when it is built, so the
launcher refuses a bad combination before any rank starts without importing torch; the placements
themselves are ``runtime/placement.py``'s.
"""

from __future__ import annotations

import dataclasses

from tilecast.runtime.picker import PREFETCH_RANGE, RESIDENT_LAYERS_RANGE, normalize_offload_components

COMPONENTS: tuple[str, ...] = ("transformer", "vae", "latent_upscaler")
"""Components ``all`` selects (Kandinsky 6 SR's)."""
NAMED_COMPONENTS: tuple[str, ...] = (*COMPONENTS, "transformer_2")
"""Components that can be named: also Wan2.2 A14B's low-noise expert ``transformer_2`` (the Wan
families offload their experts, ``families.wan.ExpertOffload``; a pipeline without one refuses it)."""
FLAG_LAYERWISE = "--layerwise-offload-components"
FLAG_COMPONENT = "--cpu-offload-components"
FLAG_PREFETCH = "--dit-offload-prefetch-size"
FLAG_RESIDENT = "--dit-layerwise-resident-layers"
FLAG_FSDP = "--use-fsdp-inference"


def parse_components(value: str | tuple[str, ...] | list[str] | None, flag: str) -> tuple[str, ...]:
    """``"all"`` / ``"vae,transformer"`` / ``"transformer vae"`` → canonical tuple; ``None``/empty → ``()``.

    ``ValueError`` naming ``flag`` for an unknown or repeated name, or ``all`` mixed with names."""
    if value is None:
        return ()
    text = " ".join(value) if isinstance(value, (tuple, list)) else str(value)
    if not text.strip():
        return ()
    names = normalize_offload_components(text).split()
    if names == ["all"]:
        return COMPONENTS
    unknown = [name for name in names if name not in NAMED_COMPONENTS]
    if unknown or len(set(names)) != len(names):
        problem = f"unknown {', '.join(map(repr, unknown))}" if unknown else "a component is repeated"
        raise ValueError(
            f"{flag} {text!r}: {problem}; give all, or one or more of {', '.join(NAMED_COMPONENTS)} "
            f"(space or comma separated)"
        )
    return tuple(names)


def _components_text(components: tuple[str, ...]) -> str | None:
    if not components:
        return None
    return "all" if components == COMPONENTS else " ".join(components)


@dataclasses.dataclass(kw_only=True, frozen=True)
class PlacementConfig:
    """The validated weight placement (``ServeConfig`` maps the flags onto it; pipelines read it
    as ``RankContext.settings.placement``)."""

    layerwise_offload_components: tuple[str, ...] = ()
    """Components whose blocks stream from host memory (subset of ``COMPONENTS``)."""
    cpu_offload_components: tuple[str, ...] = ()
    """Components moved to the device whole around their use (disjoint from the layerwise ones)."""
    dit_offload_prefetch_size: int = 1
    """DiT blocks prefetched ahead while streaming the DiT (1-4)."""
    dit_layerwise_resident_layers: int = 0
    """Leading DiT blocks kept on the device while streaming the DiT (0-8)."""
    use_fsdp_inference: bool = False
    """Shard the DiT's weights across the ranks with FSDP2."""

    def __post_init__(self) -> None:
        for flag, name in (
            (FLAG_LAYERWISE, "layerwise_offload_components"),
            (FLAG_COMPONENT, "cpu_offload_components"),
        ):
            object.__setattr__(self, name, parse_components(getattr(self, name), flag))
        for flag, value, (low, high) in (
            (FLAG_PREFETCH, self.dit_offload_prefetch_size, PREFETCH_RANGE),
            (FLAG_RESIDENT, self.dit_layerwise_resident_layers, RESIDENT_LAYERS_RANGE),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{flag} must be an integer from {low} to {high}, got {value!r}")
        if not isinstance(self.use_fsdp_inference, bool):
            raise ValueError(f"{FLAG_FSDP} must be true or false, got {self.use_fsdp_inference!r}")
        both = [c for c in self.layerwise_offload_components if c in self.cpu_offload_components]
        if both:
            raise ValueError(
                f"{', '.join(both)} cannot be in both {FLAG_LAYERWISE} and {FLAG_COMPONENT}: "
                f"choose one placement per component"
            )
        if not self.streaming_dit:
            for flag, value, default in (
                (FLAG_PREFETCH, self.dit_offload_prefetch_size, 1),
                (FLAG_RESIDENT, self.dit_layerwise_resident_layers, 0),
            ):
                if value != default:
                    raise ValueError(
                        f"{flag} {value} applies only when {FLAG_LAYERWISE} includes the transformer "
                        f"(it streams {', '.join(self.layerwise_offload_components) or 'nothing'}): add the "
                        f"transformer or leave {flag} at {default}"
                    )
        if self.use_fsdp_inference and "transformer" in self.offloaded:
            flag = FLAG_LAYERWISE if "transformer" in self.layerwise_offload_components else FLAG_COMPONENT
            raise ValueError(
                f"{FLAG_FSDP} true shards the DiT across the ranks; it cannot also be offloaded by {flag} "
                f"(offload only vae/latent_upscaler with FSDP)"
            )

    def as_fields(self) -> dict:
        """The ``ServeConfig`` placement fields (component lists as the flags' canonical text)."""
        return {
            **dataclasses.asdict(self),
            "layerwise_offload_components": _components_text(self.layerwise_offload_components),
            "cpu_offload_components": _components_text(self.cpu_offload_components),
        }

    @property
    def offloaded(self) -> tuple[str, ...]:
        return self.layerwise_offload_components + self.cpu_offload_components

    @property
    def streaming_dit(self) -> bool:
        """Layerwise offload includes the DiT: the prefetch and resident-layer settings apply."""
        return "transformer" in self.layerwise_offload_components

    @property
    def picker_name(self) -> str:
        """The picker's placement id: ``fsdp``, ``offload`` (layerwise, also when mixed with
        component offload), ``component`` or ``resident``."""
        if self.use_fsdp_inference:
            return "fsdp"
        if self.layerwise_offload_components:
            return "offload"
        if self.cpu_offload_components:
            return "component"
        return "resident"

    def check_topology(
        self,
        *,
        world_size: int,
        tp_size: int = 1,
        unit_size: int = 1,
        tile_parallel: bool = False,
        check_rank_count: bool = True,
    ) -> None:
        """``ValueError`` for FSDP with fewer than 2 ranks (unless ``check_rank_count`` is off: the
        CLI leaves that to the picker's rule), with TP, or with tile-parallel units."""
        if not self.use_fsdp_inference:
            return
        if check_rank_count and world_size < 2:
            raise ValueError(
                f"{FLAG_FSDP} true needs at least 2 ranks to shard the DiT across, got {world_size} "
                f"(use --num-gpus 2 or more, or keep the weights resident)"
            )
        if tp_size > 1:
            raise ValueError(
                f"{FLAG_FSDP} true cannot be combined with --tp-size {tp_size}: TP ranks hold different slices "
                f"of each weight, and FSDP here shards over all ranks; use Ulysses/Ring instead of TP"
            )
        if tile_parallel and world_size > unit_size and world_size % unit_size == 0:
            raise ValueError(
                f"{FLAG_FSDP} true cannot be combined with tile-parallel denoising over "
                f"{world_size // unit_size} units: the units run different DiT calls, but FSDP's all-gathers "
                f"span every rank"
            )
