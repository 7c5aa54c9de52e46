"""Where Kandinsky 6 SR's weights live: resident, component offload, layerwise offload, FSDP.

The four choices of the deployment picker's "Weight placement" (``runtime/picker.py``):

- **resident** (default): every weight on the device.
- **component offload** (``--cpu-offload-components``): each selected component lives in host
  memory and moves to the device whole around its use (``on_device`` in ``k6sr/stages.py``:
  encode, latent upscale, denoise, decode), then back.
- **layerwise offload** (``--layerwise-offload-components``): the selected components' *blocks*
  live in host memory and stream to the device just before they run, ``prefetch`` blocks ahead on
  a side CUDA stream so transfers overlap compute; each block leaves the device after it ran.
  Blocks: the DiT's ``visual_transformer_blocks`` (minus ``--dit-layerwise-resident-layers``
  leading ones, kept resident; ``--dit-offload-prefetch-size`` ahead), the K-VAE encoder's and
  decoder's levels (resnet blocks + down/upsample of one resolution), the latent upscalers'
  residual blocks. Everything else (embeddings, norms, heads, VAE mid blocks and in/out convs)
  and every temporal cache and activation stay on the device.
- **FSDP** (``--use-fsdp-inference true``): the DiT's weights sharded across all ranks with FSDP2
  (``fully_shard`` per transformer block, then the root); each block is all-gathered before it
  runs and freed after. Needs at least 2 ranks and every rank running every DiT call in the same
  order: refused with TP (each TP rank holds different weight slices) and with tile-parallel
  denoising across several units (units run different DiT calls).

What diffusers provides and what is ours: FSDP is PyTorch's ``fully_shard`` as is. For streaming,
diffusers 0.42's group offloading (``diffusers.hooks.apply_group_offloading``) was the model, but
it falls short here, so ``LayerStreamer`` is a small re-implementation of its idea:

1. ``block_level`` on a model also offloads the model's non-block weights (its "unmatched group",
   onloaded on every top-level forward); here they stay resident.
2. With ``use_stream=True`` the prefetch depth is exactly one group and ``num_blocks_per_group`` is
   forced to 1; ``ModuleGroup.onload_`` host-synchronises the transfer stream before every transfer
   (so deeper prefetch would collapse to depth one) and ``offload_`` without ``record_stream``
   synchronises the compute stream after every group. ``LayerStreamer`` orders with CUDA events
   (the compute stream waits on the device) and bounds how far the host runs ahead instead.
3. The K-VAE never calls a level as a module (it calls ``level.block[i]`` and ``level.upsample``),
   so a block-level hook on a level never fires; a streamed group here is entered by its first
   module's pre-hook and left by its last module's post-hook.
4. Keeping the first N blocks resident, and the latent upscaler bank's per-scale execution order
   (only one upscaler of the bank runs; the x2 upscaler's unused backbone never loads), are not
   expressible there.

Component offload is ours too: diffusers' model CPU offload and accelerate's
``cpu_offload_with_hook`` trigger on ``forward``, but the stages call ``vae.encode``/``vae.decode``.

Weights are read-only at inference, so offloading never copies device → host: the host copy made
once at load (pinned on CUDA) is the master, and "offload" just points each parameter back at it.
On CPU (tests) "onload" makes a fresh copy, so the hooks' moves are observable as ``data_ptr``
changes even though host and device are the same memory.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from typing import Any, Iterator

import torch
from torch import nn

from tilecast.runtime.placement_config import FLAG_RESIDENT, PlacementConfig

logger = logging.getLogger(__name__)

STREAM_PREFETCH = 1
"""Groups prefetched ahead for the VAE and latent upscaler (the prefetch flag is the DiT's)."""

# --------------------------------------------------------------------------- layerwise streaming

_OFF, _LOADING, _ON = "offloaded", "loading", "onloaded"


class _Group:
    """Modules whose weights move together; entered at the first module, left after the last."""

    def __init__(self, name: str, modules: list[nn.Module], device: torch.device) -> None:
        self.name = name
        self.modules = modules
        self.state = _OFF
        self.active = False  # entered and not yet left
        self.ready: Any = None  # CUDA event: transfer finished on the side stream
        self.onloads = 0
        tensors: dict[int, torch.Tensor] = {}
        for module in modules:
            for tensor in (*module.parameters(), *module.buffers()):
                tensors.setdefault(id(tensor), tensor)
        self.slots: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tensor in tensors.values():
            if device.type == "cuda":
                host = tensor.detach().to("cpu").pin_memory()
            else:
                host = tensor.data  # CPU: the loaded storage is the master; onload copies it
            tensor.data = host
            self.slots.append((tensor, host))

    @property
    def num_bytes(self) -> int:
        return sum(host.numel() * host.element_size() for _, host in self.slots)


class LayerStreamer:
    """Streams groups of a root module's submodules from host memory, in execution order.

    ``chain`` lists the groups in the order the root's forward runs them: entering group ``i``
    makes sure groups ``i+1 .. i+prefetch`` are on their way (the root's pre-hook starts the first
    ``prefetch``). ``extra`` groups are streamed but not expected to run (loaded on demand if they
    do). On CUDA, transfers run on a side stream from pinned memory; the compute stream waits for a
    group's event before it runs, and the host never runs more than two groups ahead of the device,
    so at most ``prefetch + 2`` streamed groups occupy device memory. Elsewhere transfers are
    synchronous copies.
    """

    def __init__(
        self,
        name: str,
        root: nn.Module,
        chain: list[tuple[str, list[nn.Module]]],
        *,
        device: torch.device,
        prefetch: int = 1,
        extra: list[tuple[str, list[nn.Module]]] = (),
    ) -> None:
        self.name = name
        self.root = root
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.chain = [_Group(n, mods, self.device) for n, mods in chain if mods]
        self.extra = [_Group(n, mods, self.device) for n, mods in extra if mods]
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._done: collections.deque = collections.deque()  # compute-stream events of left groups
        self.late = 0  # chain groups not prefetched in time (entered while still off the device)
        self._handles = [
            root.register_forward_pre_hook(lambda module, args: self._begin(), prepend=True),
            root.register_forward_hook(lambda module, args, output: self._end()),
        ]
        for index, group in enumerate(self.chain + self.extra):
            chain_index = index if index < len(self.chain) else None
            for module in group.modules:
                self._handles.append(
                    module.register_forward_pre_hook(
                        lambda module, args, g=group, i=chain_index: self._enter(g, i), prepend=True
                    )
                )
            self._handles.append(
                group.modules[-1].register_forward_hook(lambda module, args, output, g=group: self._leave(g))
            )

    # -- bookkeeping for tests and logs
    @property
    def groups(self) -> list[_Group]:
        return self.chain + self.extra

    def onloaded(self) -> list[str]:
        """Names of the streamed groups currently on (or on their way to) the device."""
        return [g.name for g in self.groups if g.state != _OFF]

    @property
    def streamed_bytes(self) -> int:
        return sum(g.num_bytes for g in self.groups)

    def remove(self) -> None:
        """Remove the hooks and put every streamed weight back on the device (resident)."""
        for handle in self._handles:
            handle.remove()
        for group in self.groups:
            for tensor, host in group.slots:
                tensor.data = host.to(self.device)
            group.state = _ON

    # -- transfers
    def _onload(self, group: _Group) -> None:
        group.onloads += 1
        if self.stream is None:
            for tensor, host in group.slots:
                tensor.data = host.to(self.device, copy=True)
            group.state = _ON
            return
        with torch.cuda.stream(self.stream):
            for tensor, host in group.slots:
                tensor.data = host.to(self.device, non_blocking=True)
            group.ready = torch.cuda.Event()
            group.ready.record(self.stream)
        group.state = _LOADING

    def _offload(self, group: _Group) -> None:
        for tensor, host in group.slots:
            tensor.data = host
        group.state = _OFF

    def _bound_run_ahead(self) -> None:
        # Device memory a left group held is reusable only once the compute stream is past it: wait
        # until everything but the last left group has finished, so the host stays <= 2 groups ahead.
        while len(self._done) > 1:
            self._done.popleft().synchronize()

    def _prefetch(self, first: int) -> None:
        for index in range(first, min(first + self.prefetch, len(self.chain))):
            if self.chain[index].state == _OFF:
                self._onload(self.chain[index])

    # -- hooks
    def _begin(self) -> None:
        self._bound_run_ahead()
        self._prefetch(0)

    def _enter(self, group: _Group, chain_index: int | None) -> None:
        if group.active:
            return  # a later module of the same group
        group.active = True
        if group.state == _OFF:
            if chain_index is not None:
                self.late += 1
            self._onload(group)
        if group.state == _LOADING:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(group.ready)
            for tensor, _ in group.slots:
                tensor.data.record_stream(compute)  # allocated on the side stream, used on this one
            group.ready = None
            group.state = _ON
        if chain_index is not None:
            self._bound_run_ahead()
            self._prefetch(chain_index + 1)

    def _leave(self, group: _Group) -> None:
        group.active = False
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._done.append(event)
        self._offload(group)

    def _end(self) -> None:
        # Groups prefetched but not run in this forward (e.g. past a conditional path) go back.
        for group in self.groups:
            if group.state == _LOADING:
                self.stream.synchronize()
            if group.state != _OFF:
                self._offload(group)
            group.active = False


def dit_chain(transformer: nn.Module, resident_layers: int) -> list[tuple[str, list[nn.Module]]]:
    """The DiT's streamed groups: one per transformer block after the first ``resident_layers``."""
    blocks = transformer.visual_transformer_blocks
    return [(f"visual_transformer_blocks.{i}", [blocks[i]]) for i in range(resident_layers, len(blocks))]


def _level_modules(level: nn.Module, sampler: str) -> list[nn.Module]:
    modules = list(level.block)
    if hasattr(level, sampler):
        modules.append(getattr(level, sampler))
    return modules


def vae_chains(vae: nn.Module) -> list[tuple[str, nn.Module, list[tuple[str, list[nn.Module]]]]]:
    """``(name, root, chain)`` for the K-VAE encoder (levels 0..L-1) and decoder (levels L-1..0, its
    execution order); each level's resnet blocks and its down/upsample form one group."""
    encoder = [(f"encoder.down.{i}", _level_modules(level, "downsample")) for i, level in enumerate(vae.encoder.down)]
    decoder = [
        (f"decoder.up.{i}", _level_modules(vae.decoder.up[i], "upsample")) for i in reversed(range(len(vae.decoder.up)))
    ]
    return [("vae.encoder", vae.encoder, encoder), ("vae.decoder", vae.decoder, decoder)]


def _residual_blocks(module: nn.Module, prefix: str) -> list[tuple[str, list[nn.Module]]]:
    return [
        (f"{prefix}{name}", [child])
        for name, child in module.named_modules()
        if type(child).__name__.endswith("ResidualBlock")
    ]


def upscaler_chains(bank: nn.Module) -> list[tuple[str, nn.Module, list, list]]:
    """``(name, root, chain, extra)`` per upscaler of the bank. The x2 upscaler runs only its
    ``x2_branch`` (adapter → mid → post blocks); its backbone blocks are ``extra`` (never loaded
    unless a future forward runs them). The x4 upscaler runs pre → mid → post blocks."""
    result = []
    for index, model in enumerate(bank._models):
        prefix = f"_models.{index}."
        if getattr(model, "scale", None) == 2 and hasattr(model, "x2_branch"):
            chain = _residual_blocks(model.x2_branch, prefix + "x2_branch.")
        else:
            chain = [
                item
                for part in ("pre_blocks", "mid_blocks", "post_blocks")
                for item in _residual_blocks(getattr(model, part), f"{prefix}{part}.")
            ]
        in_chain = {id(mods[0]) for _, mods in chain}
        extra = [item for item in _residual_blocks(model, prefix) if id(item[1][0]) not in in_chain]
        result.append((f"latent_upscaler.{prefix[:-1]}", model, chain, extra))
    return result


# --------------------------------------------------------------------------- component offload


class ComponentOffload:
    """Keeps one component in host memory; ``on_device(module)`` brings it to the device whole.

    Re-entrant: nested ``on_device`` of the same component (a stage around a per-tile call) moves
    it once. On CUDA the host copy is pinned and the copy runs on the current stream."""

    def __init__(self, name: str, module: nn.Module, device: torch.device) -> None:
        self.name = name
        self.device = torch.device(device)
        self.group = _Group(name, [module], self.device)
        self.depth = 0
        self.onloads = 0
        module._tilecast_component_offload = self

    @property
    def on_device(self) -> bool:
        return self.depth > 0

    def enter(self) -> None:
        self.depth += 1
        if self.depth == 1:
            self.onloads += 1
            copy = self.device.type != "cuda"
            for tensor, host in self.group.slots:
                tensor.data = host.to(self.device, non_blocking=not copy, copy=copy)

    def exit(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            for tensor, host in self.group.slots:
                tensor.data = host


@contextlib.contextmanager
def on_device(module: nn.Module | None) -> Iterator[None]:
    """Run the block with ``module``'s weights on the device when it is component-offloaded
    (``--cpu-offload-components``); a no-op for ``None`` and for any other placement."""
    offload: ComponentOffload | None = (
        getattr(module, "_tilecast_component_offload", None) if module is not None else None
    )
    if offload is None:
        yield
        return
    offload.enter()
    try:
        yield
    finally:
        offload.exit()


# --------------------------------------------------------------------------- FSDP


def apply_fsdp(transformer: nn.Module, group, device: torch.device) -> nn.Module:
    """``fully_shard`` every transformer block, then the root, over ``group`` (all ranks).

    Blocks reshard after their forward (weights all-gathered just before a block runs, freed
    after); FSDP2 keeps the root's own small weights (embeddings, output head) gathered after the
    first forward."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, torch.device(device).type)
    for block in transformer.visual_transformer_blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(transformer, mesh=mesh, reshard_after_forward=True)
    return transformer


# --------------------------------------------------------------------------- entry point


@dataclasses.dataclass(kw_only=True)
class AppliedPlacement:
    """What ``apply_placement`` did (for logs, tests and benchmarks)."""

    config: PlacementConfig
    streamers: dict[str, LayerStreamer] = dataclasses.field(default_factory=dict)
    """Root name (``transformer``, ``vae.encoder``, ...) → its streamer."""
    offloads: dict[str, ComponentOffload] = dataclasses.field(default_factory=dict)
    """Component name → its whole-component offload."""
    fsdp: bool = False


def apply_placement(parts, ctx) -> AppliedPlacement:
    """Apply the placement of ``ctx.settings`` (``ServeConfig.placement``) to the loaded ``parts``
    (``K6SRComponents``, already on ``ctx.device``, after attention and DiT-parallel setup).

    Raises ``ValueError`` for a placement this run's ranks cannot take."""
    settings = ctx.settings
    config = settings.placement
    applied = AppliedPlacement(config=config)
    config.check_topology(
        world_size=ctx.world_size,
        tp_size=settings.tp_size,
        unit_size=settings.tp_size * settings.ulysses_degree * settings.ring_degree,
        tile_parallel=settings.tile_parallel,
    )
    device = torch.device(parts.device)
    modules = {"transformer": parts.transformer, "vae": parts.vae, "latent_upscaler": parts.latent_upscaler}
    for name in config.offloaded:
        if name not in modules:
            raise ValueError(f"{name}: Kandinsky 6 SR has no {name} to offload (give {', '.join(modules)})")
        if modules[name] is None and ctx.rank == 0:
            logger.warning("%s: the checkpoint has no %s; nothing to offload", name, name)

    if config.use_fsdp_inference:
        apply_fsdp(parts.transformer, ctx.device_group, device)
        applied.fsdp = True

    for name in config.cpu_offload_components:
        if modules[name] is not None:
            applied.offloads[name] = ComponentOffload(name, modules[name], device)

    layerwise = config.layerwise_offload_components
    if "transformer" in layerwise:
        chain = dit_chain(parts.transformer, config.dit_layerwise_resident_layers)
        if not chain and ctx.rank == 0:
            logger.warning(
                "%s %d keeps all %d DiT blocks resident: nothing of the DiT is streamed",
                FLAG_RESIDENT,
                config.dit_layerwise_resident_layers,
                len(parts.transformer.visual_transformer_blocks),
            )
        if chain:
            applied.streamers["transformer"] = LayerStreamer(
                "transformer",
                parts.transformer,
                chain,
                device=device,
                prefetch=config.dit_offload_prefetch_size,
            )
    if "vae" in layerwise:
        for root_name, root, chain in vae_chains(parts.vae):
            applied.streamers[root_name] = LayerStreamer(
                root_name, root, chain, device=device, prefetch=STREAM_PREFETCH
            )
    if "latent_upscaler" in layerwise and parts.latent_upscaler is not None:
        for root_name, root, chain, extra in upscaler_chains(parts.latent_upscaler):
            applied.streamers[root_name] = LayerStreamer(
                root_name,
                root,
                chain,
                device=device,
                prefetch=STREAM_PREFETCH,
                extra=extra,
            )
    if device.type == "cuda" and (applied.streamers or applied.offloads):
        torch.cuda.empty_cache()  # return the device copies the host copies replaced
    if ctx.rank == 0 and config.picker_name != "resident":
        streamed = sum(s.streamed_bytes for s in applied.streamers.values())
        whole = sum(o.group.num_bytes for o in applied.offloads.values())
        logger.info(
            "weight placement %s: %.2f GiB streamed by layer (%s), %.2f GiB offloaded whole (%s)%s",
            config.picker_name,
            streamed / 2**30,
            ", ".join(applied.streamers) or "none",
            whole / 2**30,
            ", ".join(applied.offloads) or "none",
            ", DiT sharded with FSDP" if applied.fsdp else "",
        )
    return applied
