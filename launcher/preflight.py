"""Checks a ``serve``/``generate`` command line must pass before any rank starts."""

from __future__ import annotations

import typer
from rich.console import Console

from tilecast.launcher import options as O
from tilecast.runtime.config import ServeConfig

console = Console(stderr=True)


def _picker_backend(name: str | None) -> str:
    """Our ``--attention-backend`` name in the picker's terms (platform | fa | torch_sdpa)."""
    if name is None or name in ("auto", "platform"):
        return "platform"
    if name in ("fa", "flash_attn") :
        return "fa"
    return "torch_sdpa" if "sdpa" in name else name


def validate_topology(config: ServeConfig) -> None:
    """The picker's rules for this command line, before any rank starts (exit 2 listing every error)."""
    from tilecast.runtime.picker import detect_hardware, validate_serve_topology

    num_heads = O.model_num_heads(config.model_path)
    hardware = None
    if config.device == "cuda":
        import torch

        from tilecast.runtime.distributed import under_torchrun

        if not torch.cuda.is_available():
            raise ValueError("--device cuda requested but CUDA is not available here (use --device cpu)")
        if not under_torchrun() and torch.cuda.device_count() < config.num_gpus:
            raise ValueError(
                f"--num-gpus {config.num_gpus} but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        hardware = detect_hardware(torch.cuda.get_device_name(0))
    errors = validate_serve_topology(
        config.num_gpus, config.tp_size, config.ulysses_degree, config.ring_degree, num_heads=num_heads,
        attention_backend=_picker_backend(config.attention_backend), hardware=hardware,
        placement=config.placement.picker_name,
    )
    if errors:
        for error in errors:
            console.print(f"[red]topology error:[/red] {error}")
        raise typer.Exit(2)
