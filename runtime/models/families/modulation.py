"""Every modulation layer of a DiT step as one matrix-vector product (``ModulationBank``).

In FLUX each block projects the same conditioning vector, ``silu(temb)`` (``temb`` from the
transformer's ``time_text_embed``), into its shifts, scales and gates: at FLUX.1-dev's size 77
linear layers of 3,072 inputs (each joint block's image and text ``norm1``, each single block's
``norm``, the final ``norm_out``), 6.5 GB of bf16 weights read per step for one row per image.
Each is a short memory-bound kernel (25-43 µs on an H100) with its own SiLU kernel before it: 150
launches a step for 6% of its time. ``ModulationBank`` stacks their weights into one matrix and,
right after ``time_text_embed`` returns, computes one SiLU and one ``F.linear`` for all of them;
each layer, now a ``BankedLinear``, returns its columns of that product instead of computing its
own. Same weights, same bias, same sums per output (one dot product of the same length); only the
GEMV kernel and its summation order may differ, within the dtype's rounding.

The bank assumes what holds in these transformers: a banked layer's input is this forward's
``temb`` (or its SiLU: FLUX's norms, whose own SiLU ``bank_modulation`` makes the identity, pass
``temb`` itself), and it is called only inside the transformer's forward, after
``time_text_embed``. A ``BankedLinear`` called before that (or after the forward, when the values
are cleared) raises instead of returning stale values; one called with a batch other than the
bank's raises naming both. The stacked weights replace the layers' own (the model's memory does
not grow; the ``state_dict`` keys change: nothing reloads weights into a served model).

Under ``torch.compile`` a ``BankedLinear``'s value is a tensor attribute, so the compiled blocks
take it as a graph input (one compiled block serves every block); under CUDA graphs the product is
part of the captured forward.

A denoising loop knows every step's ``temb`` before its first step (the timesteps are the
scheduler's; the guidance and the pooled text embedding do not change between steps), yet each
step's product reads all the weights again for one row per image: at FLUX.1-dev's size 2.2 ms of a
39 ms step on an H100. ``plan(temb_SBK)`` computes every step's products at once, one read of the
weights for the loop, and ``stage(step)`` copies a step's row into a buffer that the next forward
reads instead of computing (``staged``). A buffer per batch size stays allocated for the life of
the bank, so a CUDA graph captured reading it stays valid; a graph captured computing the product
and one reading the buffer are two graphs (``cuda_graphs.install``'s ``key``). Who knows the
loop's steps plans and stages (``flux_plan.ModulationPlanner`` for FLUX's pipeline).

Shapes: ``temb_BK`` (batch, conditioning features); ``weight_NK`` as ``nn.Linear`` stores it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BankedLinear(nn.Module):
    """A linear layer whose output a ``ModulationBank`` has computed; ``forward`` returns it."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.value: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.value is None:
            raise RuntimeError(
                "a banked modulation layer ran outside its transformer's forward: its output is computed "
                "once per forward by the ModulationBank, after time_text_embed"
            )
        if x.shape[:-1] != self.value.shape[:-1]:
            raise ValueError(
                f"a banked modulation layer got input rows {tuple(x.shape[:-1])}; the bank computed "
                f"{tuple(self.value.shape[:-1])} from this forward's temb"
            )
        return self.value

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, banked"


class ModulationBank(nn.Module):
    """The stacked weights of ``layers`` (``(parent, attribute name)`` of plain ``nn.Linear`` layers
    with the same input size, dtype and device, all with a bias); each layer is replaced in its
    parent by a ``BankedLinear`` as its weights are copied. ``compute(temb)`` fills them all."""

    def __init__(self, layers: list[tuple[nn.Module, str]]) -> None:
        super().__init__()
        self.sizes = _check([getattr(parent, name) for parent, name in layers])
        weight = getattr(*layers[0]).weight
        kw = dict(dtype=weight.dtype, device=weight.device)
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), weight.shape[1], **kw), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(self.sizes), **kw), requires_grad=False)
        del weight  # keep no layer's weight alive past its replacement
        self.banked: list[BankedLinear] = []
        self.plan_SBN: torch.Tensor | None = None
        self.staged_batch: int | None = None  # the batch of the row stage() copied for the next forward
        self._staged_BN: dict[int, torch.Tensor] = {}
        start = 0
        with torch.no_grad():
            for (parent, name), size in zip(layers, self.sizes):
                linear = getattr(parent, name)
                self.weight[start : start + size].copy_(linear.weight)
                self.bias[start : start + size].copy_(linear.bias)
                banked = BankedLinear(linear.in_features, size)
                setattr(parent, name, banked)  # the layer's own weights go with it: memory does not grow
                self.banked.append(banked)
                start += size

    @property
    def staged(self) -> bool:
        """Whether the next forward reads a staged row (``stage``) instead of computing its product."""
        return self.staged_batch is not None

    def product(self, temb: torch.Tensor) -> torch.Tensor:
        """``linear(silu(temb))`` of every banked layer at once (any leading dims)."""
        return F.linear(F.silu(temb).to(self.weight.dtype), self.weight, self.bias)

    def compute(self, temb_BK: torch.Tensor) -> None:
        """Every banked layer's output for this forward: the product, or the staged step's row."""
        if self.staged_batch is not None:
            if temb_BK.shape[0] != self.staged_batch:
                raise ValueError(
                    f"a forward of batch {temb_BK.shape[0]} found a modulation row staged for batch {self.staged_batch}"
                )
            out_BN = self._staged_BN[self.staged_batch]
        else:
            out_BN = self.product(temb_BK)
        for banked, value in zip(self.banked, out_BN.split(self.sizes, dim=-1)):
            banked.value = value

    def plan(self, temb_SBK: torch.Tensor) -> None:
        """Every step's products of a loop, from each step's ``temb`` (steps, batch, features)."""
        self.plan_SBN = self.product(temb_SBK)

    def stage(self, step: int) -> None:
        """The next forward reads ``step``'s planned row instead of computing its product."""
        if self.plan_SBN is None or not 0 <= step < self.plan_SBN.shape[0]:
            planned = 0 if self.plan_SBN is None else self.plan_SBN.shape[0]
            raise IndexError(f"step {step} of a plan of {planned} steps")
        row_BN = self.plan_SBN[step]
        buffer_BN = self._staged_BN.get(row_BN.shape[0])
        if buffer_BN is None:
            buffer_BN = self._staged_BN[row_BN.shape[0]] = torch.empty_like(row_BN)
        buffer_BN.copy_(row_BN)
        self.staged_batch = row_BN.shape[0]

    def clear(self) -> None:
        """Forget this forward's outputs (a banked layer called now raises) and its staged row."""
        for banked in self.banked:
            banked.value = None
        self.staged_batch = None

    def extra_repr(self) -> str:
        return f"layers={len(self.sizes)}, out_features={sum(self.sizes)}, in_features={self.weight.shape[1]}"


def _check(linears: list[nn.Module]) -> list[int]:
    """The output sizes of ``linears``; ``ValueError`` naming a layer that cannot be banked with the rest."""
    if not linears:
        raise ValueError("a ModulationBank needs at least one layer")
    first = linears[0]
    for linear in linears:
        if type(linear) is not nn.Linear or linear.bias is None:
            raise ValueError(f"only plain nn.Linear layers with a bias can be banked, got {linear}")
        if (linear.in_features, linear.weight.dtype, linear.weight.device) != (
            first.in_features,
            first.weight.dtype,
            first.weight.device,
        ):
            raise ValueError(
                f"banked layers must share input size, dtype and device: {linear} "
                f"({linear.weight.dtype}, {linear.weight.device}) against {first} "
                f"({first.weight.dtype}, {first.weight.device})"
            )
    return [linear.out_features for linear in linears]


def install(transformer: nn.Module, layers: list[tuple[nn.Module, str]], *, source: nn.Module) -> ModulationBank:
    """Bank ``layers`` on ``transformer`` (as its ``modulation_bank``): filled from ``source``'s
    output (the conditioning ``temb``) each time ``source`` runs, cleared when the transformer's
    forward returns."""
    bank = ModulationBank(layers)
    transformer.modulation_bank = bank
    source.register_forward_hook(lambda module, args, temb: bank.compute(temb))
    transformer.register_forward_hook(lambda module, args, out: bank.clear())
    return bank
