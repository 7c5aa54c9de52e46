"""Tensor parallelism for existing ``nn.Linear`` layers (Megatron column/row split), inference only.

Legend: B batch, S sequence, I in features, O out features, T TP group size.

``parallelize_linears(model, plan, group)`` swaps each named ``nn.Linear`` for a sharded subclass
instance holding only this rank's slice of the weights; the model's own classes are not edited.

- ``"colwise"``: weight rows (output features) split: ``(O/T, I)``, bias ``(O/T,)``; input
  replicated, output sharded on the last dim. No communication.
- ``"rowwise"``: weight columns (input features) split: ``(O, I/T)``, bias replicated; input
  sharded on the last dim, output all-reduced (sum) over the TP group, bias added once after.

A column layer followed by a row layer (QKV → out projection, FF in → FF out) needs one
all-reduce per pair. It is one-way: the full weights are dropped; reload the model to undo.
The all-reduce uses ``torch.distributed.all_reduce`` and is not differentiable (inference only).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

ShardStyle = Literal["colwise", "rowwise"]


def _shard(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup, what: str) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if tensor.shape[dim] % size:
        raise ValueError(f"{what}: size {tensor.shape[dim]} on dim {dim} does not divide by the TP group size {size}")
    return tensor.detach().chunk(size, dim=dim)[rank].clone()


def _sharded_like(cls, linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None, group):
    module = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    module.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    if bias is not None:
        module.bias = nn.Parameter(bias, requires_grad=linear.bias.requires_grad)
    module.tp_group = group
    module.train(linear.training)
    return module


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear`` holding output features ``[rank*O/T, (rank+1)*O/T)``; output is sharded."""

    tp_group: dist.ProcessGroup

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup, *, name: str = "linear") -> ColumnParallelLinear:
        weight = _shard(linear.weight, 0, group, f"{name} (colwise) out_features")
        bias = None if linear.bias is None else _shard(linear.bias, 0, group, f"{name} (colwise) bias")
        return _sharded_like(cls, linear, weight, bias, group)


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` holding input features ``[rank*I/T, (rank+1)*I/T)``; output is all-reduced."""

    tp_group: dist.ProcessGroup

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup, *, name: str = "linear") -> RowParallelLinear:
        weight = _shard(linear.weight, 1, group, f"{name} (rowwise) in_features")
        bias = None if linear.bias is None else linear.bias.detach()
        return _sharded_like(cls, linear, weight, bias, group)

    def forward(self, x_BSI: torch.Tensor) -> torch.Tensor:
        y_BSO = F.linear(x_BSI, self.weight)
        dist.all_reduce(y_BSO, group=self.tp_group)
        return y_BSO if self.bias is None else y_BSO + self.bias


_STYLES = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}


def parallelize_linears(model: nn.Module, plan: Mapping[str, ShardStyle], group: dist.ProcessGroup | None) -> list[str]:
    """Shard every ``nn.Linear`` whose qualified name matches a plan pattern; returns their names.

    Patterns are ``fnmatch`` globs over ``model.named_modules()`` names (``*`` matches dots too,
    e.g. ``"blocks.*.attn.to_q"``). A pattern that matches no ``nn.Linear`` raises ``ValueError``
    (a plan written for another model must not pass silently). ``group=None`` or a group of one
    rank leaves the model unchanged.
    """
    for pattern, style in plan.items():
        if style not in _STYLES:
            raise ValueError(f"plan entry {pattern!r}: style {style!r} is not one of {sorted(_STYLES)}")
    if group is None or dist.get_world_size(group) == 1:
        return []
    targets: list[tuple[str, ShardStyle]] = []
    used: set[str] = set()
    for name, module in model.named_modules():
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                if not isinstance(module, nn.Linear) or isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    raise ValueError(
                        f"plan entry {pattern!r} matches {name!r}, a {type(module).__name__}, not a plain nn.Linear"
                    )
                targets.append((name, style))
                used.add(pattern)
                break
    unused = sorted(set(plan) - used)
    if unused:
        raise ValueError(f"TP plan entries match no module of {type(model).__name__}: {unused}")
    for name, style in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, _STYLES[style].from_linear(getattr(parent, child), group, name=name))
    logger.debug("tensor-parallel over %d ranks: %d linears sharded", dist.get_world_size(group), len(targets))
    return [name for name, _ in targets]
