"""``tilecast bench step``: one FLUX denoising step, diffusers' eager model against tilecast's, in one run.

One model is built (the family's ``build_diffusers``: for ``random/flux`` the released size with
seeded random weights). The step's inputs come from the pipeline's own ``encode_prompt`` and
``prepare_latents`` at the requested size, ``batch`` distinct prompts. The transformer's forward
is timed as diffusers ships it (eager, PyTorch's default SDPA); then tilecast's fast paths are
installed on the same object (``install_fast_paths``: its attention kernel, fused projections,
with ``quantize`` FP8 linear layers, with ``compile_blocks`` compiled blocks, with ``cuda_graphs``
the forward replayed as a CUDA graph) and the same inputs are timed again. Each side is warmed up
first (the compile and the graph capture are in tilecast's warm-up, reported as ``warmup_s``).
With ``loop_steps`` each side instead runs the pipeline's own denoising loop of that many steps
from the same latents and embeddings (``output_type="latent"``, no decode) and a step is the
loop's time over its steps: what a served request's step costs, scheduler steps and what a loop
shares between its steps (``flux_plan``'s modulation planned once per loop) included.
Reported per batch size: milliseconds per step, per image-step, achieved TFLOP/s (FLOPs counted by
PyTorch's ``FlopCounterMode`` on one step), tilecast / diffusers, and the two sides' outputs
compared: the largest difference relative to the output's scale, and the PSNR (peak: the
reference's largest magnitude). On a GPU with NVML (the ``bench`` extra) each side's row also
carries the SM clock and power draw sampled while it was timed (``gpu_clock``): a card at its power
limit runs the denser side at a lower clock.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from tilecast.launcher.bench import gpu_clock, timeline
from tilecast.launcher.bench.report import max_rel_diff, profile_call, psnr_db, ratio, time_repeated
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.models.families.flux import FluxT2IPipeline
from tilecast.runtime.registry import resolve_pipeline

GUIDANCE = 3.5
"""FLUX.1-dev's default distilled guidance, fed as an embedding."""


def step_inputs(pipe, batch: int, *, width: int, height: int, max_sequence_length: int) -> dict[str, Any]:
    """The transformer's keyword arguments for one step of ``batch`` prompts, made by the pipeline itself."""
    device = pipe.transformer.device
    prompt_embeds, pooled, text_ids = pipe.encode_prompt(
        prompt=[f"bench step prompt {i}" for i in range(batch)],
        prompt_2=None,
        device=device,
        max_sequence_length=max_sequence_length,
    )
    latents, image_ids = pipe.prepare_latents(
        batch,
        pipe.transformer.config.in_channels // 4,
        height,
        width,
        prompt_embeds.dtype,
        device,
        torch.Generator(device="cpu").manual_seed(0),
    )
    return dict(
        hidden_states=latents,
        timestep=torch.full((batch,), 0.5, device=device, dtype=latents.dtype),
        guidance=torch.full((batch,), GUIDANCE, device=device, dtype=torch.float32),
        pooled_projections=pooled,
        encoder_hidden_states=prompt_embeds,
        txt_ids=text_ids,
        img_ids=image_ids,
        return_dict=False,
    )


def denoising_loop(pipe, inputs: dict, *, steps: int, width: int, height: int) -> torch.Tensor:
    """The latents of ``pipe``'s own ``steps``-step loop from ``inputs``' latents and embeddings."""
    return pipe(
        prompt_embeds=inputs["encoder_hidden_states"],
        pooled_prompt_embeds=inputs["pooled_projections"],
        latents=inputs["hidden_states"],
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=GUIDANCE,
        output_type="latent",
        return_dict=False,
    )[0]


def time_step(
    pipe,
    inputs: dict,
    *,
    warmup: int,
    iters: int,
    loop_steps: int,
    width: int,
    height: int,
    clock: gpu_clock.ClockSampler | None = None,
) -> tuple[float, float, torch.Tensor]:
    """(seconds of warm-up, milliseconds per step, the output): ``iters`` transformer calls on
    ``inputs``, or with ``loop_steps`` ``iters`` loops, run back to back and synchronized once at
    the end (a host-bound step is timed as it would run in the denoising loop). ``clock`` samples
    the GPU's clock and power from the warm-up's end to the timing's."""
    if loop_steps:
        call = functools.partial(denoising_loop, pipe, inputs, steps=loop_steps, width=width, height=height)
    else:
        call = lambda: pipe.transformer(**inputs)[0]  # noqa: E731
    device = inputs["hidden_states"].device
    timing = time_repeated(call, repeats=iters, warmup=warmup, device=device, each=False, during=clock)
    return timing.warmup_s, timing.mean_s * 1e3 / max(loop_steps, 1), timing.result


def count_flops(transformer, inputs: dict) -> int:
    """FLOPs of one ``transformer(**inputs)`` call, counted by PyTorch's ``FlopCounterMode``."""
    with FlopCounterMode(display=False) as counter:
        transformer(**inputs)
    return counter.get_total_flops()


def write_profile(step, folder: Path, batch: int, transformer, loop_steps: int, device: str) -> None:
    """``step_b<batch>.txt``: the profiler's table of one ``step`` (a loop with ``loop_steps``); on
    CUDA also its Chrome trace (``step_b<batch>.json``) and, for a loop, its timeline cut into the
    loop's steps at the attention kernel (``timeline_b<batch>.txt``, ``bench.timeline``)."""
    on_cuda = torch.device(device).type == "cuda"
    trace = folder / f"step_b{batch}.json" if on_cuda else None
    profile_call(step, folder / f"step_b{batch}.txt", device=device, trace_path=trace)
    if trace is None or loop_steps < 2:
        return
    ops = timeline.gpu_operations(json.loads(trace.read_text()))
    layers = len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks)  # an attention each
    marker = timeline.periodic_name(ops, per_period=layers, periods=loop_steps)
    lines = (
        timeline.summarize(ops, marker=marker, marks_per_period=layers)
        if marker is not None
        else [f"no kernel ran {layers} times in each of the {loop_steps} steps: no timeline"]
    )
    (folder / f"timeline_b{batch}.txt").write_text("\n".join(lines) + "\n")


def run_step_bench(
    model_path: str,
    *,
    width: int,
    height: int,
    batch_sizes: list[int],
    device: str,
    dtype: str,
    compile_blocks: bool,
    attention_backend: str | None = None,
    quantize: str | None = None,
    cuda_graphs: bool = False,
    warmup: int = 3,
    iters: int = 10,
    loop_steps: int = 0,
    profile_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """One row per batch size (see the module doc). ``ValueError`` names a bad argument. With
    ``profile_dir``, one more tilecast step (with ``loop_steps``, loop) per batch size runs under
    the profiler after its timing (``write_profile``)."""
    family = resolve_pipeline(model_path)
    if not issubclass(family, FluxT2IPipeline):
        raise ValueError(
            f"bench step times FLUX's transformer (tiny/flux, random/flux); {model_path!r} is "
            f"served by {family.__name__}"
        )
    for name, values in (("batch size", batch_sizes), ("warm-up", [warmup]), ("iters", [iters])):
        if not values or any(v < 1 for v in values):
            raise ValueError(f"every {name} must be a positive integer, got {values}")
    if loop_steps < 0:
        raise ValueError(f"loop steps must be 0 (one transformer call) or a positive integer, got {loop_steps}")
    for side in (width, height):
        if side % family.size_multiple:
            raise ValueError(f"width and height must be multiples of {family.size_multiple}, got {width}x{height}")
    pipe = family.build_diffusers(model_path, torch.device(device), getattr(torch, dtype))
    pipe.set_progress_bar_config(disable=True)
    timed = functools.partial(
        time_step, pipe, warmup=warmup, iters=iters, loop_steps=loop_steps, width=width, height=height
    )
    clock_reader = gpu_clock.nvml_reader(device)
    with torch.inference_mode():
        inputs = {
            b: step_inputs(pipe, b, width=width, height=height, max_sequence_length=family.max_sequence_length)
            for b in batch_sizes
        }
        rows = []
        for batch in batch_sizes:
            clock = gpu_clock.ClockSampler(clock_reader)
            warmup_s, ms, out = timed(inputs[batch], clock=clock)
            rows.append(
                dict(
                    model=model_path,
                    width=width,
                    height=height,
                    batch=batch,
                    loop_steps=loop_steps,
                    dtype=dtype,
                    tflop=count_flops(pipe.transformer, inputs[batch]) / 1e12,
                    diffusers_ms=ms,
                    diffusers_warmup_s=warmup_s,
                    reference=out,
                    **clock.summary("diffusers_"),
                )
            )
        family.install_fast_paths(
            pipe,
            ServeConfig(
                model_path=model_path,
                device=device,
                dtype=dtype,
                attention_backend=attention_backend,
                compile=compile_blocks,
                quantize=quantize,
                cuda_graphs=cuda_graphs,
            ),
        )
        for row in rows:
            clock = gpu_clock.ClockSampler(clock_reader)
            warmup_s, ms, out = timed(inputs[row["batch"]], clock=clock)
            row.update(clock.summary("tilecast_"))
            if profile_dir is not None:
                step = functools.partial(timed, inputs[row["batch"]], warmup=0, iters=1)
                write_profile(step, Path(profile_dir), row["batch"], pipe.transformer, loop_steps, device)
            reference = row.pop("reference").float()
            row.update(
                tilecast_ms=ms,
                tilecast_warmup_s=warmup_s,
                ratio=ratio(ms, row["diffusers_ms"]),
                diffusers_ms_per_image=row["diffusers_ms"] / row["batch"],
                tilecast_ms_per_image=ms / row["batch"],
                diffusers_tflops=row["tflop"] / row["diffusers_ms"] * 1e3,
                tilecast_tflops=row["tflop"] / ms * 1e3,
                max_rel_diff=max_rel_diff(out, reference),
                psnr_db=psnr_db(out, reference),
            )
    return rows
