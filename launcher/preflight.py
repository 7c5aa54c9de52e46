"""Checks a ``serve``/``generate`` command line must pass before any rank starts.

``validate_topology`` refuses only on the one rule set's errors (``Topology.check``: the layout
with ``--dp-degree``, the model's DiT, the attention kernels, FSDP); what ``serve``'s replica
groups cannot honour (``replicas.ServingShape.errors``) is refused by every rank at start-up,
before the model loads (``start_rank``). The deployment guide's recipe rules
(``runtime/picker.py``) are printed as warnings on rank 0 and never refuse. Under torchrun the
world size is ``--num-gpus`` on all nodes together (``launcher/cli.py`` checks it against
``WORLD_SIZE``); only this node's ranks (``LOCAL_WORLD_SIZE``) need a CUDA device here.
"""

from __future__ import annotations

import logging
import os

import typer
from rich.console import Console
from rich.markup import escape

from tilecast.runtime.config import ServeConfig

console = Console(stderr=True)
logger = logging.getLogger(__name__)


def topology_errors(config: ServeConfig) -> list[str]:
    """Every error of the one rule set for this command line (empty when it can run)."""
    from tilecast.runtime.topology import Topology, degrees_of, model_limits

    limits = model_limits(config.model_path)
    return Topology.check(
        num_gpus=config.num_gpus,
        **degrees_of(config),
        num_heads=limits.num_heads,
        ff_dim=limits.ff_dim,
        attention_backend=config.attention_backend,
        fsdp=bool(config.use_fsdp_inference),
    )


def node_layout() -> tuple[int, int]:
    """``(nodes, ranks on this node)`` under torchrun (``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``); (1, 0) outside."""
    from tilecast.runtime.torchrun_env import under_torchrun

    if not under_torchrun():
        return 1, 0
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    return max(1, -(-world // max(local, 1))), local


def recipe_warnings(config: ServeConfig, hardware: str | None, nodes: int = 1) -> list[str]:
    """The deployment guide's findings for this command line (``picker.recipe_findings``); none
    for hardware the guide does not cover (CPU, or a GPU it does not list)."""
    from tilecast.runtime import picker
    from tilecast.runtime.topology import model_limits

    if hardware is None:
        return []
    return picker.recipe_findings(
        num_gpus=config.num_gpus,
        tp_size=config.tp_size,
        ulysses_degree=config.ulysses_degree,
        ring_degree=config.ring_degree,
        nodes=nodes,
        num_heads=model_limits(config.model_path).num_heads,
        attention_backend=config.attention_backend,
        placement=config.placement.picker_name,
        decode=picker.decode_choice(
            use_parallel_tiling=config.vae.use_parallel_tiling, use_parallel_decode=config.vae.use_parallel_decode
        ),
        hardware=hardware,
    )


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def validate_topology(config: ServeConfig) -> None:
    """The one rule set for this command line, before any rank starts (exit 2 listing every error);
    the deployment guide's recipe findings as warnings (rank 0)."""
    from tilecast.runtime.picker import detect_hardware

    nodes, local_ranks = node_layout()
    hardware = None
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda requested but CUDA is not available here (use --device cpu)")
        needed = local_ranks or config.num_gpus  # under torchrun: this node's ranks only
        if torch.cuda.device_count() < needed:
            where = f"torchrun starts {needed} rank(s) on this node" if local_ranks else f"--num-gpus {needed}"
            raise ValueError(f"{where} but this machine has {torch.cuda.device_count()} CUDA device(s)")
        hardware = detect_hardware(torch.cuda.get_device_name(0))
    errors = topology_errors(config)
    if errors:
        for error in errors:
            console.print(f"[red]topology error:[/red] {escape(error)}")
        raise typer.Exit(2)
    if _is_rank_zero():
        for warning in recipe_warnings(config, hardware, nodes):
            console.print(f"[yellow]topology warning:[/yellow] {escape(warning)}", soft_wrap=True)
