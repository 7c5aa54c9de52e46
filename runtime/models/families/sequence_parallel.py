"""Sequence parallelism (Ulysses, Ring, Ulysses x Ring) for the diffusers families' transformers.

Legend: B batch, S tokens (this rank's shard unless noted), C channels, N sequence-parallel degree.

A family's transformer gets a context-parallel plan (diffusers' ``_cp_plan`` format: submodule name
→ ``{input name or output index: ContextParallelInput}`` or ``ContextParallelOutput``; ``''`` is the
root, ``*`` every child of a container, and here also ``-1`` the last child of a ModuleList).
``apply_sequence_parallel`` installs it as forward hooks and swaps every attention processor for a
tilecast one (``families.sp_attention``) that runs ``tilecast.kernels.attention.attention`` over
the ranks' Ulysses and Ring groups:

- a split input (or a split output, ``split_output=True``) is zero-padded at the end of its
  sequence dim to a multiple of N and cut ring-major (``kernels.collectives.shard_sequence``'s
  layout); the true length of every split name is remembered for the current forward;
- the attention processors build a key mask from those lengths (and from the model's own masks,
  split the same way), so padded keys get zero weight in every segment (text and image shards
  alike: the joint sequence is ``[text shard, image shard]`` on every rank, the kernels carry the
  mask through the Ulysses exchange and around the ring); padded queries compute throwaway rows;
- a gather output is all-gathered over the N ranks and cut to the true length of the plan's
  *stream input* (the first input the plan splits, ``hidden_states`` in diffusers' plans), as
  split most recently in this forward.

So a sequence of any length (odd latent sizes, any prompt length) runs, and the output equals the
single-rank one within fp32 rounding. Text encoders, VAE and scheduler are not touched: every rank
of a sequence-parallel group computes the same batch's embeddings and decodes the same latents.

Why not diffusers' ``apply_context_parallel``: its sharders need the split dim to divide by N
(``EquipartitionSharder``) or drop the masks' meaning (``ulysses_anything``), and its attention runs
through diffusers' dispatcher, not tilecast's kernels. The plans themselves are reused as data.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tilecast.kernels.collectives import AttentionParallel, gather_sequence

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ state
@dataclasses.dataclass
class _Split:
    """One split input of the current forward."""

    true_len: int
    """Its length before padding."""
    local_len: int
    """Tokens per rank (padded length / N)."""


class SequenceState:
    """What the hooks and processors of one transformer share during a forward.

    ``parallel`` carries the groups; ``splits`` the true lengths of the inputs split so far in this
    forward, by name; ``reset`` runs at the start of every transformer forward.
    """

    def __init__(self, parallel: AttentionParallel, stream: str) -> None:
        assert parallel.enabled, "sequence parallelism needs an Ulysses or Ring group of more than one rank"
        self.parallel = parallel
        self.stream = stream
        """Name of the plan's stream input: gathers cut to its true length."""
        self.splits: dict[str, _Split] = {}
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def reset(self) -> None:
        self.splits.clear()
        self._cache.clear()

    # ---------------------------------------------------------------- split / gather
    def split(self, name: str, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's shard of ``x`` along ``dim`` (zero-padded to a multiple of N first); records
        ``name``'s true length. The same tensor split twice (a mask passed to every block) is cut once."""
        cached = self._cache.get(name)
        if cached is not None and cached[0] is x:
            return cached[1]
        num_shards, dim = self.parallel.sp_size, dim % x.dim()
        true_len = x.shape[dim]
        pad = (-true_len) % num_shards
        if pad:
            shape = list(x.shape)
            shape[dim] = pad
            x_padded = torch.cat([x, x.new_zeros(shape)], dim=dim)  # cat, not F.pad: complex rope tables too
        else:
            x_padded = x
        local_len = x_padded.shape[dim] // num_shards
        local = x_padded.narrow(dim, self.parallel.sp_rank * local_len, local_len)
        self.splits[name] = _Split(true_len=true_len, local_len=local_len)
        self._cache[name] = (x, local)
        return local

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """All shards of ``local`` along ``dim``, cut to the stream input's true length."""
        split = self.splits.get(self.stream)
        if split is None:
            raise RuntimeError(f"a gather ran before the stream input {self.stream!r} was split in this forward")
        if local.shape[dim] != split.local_len:
            raise RuntimeError(
                f"gathered output has {local.shape[dim]} tokens per rank on dim {dim}; the stream input "
                f"{self.stream!r} has {split.local_len}"
            )
        return gather_sequence(local, dim, self.parallel, split.true_len)

    # ---------------------------------------------------------------- masks
    def valid(self, name: str, device: torch.device) -> torch.Tensor | None:
        """Which of this rank's tokens of input ``name`` are real (bool ``(S,)``); ``None`` when the
        input was not padded. The answer has the same kind on every rank (a mask decides whether
        attention exchanges masks, a collective), even where this rank's own shard has no padding."""
        split = self._split(name)
        if split.local_len * self.parallel.sp_size == split.true_len:
            return None
        start = self.parallel.sp_rank * split.local_len
        return torch.arange(start, start + split.local_len, device=device) < split.true_len

    def local_len(self, name: str) -> int:
        return self._split(name).local_len

    def key_mask(
        self, parts: list[tuple[str, torch.Tensor | None]], batch: int, device: torch.device
    ) -> torch.Tensor | None:
        """The key mask (bool ``(B, S)``) of a local sequence made of the shards of ``parts`` in order.

        Each part is ``(input name, the model's own mask of that shard or None)``; a key is attended
        when it is real and its own mask allows it. ``None`` (on every rank alike) when no part was
        padded and none has a mask of its own.
        """
        masks = []
        for name, own_BS in parts:
            valid_S = self.valid(name, device)
            if own_BS is not None:
                own_BS = own_BS.to(torch.bool)
                masks.append(own_BS if valid_S is None else own_BS & valid_S)
            else:
                masks.append(None if valid_S is None else valid_S.expand(batch, -1))
        if all(mask is None for mask in masks):
            return None
        return torch.cat(
            [
                torch.ones(batch, self.local_len(name), dtype=torch.bool, device=device) if mask is None else mask
                for (name, _), mask in zip(parts, masks)
            ],
            dim=1,
        )

    def _split(self, name: str) -> _Split:
        split = self.splits.get(name)
        if split is None:
            raise RuntimeError(f"input {name!r} was not split in this forward (the plan does not split it)")
        return split


# ------------------------------------------------------------------------------------ plan
def resolve_plan(ref: Any) -> dict[str, Any]:
    """A plan from a family's ``cp_plan``: the dict itself, ``"module:attr"`` naming one, or naming
    a function that returns one."""
    if isinstance(ref, str):
        from tilecast.runtime.cache import resolve_ref

        ref = resolve_ref(ref)
    plan = ref() if callable(ref) else ref
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"a context-parallel plan is a non-empty dict of submodule name -> entries, got {plan!r}")
    return plan


def stream_input(plan: dict[str, Any]) -> str:
    """The first input name the plan splits (its token stream, whose length gathers restore)."""
    for entries in plan.values():
        if isinstance(entries, dict):
            for key, entry in entries.items():
                if isinstance(key, str) and not _entry(entry).split_output:
                    return key
    raise ValueError("the context-parallel plan splits no input by name")


def _entry(entry):
    """The first ``ContextParallelInput`` of an entry (a tuple input carries one per element)."""
    return entry[0] if isinstance(entry, (list, tuple)) else entry


def submodules(model: nn.Module, path: str) -> list[nn.Module]:
    """The modules ``path`` names: ``''`` the model, ``*`` every child, a (negative) int a ModuleList index."""
    found = [model]
    for atom in path.split(".") if path else []:
        expanded = []
        for module in found:
            if atom == "*":
                expanded += list(module.children())
            elif atom.lstrip("-").isdigit() and isinstance(module, (nn.ModuleList, nn.Sequential)):
                index = int(atom)
                if not -len(module) <= index < len(module):
                    raise ValueError(f"plan path {path!r}: index {index} out of range ({len(module)} modules)")
                expanded.append(module[index])
            elif isinstance(getattr(module, atom, None), nn.Module):
                expanded.append(getattr(module, atom))
            else:
                raise ValueError(f"plan path {path!r}: {type(module).__name__} has no submodule {atom!r}")
        found = expanded
    if not found:
        raise ValueError(f"plan path {path!r} names no module")
    return found


def _parameter_index(module: nn.Module, name: str, path: str) -> int | None:
    """Position of ``name`` in ``module.forward``'s parameters (``None``: only by keyword, ``**kwargs``).
    ``ValueError`` when the forward cannot take it at all (a plan for another version of the model)."""
    parameters = inspect.signature(type(module).forward).parameters
    names = list(parameters)[1:]  # without self
    if name in names:
        return names.index(name)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    raise ValueError(f"plan entry {path!r}: {type(module).__name__}.forward has no input {name!r}")


def _split_value(state: SequenceState, name: str, value: Any, entry: Any) -> Any:
    """``value`` split per ``entry`` (a tuple value takes a tuple of entries); ``None`` passes."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not isinstance(entry, (list, tuple)) or len(entry) != len(value):
            raise ValueError(f"input {name!r} is a sequence of {len(value)}; the plan gives {entry!r}")
        return type(value)(
            _split_value(state, f"{name}.{i}", v, e) if torch.is_tensor(v) and not e.split_output else v
            for i, (v, e) in enumerate(zip(value, entry))
        )
    if not torch.is_tensor(value):
        raise ValueError(f"input {name!r} is a {type(value).__name__}; the plan splits tensors")
    if entry.expected_dims is not None and value.dim() != entry.expected_dims:
        return value  # as diffusers: an input of another rank is not split (Wan 2.1's 1-D timestep)
    return state.split(name, value, entry.split_dim)


def _install_split(module: nn.Module, entries: dict, state: SequenceState, path: str) -> None:
    inputs = {k: e for k, e in entries.items() if isinstance(k, str) and not _entry(e).split_output}
    outputs = {k: e for k, e in entries.items() if _entry(e).split_output}
    unknown = [k for k in entries if k not in inputs and k not in outputs]
    if unknown or any(not isinstance(k, int) for k in outputs):
        raise ValueError(f"plan entry {path!r}: inputs are named, split outputs indexed; got keys {list(entries)}")
    indices = {name: _parameter_index(module, name, path) for name in inputs}

    if inputs:

        def pre_hook(module, args, kwargs):
            args = list(args)
            for name, entry in inputs.items():
                if name in kwargs:
                    kwargs[name] = _split_value(state, name, kwargs[name], entry)
                elif indices[name] is not None and indices[name] < len(args):
                    args[indices[name]] = _split_value(state, name, args[indices[name]], entry)
            return tuple(args), kwargs

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)

    if outputs:

        def post_hook(module, args, output):
            single = torch.is_tensor(output)
            values = [output] if single else list(output)
            for index, entry in outputs.items():
                values[index] = _split_value(state, f"{path}[{index}]", values[index], entry)
            return values[0] if single else type(output)(values)

        module.register_forward_hook(post_hook)


def _install_gather(module: nn.Module, entries: list, state: SequenceState) -> None:
    def post_hook(module, args, output):
        single = torch.is_tensor(output)
        values = [output] if single else list(output)
        if len(values) != len(entries):
            raise ValueError(f"{type(module).__name__} returned {len(values)} outputs; the plan gathers {len(entries)}")
        for i, entry in enumerate(entries):
            if entry is not None and (entry.expected_dims is None or values[i].dim() == entry.expected_dims):
                values[i] = state.gather(values[i], entry.gather_dim)
        return values[0] if single else type(output)(values)

    module.register_forward_hook(post_hook)


# ------------------------------------------------------------------------------------ apply
def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def sequence_degrees(groups) -> tuple[int, int]:
    """``(ulysses, ring)`` sizes of a ``ParallelGroups`` (``(1, 1)`` for ``None``)."""
    if groups is None:
        return 1, 1
    return _group_size(groups.ulysses_group), _group_size(groups.ring_group)


def apply_sequence_parallel(
    transformer: nn.Module,
    plan: dict[str, Any],
    *,
    ulysses_group=None,
    ring_group=None,
    backend: str | None = None,
) -> SequenceState:
    """Split ``transformer``'s token sequence over the given groups, in place; returns the shared state.

    Every rank of the groups calls this with the same ``plan`` and then runs the unchanged model on
    the same full inputs; every rank gets the full output. ``backend``: the attention backend of
    every processor (``None``: the fastest available). ``ValueError`` if an attention layer has a
    processor tilecast cannot run sequence-parallel, or the heads do not divide by the Ulysses size.
    """
    from tilecast.runtime.models.families.sp_attention import install_processors

    if getattr(transformer, "_tilecast_sequence_parallel", None) is not None:
        raise ValueError("apply_sequence_parallel was already applied to this transformer")
    parallel = AttentionParallel(
        ulysses_group=ulysses_group if _group_size(ulysses_group) > 1 else None,
        ring_group=ring_group if _group_size(ring_group) > 1 else None,
    )
    if not parallel.enabled:
        raise ValueError("apply_sequence_parallel needs an Ulysses or Ring group of more than one rank")
    _check_heads(transformer, parallel.ulysses_size)
    state = SequenceState(parallel, stream_input(plan))
    layers = install_processors(transformer, state, backend)

    transformer.register_forward_pre_hook(lambda module, args: state.reset(), prepend=True)
    for path, entries in plan.items():
        for module in submodules(transformer, path):
            if isinstance(entries, dict):
                _install_split(module, entries, state, path)
            else:
                gathers = list(entries) if isinstance(entries, (list, tuple)) else [entries]
                if not all(entry is None or hasattr(entry, "gather_dim") for entry in gathers):
                    raise ValueError(f"plan entry {path!r}: expected ContextParallelOutput, got {entries!r}")
                _install_gather(module, gathers, state)
    transformer._tilecast_sequence_parallel = state
    logger.info(
        "sequence parallel: %s with Ulysses %d x Ring %d over %d attention layers (backend %s)",
        type(transformer).__name__,
        parallel.ulysses_size,
        parallel.ring_size,
        layers,
        backend or "auto",
    )
    return state


def _check_heads(transformer: nn.Module, ulysses: int) -> None:
    config = getattr(transformer, "config", {})
    heads = config.get("num_attention_heads") or config.get("n_heads")
    if ulysses > 1 and heads and heads % ulysses:
        raise ValueError(
            f"{type(transformer).__name__} has {heads} attention heads, which do not divide by the Ulysses "
            f"degree {ulysses}; choose an Ulysses degree that divides {heads}"
        )


def install_for_family(pipe: Any, family: type, ctx: Any) -> SequenceState | None:
    """What a family's ``load`` calls: with an Ulysses or Ring degree above 1 in ``ctx.groups``, the
    family's plan (its ``cp_plan``) goes on ``pipe.transformer`` over those groups, attention on
    ``--attention-backend``, and on ``pipe.transformer_2`` too where there is one (Wan2.2 A14B's
    low-noise expert; each transformer keeps its own state); otherwise nothing changes. Returns the
    first transformer's state. ``ValueError`` for a family without a plan."""
    ulysses, ring = sequence_degrees(getattr(ctx, "groups", None))
    if ulysses == 1 and ring == 1:
        return None
    if getattr(family, "cp_plan", None) is None:
        raise ValueError(
            f"{family.family} has no sequence-parallel plan: run it with --ulysses-degree 1 --ring-degree 1"
        )
    if ctx.settings.cuda_graphs:
        raise ValueError(
            "--cuda-graphs with --ulysses-degree/--ring-degree above 1 is not supported: the sequence-parallel "
            "hooks keep per-forward state and run collectives that a captured graph would replay stale"
        )
    backend = ctx.settings.attention_backend
    states = [
        apply_sequence_parallel(
            transformer,
            resolve_plan(family.cp_plan),
            ulysses_group=ctx.groups.ulysses_group,
            ring_group=ctx.groups.ring_group,
            backend=backend,
        )
        for transformer in (pipe.transformer, getattr(pipe, "transformer_2", None))
        if transformer is not None
    ]
    return states[0]


SEQUENCE_PARALLEL_SETTINGS = frozenset({"ulysses_degree", "ring_degree"})
"""The ``ServeConfig`` fields a family with a ``cp_plan`` honours (``DiffusersBatchPipeline`` adds them)."""
