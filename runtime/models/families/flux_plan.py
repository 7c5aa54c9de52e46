"""FLUX's modulation planned for a whole denoising loop (``ModulationPlanner``).

``FluxPipeline`` calls its transformer once per step with the same ``guidance`` and
``pooled_projections`` tensors and ``timestep = t.expand(batch).to(latents.dtype) / 1000`` for
each ``t`` of its scheduler's ``timesteps``, after ``set_timesteps`` (which leaves the
scheduler's ``step_index`` at ``None``) and ``set_begin_index(0)``; each ``scheduler.step`` then
advances ``step_index``, so before step ``i``'s transformer call it reads ``i`` (``None`` for the
first). Every step's conditioning is therefore known at the first call, and the banked
modulation (``families.modulation``) of all steps can be one product: one read of its 6.5 GB of
weights at FLUX.1-dev's size for the loop instead of one per step.

The planner is a forward pre-hook on the transformer. At a loop's first call (step index
``None``, begin index 0) it computes every step's ``temb`` with the transformer's own
``time_text_embed`` (as the forward would: the timesteps and guidance in the model's dtype, times
1000) and has the bank ``plan`` them, after one check that the pipeline's argument for the first
step is the one it derived (a host synchronisation once per loop). Before each call of that loop
it ``stage``s the step's row, as long as the call is the loop's: the same ``pooled_projections``
and ``guidance`` objects, the same ``timesteps`` object, the same batch, a step inside the plan.
Any other call (another pipeline, a direct call, a second transformer call per step as true CFG
makes, with other pooled embeddings) computes its product as before. A plan larger than
``PLAN_MAX_BYTES`` is not made; a plan is dropped once its last step is staged.

A step's row equals the product that step computes up to the rounding of one product with more
rows (``tests/test_flux_plan.py``). In a staged forward every consumer of ``temb`` is a banked layer
that reads the staged row, so ``time_text_embed`` is not run there (about twenty kernels a step): it
returns a placeholder of ``temb``'s shape that nothing reads.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tilecast.runtime.models.families.modulation import ModulationBank

logger = logging.getLogger(__name__)

PLAN_MAX_BYTES = 1 << 30
"""The largest plan (steps x batch x banked outputs) kept; FLUX.1-dev's 28 steps at batch 1 are 59 MB."""


class ModulationPlanner:
    """The forward pre-hook that plans and stages ``bank`` for ``scheduler``'s loops; see the module doc."""

    def __init__(self, transformer: torch.nn.Module, scheduler: Any, bank: ModulationBank) -> None:
        self.transformer, self.scheduler, self.bank = transformer, scheduler, bank
        self.loop: tuple | None = None  # (timesteps, pooled, guidance, batch) of the planned loop
        self.warned = False
        self.embed = transformer.time_text_embed.forward  # the module's own (install() replaces it)

    def embed_unless_staged(self, timestep: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        """``time_text_embed``'s forward, except in a staged forward (see the module doc): there a
        placeholder of ``temb``'s shape and dtype (the pooled embedding's, the last argument)."""
        if self.bank.staged:
            return rest[-1].new_empty(timestep.shape[0], self.bank.weight.shape[1])
        return self.embed(timestep, *rest)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        step = self.scheduler.step_index
        if step is None:
            self.loop = self.bank.plan_SBN = None
            if self.scheduler.begin_index == 0:  # FluxPipeline sets it right before its loop
                self._plan(args, kwargs)
            step = 0
        if self.loop is not None and self._in_loop(kwargs) and step < self.bank.plan_SBN.shape[0]:
            self.bank.stage(step)
            if step == self.bank.plan_SBN.shape[0] - 1:  # the loop's last: its memory goes now
                self.loop = self.bank.plan_SBN = None

    def _in_loop(self, kwargs: dict) -> bool:
        timesteps, pooled, guidance, batch = self.loop
        return (
            self.scheduler.timesteps is timesteps
            and kwargs.get("pooled_projections") is pooled
            and kwargs.get("guidance") is guidance
            and getattr(kwargs.get("hidden_states"), "shape", (None,))[0] == batch
        )

    def _plan(self, args: tuple, kwargs: dict) -> None:
        timesteps = self.scheduler.timesteps
        hidden, timestep, pooled = (kwargs.get(name) for name in ("hidden_states", "timestep", "pooled_projections"))
        if args or timesteps is None or hidden is None or timestep is None or pooled is None:
            return  # not a pipeline's call
        steps, batch = len(timesteps), hidden.shape[0]
        if steps * batch * self.bank.weight.shape[0] * self.bank.weight.element_size() > PLAN_MAX_BYTES:
            return
        t_SB = timesteps[:, None].expand(steps, batch).to(hidden.dtype) / 1000  # the pipeline's argument
        if not torch.equal(t_SB[0], timestep):
            if not self.warned:
                logger.warning(
                    "the FLUX pipeline's first timestep is not the one derived from its scheduler; "
                    "its modulation is computed per step (no plan)"
                )
                self.warned = True
            return
        dtype = self.transformer.x_embedder.weight.dtype  # the forward's: its embedded tokens'
        embed = self.embed  # not __call__: the bank's hook would run on it
        t_N = t_SB.to(dtype).flatten() * 1000
        pooled_NP = pooled.repeat(steps, 1)
        guidance = kwargs.get("guidance")
        if guidance is None:
            temb_NK = embed(t_N, pooled_NP)
        else:
            temb_NK = embed(t_N, (guidance.to(dtype) * 1000).repeat(steps), pooled_NP)
        self.bank.plan(temb_NK.unflatten(0, (steps, batch)))
        self.loop = (timesteps, pooled, guidance, batch)


def install(transformer: torch.nn.Module, scheduler: Any) -> ModulationPlanner | None:
    """Plan ``transformer``'s banked modulation for ``scheduler``'s loops (None: nothing is banked,
    or the scheduler keeps no ``step_index``)."""
    bank = getattr(transformer, "modulation_bank", None)
    if bank is None or not hasattr(scheduler, "step_index"):
        return None
    planner = ModulationPlanner(transformer, scheduler, bank)
    transformer.register_forward_pre_hook(planner, with_kwargs=True)
    transformer.time_text_embed.forward = planner.embed_unless_staged
    return planner
