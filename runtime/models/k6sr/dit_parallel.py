"""Ulysses / Ring / TP for the Kandinsky 6 SR DiT, declared as data and applied by hooks.

Legend: B batch, S tokens (full sequence unless noted), C model dim, D head dim.

diffusers' ``Kandinsky6SRTransformer3DModel.forward`` patchifies, builds the fp32 rotary table
``visual_rope`` of shape ``(S, 1, D/2, 2, 2)`` and calls every block as
``block(visual_embed_BSC, temb, visual_rope, sparse_params)``. Sequence parallelism needs only:

- ``K6SR_SEQUENCE_PLAN``: block 0 splits ``hidden_states`` on dim 1; every block splits
  ``rotary_emb`` on dim 0 (the model passes the full table to each block; the shard is cached per
  forward); the last block's output is all-gathered on dim 1. Everything before and after the
  blocks (embeddings, final layer) stays replicated, as in diffusers' own context-parallel plans.
- ``K6SR_TP_PLAN``: Q/K/V and the FF input projection column-parallel, the attention output
  projection and the FF output projection row-parallel (one all-reduce per attention and per FF).

The attention layers run ``runtime/models/k6sr/attention.py``'s ``K6SRDenseAttnProcessor`` (dense, or
NABLA with ``--attention-backend nabla``: Ulysses and TP split heads, and NABLA's mask is per head,
so it composes with both; Ring is refused, ``kernels.nabla.RING_REFUSAL``); each forward,
block 0's pre-hook gives every processor an ``AttentionParallel`` carrying the true token count, so
a sequence that does not divide by the SP degree is zero-padded and the padded keys are masked.

Why not diffusers' ``apply_context_parallel``: its hooks shard through its own
``ContextParallelConfig``/mesh and attention dispatcher, and split evenly without telling attention
about padding. The plan format here mirrors its ``_cp_plan`` (module name → inputs/outputs).

``apply_dit_parallel`` is one-way (TP drops the full weights); reload the transformer to undo.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tilecast.kernels.collectives import AttentionParallel, gather_sequence, shard_sequence
from tilecast.kernels.nabla import NABLA, RING_REFUSAL
from tilecast.kernels.tp import parallelize_linears

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SplitInput:
    """Shard one forward input of a module along the sequence before the module runs."""

    name: str
    """Keyword name of the input (used when it is passed by keyword)."""
    index: int
    """Positional index of the input (used when it is passed positionally)."""
    dim: int
    """Sequence dim of the tensor."""
    sets_length: bool = False
    """This input defines the true sequence length of the current forward (the hidden states)."""


@dataclass(frozen=True, kw_only=True)
class GatherOutput:
    """All-gather a module's output along the sequence and drop the padding."""

    dim: int
    """Sequence dim of the output tensor."""


PlanEntry = SplitInput | GatherOutput

K6SR_SEQUENCE_PLAN: dict[str, tuple[PlanEntry, ...]] = {
    "visual_transformer_blocks.0": (SplitInput(name="hidden_states", index=0, dim=1, sets_length=True),),
    "visual_transformer_blocks.*": (SplitInput(name="rotary_emb", index=2, dim=0),),
    "visual_transformer_blocks.-1": (GatherOutput(dim=1),),
}
"""Module path → what its hooks do. ``*`` is every child of a ModuleList, ``-1`` the last."""

K6SR_TP_PLAN: dict[str, str] = {
    "visual_transformer_blocks.*.self_attention.to_query": "colwise",
    "visual_transformer_blocks.*.self_attention.to_key": "colwise",
    "visual_transformer_blocks.*.self_attention.to_value": "colwise",
    "visual_transformer_blocks.*.self_attention.out_layer": "rowwise",
    "visual_transformer_blocks.*.feed_forward.net.0.proj": "colwise",  # diffusers FeedForward: GELU.proj
    "visual_transformer_blocks.*.feed_forward.net.2": "rowwise",
}
"""``fnmatch`` pattern → TP style for ``tilecast.kernels.tp.parallelize_linears``."""


@dataclass
class _SequenceState:
    """Per-transformer state shared by the hooks of one forward."""

    parallel: AttentionParallel
    processors: list[Any]
    full_len: int | None = None
    cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def begin(self, full_len: int) -> None:
        self.full_len = full_len
        self.cache.clear()
        parallel = self.parallel.with_seq_len(full_len)
        for processor in self.processors:
            processor.parallel = parallel

    def split(self, spec: SplitInput, x: torch.Tensor) -> torch.Tensor:
        key = (spec.name, spec.dim)
        cached = self.cache.get(key)
        if cached is not None and cached[0] is x:
            return cached[1]
        if self.full_len is not None and x.shape[spec.dim] != self.full_len:
            raise ValueError(
                f"{spec.name} has {x.shape[spec.dim]} tokens on dim {spec.dim}, the hidden states {self.full_len}"
            )
        local, _pad = shard_sequence(x, spec.dim, self.parallel)
        self.cache[key] = (x, local)
        return local


def _resolve(model: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """Modules named by ``path``; ``*`` expands over children, negative ints index ModuleLists."""
    found = [("", model)]
    for atom in path.split("."):
        expanded = []
        for prefix, module in found:
            children = list(module.named_children())
            if atom == "*":
                picked = children
            elif atom.lstrip("-").isdigit() and isinstance(module, (nn.ModuleList, nn.Sequential)):
                index = int(atom)
                if not -len(module) <= index < len(module):
                    raise ValueError(f"plan path {path!r}: index {index} out of range for {prefix or 'model'}")
                picked = [children[index]]
            else:
                if not hasattr(module, atom) or not isinstance(getattr(module, atom), nn.Module):
                    raise ValueError(f"plan path {path!r}: {prefix or type(model).__name__} has no submodule {atom!r}")
                picked = [(atom, getattr(module, atom))]
            expanded += [(f"{prefix}.{name}" if prefix else name, child) for name, child in picked]
        found = expanded
    return found


def _attention_layers(transformer: nn.Module) -> list[nn.Module]:
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttention

    return [m for m in transformer.modules() if isinstance(m, Kandinsky6SRAttention)]


def _dense_processors(transformer: nn.Module, backend: str | None) -> list[Any]:
    from .attention import K6SRDenseAttnProcessor, install_dense_attention

    layers = _attention_layers(transformer)
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no Kandinsky6SRAttention layers")
    if not all(isinstance(layer.processor, K6SRDenseAttnProcessor) for layer in layers):
        logger.info("installing tilecast's attention processor (diffusers' NABLA processor is not sequence-parallel)")
        install_dense_attention(transformer, backend=backend)
    processors = [layer.processor for layer in layers]
    if backend is not None:
        for processor in processors:
            processor.backend = backend
    return processors


def _check_divisible(transformer: nn.Module, tp: int, ulysses: int) -> None:
    """``TopologyError`` unless the DiT can be split TP x Ulysses ways (``topology.model_errors``)."""
    from tilecast.runtime.topology import TopologyError, model_errors

    config = transformer.config
    num_heads = config.model_dim // sum(config.axes_dims)
    errors = model_errors(tp_size=tp, ulysses_degree=ulysses, num_heads=num_heads, ff_dim=config.ff_dim)
    if errors:
        raise TopologyError(errors)


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def dit_groups_from_mesh(mesh) -> dict[str, dist.ProcessGroup | None]:
    """``tp_group``/``ulysses_group``/``ring_group`` keyword arguments from a ``DeviceMesh``.

    Axes are looked up by name (``"tp"``, ``"ulysses"``, ``"ring"``); a missing axis or one of
    size 1 gives ``None``. Use as ``apply_dit_parallel(transformer, **dit_groups_from_mesh(mesh))``.
    """
    names = mesh.mesh_dim_names or ()
    groups = {}
    for axis in ("tp", "ulysses", "ring"):
        groups[f"{axis}_group"] = mesh[axis].get_group() if axis in names and mesh[axis].size() > 1 else None
    return groups


def apply_dit_parallel(
    transformer: nn.Module,
    *,
    tp_group: dist.ProcessGroup | None = None,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    sequence_plan: dict[str, tuple[PlanEntry, ...]] = K6SR_SEQUENCE_PLAN,
    tp_plan: dict[str, str] = K6SR_TP_PLAN,
) -> None:
    """Make a ``Kandinsky6SRTransformer3DModel`` run over the given groups, in place (one-way).

    Every rank of a TP × Ulysses × Ring group set calls this with its own groups and then runs the
    unchanged ``transformer(hidden_states, timestep)`` on the same full inputs; every rank gets the
    full output. ``None`` (or a one-rank group) disables an axis. ``backend`` sets the attention
    backend of every layer (``None`` keeps the processors' own, whose default is auto).
    """
    if getattr(transformer, "_tilecast_dit_parallel", False):
        raise ValueError("apply_dit_parallel was already applied to this transformer")
    tp, ulysses, ring = _group_size(tp_group), _group_size(ulysses_group), _group_size(ring_group)
    _check_divisible(transformer, tp, ulysses)
    processors = _dense_processors(transformer, backend)
    if ring > 1 and any(processor.backend == NABLA for processor in processors):
        raise ValueError(RING_REFUSAL)

    if tp > 1:
        parallelize_linears(transformer, tp_plan, tp_group)

    parallel = AttentionParallel(
        ulysses_group=ulysses_group if ulysses > 1 else None, ring_group=ring_group if ring > 1 else None
    )
    for processor in processors:
        processor.parallel = parallel if parallel.enabled else None
    if parallel.enabled:
        _install_sequence_hooks(transformer, sequence_plan, _SequenceState(parallel=parallel, processors=processors))
    transformer._tilecast_dit_parallel = True
    logger.info("DiT parallel: tp=%d ulysses=%d ring=%d backend=%s", tp, ulysses, ring, backend or "auto")


def _install_sequence_hooks(transformer: nn.Module, plan: dict[str, tuple[PlanEntry, ...]], state: _SequenceState):
    splits: dict[str, tuple[nn.Module, list[SplitInput]]] = {}
    gathers: dict[str, tuple[nn.Module, list[GatherOutput]]] = {}
    for path, entries in plan.items():
        for name, module in _resolve(transformer, path):
            for entry in entries:
                target = splits if isinstance(entry, SplitInput) else gathers
                target.setdefault(name, (module, []))[1].append(entry)

    for module, specs in splits.values():
        specs.sort(key=lambda s: not s.sets_length)  # the length-setting input goes first

        def pre_hook(module, args, kwargs, specs=specs):
            args = list(args)
            for spec in specs:
                in_kwargs = spec.name in kwargs
                x = kwargs[spec.name] if in_kwargs else args[spec.index]
                if spec.sets_length:
                    state.begin(x.shape[spec.dim])
                local = state.split(spec, x)
                if in_kwargs:
                    kwargs[spec.name] = local
                else:
                    args[spec.index] = local
            return tuple(args), kwargs

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)

    for module, specs in gathers.values():

        def post_hook(module, args, output, specs=specs):
            for spec in specs:
                output = gather_sequence(output, spec.dim, state.parallel, state.full_len)
            state.cache.clear()
            return output

        module.register_forward_hook(post_hook)
