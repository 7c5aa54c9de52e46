"""The parallel layout of one deployment, as a value, and the process groups it implies.

A :class:`Topology` is validated when it is built and passed explicitly to whatever needs a
process group; nothing in tilecast reads a global group. ``Topology.build_mesh`` lays the ranks
out on a ``DeviceMesh`` with named axes, outer to inner::

    ("dp", "ring", "ulysses", "tp")

Ranks are numbered row-major over that shape, so TP peers are neighbouring ranks (the fastest
links on a host), and each data-parallel replica is a contiguous block of
``num_gpus // dp_degree`` ranks. Axes of size 1 are kept, so code can always ask for any axis.

The decode group is every rank of one DP replica (Ring x Ulysses x TP): parallel VAE decode
shares the tiles of one request among them, never across replicas.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MESH_AXES: tuple[str, ...] = ("dp", "ring", "ulysses", "tp")
"""Mesh axis names, outer to inner."""

TINY_K6SR = "tiny/k6sr"
DEGREE_FIELDS = ("tp_size", "ulysses_degree", "ring_degree", "dp_degree")
"""The parallel degrees, as ``Topology``, ``ServeConfig`` and ``replicas.ServingShape`` name them."""


def degrees_of(source: Any) -> dict[str, int | None]:
    """``source``'s ``DEGREE_FIELDS`` (a ``ServeConfig``, a ``Topology``), as keyword arguments."""
    return {name: getattr(source, name) for name in DEGREE_FIELDS}


class TopologyError(ValueError):
    """A topology breaks one or more rules; ``errors`` lists every one of them."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("invalid topology:\n" + "\n".join(f"  - {e}" for e in self.errors))


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def degree_errors(
    *, num_gpus: int, tp_size: int = 1, ulysses_degree: int = 1, ring_degree: int = 1, dp_degree: int | None = None
) -> list[str]:
    """The layout rules: positive degrees, and a world size the degrees fill exactly.

    ``dp_degree=None`` derives the data-parallel replicas as ``num_gpus // (TP x Ulysses x Ring)``
    (what ``tilecast serve`` does), so the world size must be a multiple of that product.
    """
    degrees = {"tp_size": tp_size, "ulysses_degree": ulysses_degree, "ring_degree": ring_degree}
    if dp_degree is not None:
        degrees["dp_degree"] = dp_degree
    errors: list[str] = []
    if not _is_positive_int(num_gpus):
        errors.append(f"num_gpus must be a positive integer, got {num_gpus!r}.")
    bad = [f"{name}={value!r}" for name, value in degrees.items() if not _is_positive_int(value)]
    if bad:
        errors.append(f"Parallel degrees must be positive integers: {', '.join(bad)}.")
        return errors
    if not _is_positive_int(num_gpus):
        return errors
    model_parallel = tp_size * ulysses_degree * ring_degree
    terms = f"TP {tp_size} x Ulysses {ulysses_degree} x Ring {ring_degree}"
    if dp_degree is None:
        if num_gpus % model_parallel:
            errors.append(
                "GPU count must equal TP times Ulysses times Ring, or a multiple of it (the data-parallel "
                f"replicas): num_gpus={num_gpus}, but {terms} = {model_parallel}."
            )
    elif dp_degree * model_parallel != num_gpus:
        what = "TP times Ulysses times Ring" if dp_degree == 1 else "DP times TP times Ulysses times Ring"
        terms = terms if dp_degree == 1 else f"DP {dp_degree} x {terms}"
        errors.append(f"GPU count must equal {what}: num_gpus={num_gpus}, but {terms} = {dp_degree * model_parallel}.")
    return errors


def model_errors(
    *, tp_size: int = 1, ulysses_degree: int = 1, num_heads: int | None = None, ff_dim: int | None = None
) -> list[str]:
    """What the model's DiT allows: TP x Ulysses divides its heads, TP divides its FF width.

    ``None`` means unknown: that rule is skipped.
    """
    errors: list[str] = []
    if not (_is_positive_int(tp_size) and _is_positive_int(ulysses_degree)):
        return errors  # degree_errors names them
    if num_heads is not None:
        if not _is_positive_int(num_heads):
            errors.append(f"num_heads must be a positive integer, got {num_heads!r}.")
        elif num_heads % (tp_size * ulysses_degree):
            errors.append(
                f"TP times Ulysses must divide the {num_heads} DiT heads: "
                f"TP {tp_size} x Ulysses {ulysses_degree} = {tp_size * ulysses_degree}."
            )
    if ff_dim is not None and _is_positive_int(ff_dim) and ff_dim % tp_size:
        errors.append(f"TP must divide the DiT's feed-forward width: ff_dim={ff_dim}, but TP {tp_size}.")
    return errors


def kernel_errors(*, ring_degree: int = 1, attention_backend: str | None = None) -> list[str]:
    """What the attention kernels can do (``kernels/capabilities.py``): the backend name is known, and
    with Ring > 1 it returns the log-sum-exp the Ring merge needs.

    Whether the backend can run on this machine (CUDA, an optional package) is checked where the
    kernel is resolved, on the ranks.
    """
    from tilecast.kernels import capabilities

    if attention_backend is not None:
        try:
            capabilities.candidates(attention_backend)
        except ValueError as exc:
            return [f"{exc}."]
    if _is_positive_int(ring_degree) and ring_degree > 1:
        problem = capabilities.ring_problem(attention_backend)
        if problem is not None:
            return [f"Ring {ring_degree}: {problem}."]
    return []


def placement_errors(*, num_gpus: int, fsdp: bool = False) -> list[str]:
    """FSDP shards the DiT across the ranks, so it needs two or more."""
    if fsdp and _is_positive_int(num_gpus) and num_gpus < 2:
        return [
            "FSDP requires multiple GPUs: --use-fsdp-inference true shards the DiT across the ranks, "
            f"but num_gpus={num_gpus}."
        ]
    return []


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """How ``num_gpus`` ranks split into DP replicas, Ring, Ulysses and TP groups.

    Built only when every rule holds (``check``): the layout, the model's DiT (heads, FF width)
    and the attention kernels (Ring needs a backend that returns the log-sum-exp).
    """

    num_gpus: int
    """Number of ranks, the world size (one per GPU; on CPU, one per process), on all nodes."""
    tp_size: int = 1
    """Tensor-parallel degree: each attention/MLP weight is split across this many ranks."""
    ulysses_degree: int = 1
    """Ulysses sequence-parallel degree: all-to-all swaps the sequence split for a head split."""
    ring_degree: int = 1
    """Ring-attention degree: K/V blocks rotate around this many ranks, outputs merged by LSE."""
    dp_degree: int | None = None
    """Data-parallel replicas, each with a full copy of the model; None: ``num_gpus // (TP x
    Ulysses x Ring)``, as ``tilecast serve`` lays the ranks out. An int after construction."""
    num_heads: int | None = None
    """Attention heads of the model's DiT when known; TP x Ulysses must divide it."""
    ff_dim: int | None = None
    """Feed-forward width of the model's DiT when known; TP must divide it."""
    attention_backend: str | None = None
    """``--attention-backend`` name (None: auto); with Ring > 1 it must return the log-sum-exp."""

    def __post_init__(self) -> None:
        errors = self.check(**dataclasses.asdict(self))  # every field is one of check's arguments
        if errors:
            raise TopologyError(errors)
        if self.dp_degree is None:
            object.__setattr__(self, "dp_degree", self.num_gpus // self.replica_size)

    @staticmethod
    def check(
        *,
        num_gpus: int,
        tp_size: int = 1,
        ulysses_degree: int = 1,
        ring_degree: int = 1,
        dp_degree: int | None = None,
        num_heads: int | None = None,
        ff_dim: int | None = None,
        attention_backend: str | None = None,
        fsdp: bool = False,
    ) -> list[str]:
        """Every rule the deployment breaks, as messages naming the bad values (empty when valid).

        The one rule set: ``degree_errors`` (layout), ``model_errors`` (the DiT),
        ``kernel_errors`` (the attention backend), ``placement_errors`` (FSDP).
        """
        return [
            *degree_errors(
                num_gpus=num_gpus,
                tp_size=tp_size,
                ulysses_degree=ulysses_degree,
                ring_degree=ring_degree,
                dp_degree=dp_degree,
            ),
            *model_errors(tp_size=tp_size, ulysses_degree=ulysses_degree, num_heads=num_heads, ff_dim=ff_dim),
            *kernel_errors(ring_degree=ring_degree, attention_backend=attention_backend),
            *placement_errors(num_gpus=num_gpus, fsdp=fsdp),
        ]

    @classmethod
    def auto(cls, num_gpus: int, *, num_heads: int | None = None) -> Topology:
        """The deployment picker's automatic layout for ``num_gpus`` (see ``picker.auto_topology``).

        Raises :class:`TopologyError` when that layout is invalid (the picker's own layout for
        3, 5 or 6 GPUs does not divide 28 heads).
        """
        from tilecast.runtime.picker import PICKER_NUM_HEADS, auto_topology

        layout = auto_topology(num_gpus, num_heads=PICKER_NUM_HEADS if num_heads is None else num_heads)
        return cls(
            num_gpus=num_gpus,
            tp_size=layout.tp_size,
            ulysses_degree=layout.ulysses_degree,
            ring_degree=layout.ring_degree,
            num_heads=num_heads,
        )

    @property
    def sp_degree(self) -> int:
        """Sequence-parallel degree: Ulysses x Ring."""
        return self.ulysses_degree * self.ring_degree

    @property
    def replica_size(self) -> int:
        """Ranks in one DP replica (Ring x Ulysses x TP); also the decode group's size."""
        return self.ring_degree * self.ulysses_degree * self.tp_size

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """Sizes of ``MESH_AXES``."""
        return (self.dp_degree, self.ring_degree, self.ulysses_degree, self.tp_size)

    def describe(self) -> str:
        """One-line summary, e.g. ``TP 1, Ulysses 4, Ring 1`` (``, DP n`` appended when n > 1)."""
        text = f"TP {self.tp_size}, Ulysses {self.ulysses_degree}, Ring {self.ring_degree}"
        return text + (f", DP {self.dp_degree}" if self.dp_degree and self.dp_degree > 1 else "")

    def axis_ranks(self, axis: str) -> list[list[int]]:
        """The rank lists of every group along ``axis`` (``decode`` and ``sp`` included).

        Pure arithmetic, no process group needed: what ``groups()`` builds on each rank.
        """
        dims = _axis_dims(axis)
        shape = self.mesh_shape
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        others = [i for i in range(len(shape)) if i not in dims]
        result = []
        for outer in _product_ranges([shape[i] for i in others]):
            base = sum(c * strides[i] for c, i in zip(outer, others))
            members = [
                base + sum(c * strides[i] for c, i in zip(inner, dims))
                for inner in _product_ranges([shape[i] for i in dims])
            ]
            result.append(members)
        return result

    def build_mesh(self, device_type: str = "cuda"):
        """A ``DeviceMesh`` over all ranks with axes ``MESH_AXES`` (needs an initialized default group).

        Collective: every rank must call it, in the same order as any other group creation.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise ValueError("build_mesh needs torch.distributed initialized (run under torchrun)")
        world = dist.get_world_size()
        if world != self.num_gpus:
            raise ValueError(f"Topology has num_gpus={self.num_gpus} but the default process group has {world} ranks")
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_AXES)

    def groups(self, mesh) -> ParallelGroups:
        """This rank's process group on every axis of ``mesh`` (built by ``build_mesh``).

        Collective: creates the flattened ``sp`` and ``decode`` groups on first use.
        """
        if tuple(mesh.mesh_dim_names or ()) != MESH_AXES or tuple(mesh.shape) != self.mesh_shape:
            raise ValueError(
                f"mesh {tuple(mesh.mesh_dim_names or ())} {tuple(mesh.shape)} does not match "
                f"this topology {MESH_AXES} {self.mesh_shape}"
            )
        sp_mesh = mesh["ring", "ulysses"]._flatten("sp")
        decode_mesh = mesh["ring", "ulysses", "tp"]._flatten("decode")
        # DeviceMesh._flatten is private but stable since torch 2.4 (torchtitan uses it); it
        # caches by name, so calling groups() twice reuses the same groups.
        return ParallelGroups(
            mesh=mesh,
            dp_group=mesh.get_group("dp"),
            ring_group=mesh.get_group("ring"),
            ulysses_group=mesh.get_group("ulysses"),
            tp_group=mesh.get_group("tp"),
            sp_group=sp_mesh.get_group(),
            decode_group=decode_mesh.get_group(),
            coordinate={axis: mesh.get_local_rank(axis) for axis in MESH_AXES},
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """The process groups this rank belongs to, one per axis."""

    mesh: Any
    """The ``DeviceMesh`` they were taken from."""
    dp_group: Any
    """Same position in every DP replica (weights are identical along it)."""
    ring_group: Any
    """Ring-attention peers: K/V blocks rotate among them."""
    ulysses_group: Any
    """Ulysses peers: the sequence/head all-to-all runs among them."""
    tp_group: Any
    """Tensor-parallel peers: split weights, all-reduce/all-gather activations."""
    sp_group: Any
    """All sequence-parallel peers (Ring x Ulysses), e.g. to gather the full sequence."""
    decode_group: Any
    """All ranks of this DP replica (Ring x Ulysses x TP): they share one request's VAE decode."""
    coordinate: dict[str, int]
    """This rank's index along each axis of ``MESH_AXES``."""

    def group(self, axis: str) -> Any:
        """The group for ``axis`` (one of ``MESH_AXES``, ``sp`` or ``decode``)."""
        _axis_dims(axis)
        return getattr(self, f"{axis}_group")


def _axis_dims(axis: str) -> list[int]:
    if axis == "sp":
        return [1, 2]
    if axis == "decode":
        return [1, 2, 3]
    if axis in MESH_AXES:
        return [MESH_AXES.index(axis)]
    raise ValueError(f"unknown mesh axis {axis!r}; known: {', '.join(MESH_AXES + ('sp', 'decode'))}")


def _product_ranges(sizes: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in sizes:
        out = [prefix + (i,) for prefix in out for i in range(size)]
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelLimits:
    """What a model's DiT lets a topology split (None: unknown, the rule is skipped)."""

    num_heads: int | None = None
    """Attention heads: TP x Ulysses must divide them."""
    ff_dim: int | None = None
    """Feed-forward hidden width: TP must divide it."""


TINY_K6SR_LIMITS = ModelLimits(num_heads=12, ff_dim=384)
"""``tiny/k6sr``'s DiT (``runtime/models/k6sr/tiny.py``: model_dim 192 over head dim 4+6+6, ff_dim 384),
written here so the check needs no torch import; a test holds it equal to the tiny config."""


def model_limits(model_path: str | Path) -> ModelLimits:
    """Heads and FF width of the DiT behind ``model_path`` (a built-in name or a diffusers directory).

    Reads ``transformer/config.json``: ``num_attention_heads`` when present (most diffusers
    DiTs), else ``model_dim / sum(axes_dims)`` (Kandinsky 6 SR, whose head dim is the sum of its
    RoPE axes; diffusers' defaults 1792 and (16, 24, 24) give 28 heads); ``ff_dim`` when present.
    ``tiny/k6sr`` is ``TINY_K6SR_LIMITS``. Other built-in names (``tiny/...``, ``random/...``,
    ``test/...``) give unknown limits. ``ValueError`` when a directory's head count cannot be told.
    """
    name = str(model_path)
    if name == TINY_K6SR:
        return TINY_K6SR_LIMITS
    if name.startswith(("tiny/", "random/", "test/")) and not Path(model_path).exists():
        logger.debug("no head count known for built-in model %s", name)
        return ModelLimits()
    from tilecast.runtime.hub import local_dir, no_model_index

    path = local_dir(str(model_path))
    config_path = path / "transformer" / "config.json"
    if not config_path.is_file():
        if not path.exists():
            raise ValueError(f"--model-path {str(model_path)!r} is neither {TINY_K6SR!r} nor an existing directory")
        if not (path / "model_index.json").is_file() and any(path.glob("*.safetensors")):
            raise ValueError(no_model_index(path))  # FLUX.2-dev-NVFP4's folder: says what to pass
        raise ValueError(f"{config_path} not found: cannot tell the DiT's attention heads; pass --num-heads")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_path}: {exc}") from exc
    ff_dim = config.get("ff_dim") if isinstance(config.get("ff_dim"), int) else None
    if isinstance(config.get("num_attention_heads"), int):
        return ModelLimits(num_heads=config["num_attention_heads"], ff_dim=ff_dim)
    class_name = str(config.get("_class_name", ""))
    if "model_dim" in config or "axes_dims" in config or class_name.startswith("Kandinsky6SR"):
        model_dim = int(config.get("model_dim", 1792))
        head_dim = sum(int(d) for d in config.get("axes_dims", (16, 24, 24)))
        if head_dim <= 0 or model_dim % head_dim:
            raise ValueError(f"{config_path}: model_dim {model_dim} is not a multiple of sum(axes_dims) {head_dim}")
        return ModelLimits(num_heads=model_dim // head_dim, ff_dim=ff_dim)
    raise ValueError(
        f"{config_path} ({class_name or 'no _class_name'}) has neither num_attention_heads nor "
        "model_dim/axes_dims; pass --num-heads"
    )


def num_heads_from_checkpoint(model_path: str | Path) -> int | None:
    """Attention heads of the DiT behind ``model_path`` (``model_limits(model_path).num_heads``)."""
    return model_limits(model_path).num_heads
