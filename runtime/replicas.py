"""Data-parallel replica groups of ``tilecast serve``: which ranks serve a batch together.

The mesh (``runtime/topology.py``) lays the ranks out as ``dp x ring x ulysses x tp``; each DP
replica is a contiguous block of ``TP x Ulysses x Ring`` ranks holding a full copy of the model.
When serving, each replica is a **serving group**: rank 0's scheduler hands different batches to
different groups at the same time, a group's plan goes only to that group's ranks, and every
collective of a plan (the plan broadcast, the cancel points, the pipeline's own) stays on the
group's process groups. The first rank of a group is its leader and output rank.

- ``--dp-degree D`` gives the groups explicitly (``D x TP x Ulysses x Ring`` must equal the GPU count).
- Unset, the replicas are derived, ``num_gpus // (TP x Ulysses x Ring)``; with ``--tile-parallel``
  the derived units instead share each request (K6 SR deals one request's tile chunks to them),
  so all ranks form one group, as before.

To a pipeline a serving group is the whole run: its ``RankContext`` (``replica_context``) has
the group-local rank and size and the group's CPU and device groups, so a pipeline written for one
set of ranks (K6 SR's replicated or parallel decode, FSDP, the families) runs unchanged in each
group. The mesh's ``groups`` (Ulysses, Ring, TP, decode) already lie inside one replica.

``tilecast generate`` runs one request on all ranks and uses none of this.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tilecast.runtime.topology import degrees_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaLayout:
    """The serving groups of a run, as global rank lists (pure arithmetic, no process group)."""

    groups: tuple[tuple[int, ...], ...]
    """Global ranks of each group, in group order; group 0 holds rank 0."""

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_size(self) -> int:
        return len(self.groups[0])

    def group_of(self, rank: int) -> int:
        for index, members in enumerate(self.groups):
            if rank in members:
                return index
        raise ValueError(f"rank {rank} is in no replica group of {self.groups}")

    def describe(self) -> str:
        """``2 replica groups of 1 rank: [0] [1]``."""
        size = self.group_size
        groups = " ".join(f"[{','.join(map(str, g))}]" for g in self.groups)
        return f"{self.num_groups} replica group(s) of {size} rank{'s' if size > 1 else ''}: {groups}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingShape:
    """What a run's serving groups are cut from: the world size, the parallel degrees (as ``Topology``
    names them) and the two settings that change the cut. ``errors`` is what serving in groups
    cannot honour (the layout rules themselves are ``Topology.check``'s); ``layout`` the groups."""

    num_gpus: int
    tp_size: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    dp_degree: int | None = None
    """``--dp-degree``; None: derived (see the module doc)."""
    tile_parallel: bool = False
    """``--tile-parallel``: derived data-parallel units share each request, in one group."""
    fsdp: bool = False
    """``--use-fsdp-inference``: the DiT is sharded across the ranks of one group."""

    @classmethod
    def of(cls, config, world_size: int) -> ServingShape:
        """The shape of a ``ServeConfig`` on ``world_size`` ranks (``tilecast serve``'s)."""
        return cls(
            num_gpus=world_size,
            **degrees_of(config),
            tile_parallel=config.tile_parallel,
            fsdp=bool(config.use_fsdp_inference),
        )

    @property
    def model_parallel(self) -> int:
        """Ranks holding one copy of the model: TP x Ulysses x Ring."""
        return self.tp_size * self.ulysses_degree * self.ring_degree

    def errors(self) -> list[str]:
        """What serving in replica groups cannot honour (the layout rules themselves are ``Topology.check``'s)."""
        errors: list[str] = []
        if self.dp_degree is not None and self.dp_degree > 1 and self.tile_parallel:
            errors.append(
                f"--tile-parallel deals one request's tile chunks to the data-parallel units, but --dp-degree "
                f"{self.dp_degree} makes each unit a replica group serving requests of its own: leave --dp-degree "
                "unset (all ranks share each request) or drop --tile-parallel."
            )
        one_rank_groups = self.model_parallel == 1 and not (self.tile_parallel and self.dp_degree is None)
        if self.fsdp and self.num_gpus > 1 and one_rank_groups:
            errors.append(
                f"--use-fsdp-inference true shards the DiT across the ranks of one replica group, but "
                f"num_gpus={self.num_gpus} with TP x Ulysses x Ring = 1 makes {self.num_gpus} groups of 1 rank: "
                "give the replica more ranks (--tp-size/--ulysses-degree/--ring-degree) or drop FSDP."
            )
        return errors

    def layout(self) -> ReplicaLayout:
        """The serving groups for a valid shape (see the module doc); ``ValueError`` naming every
        problem otherwise (``errors``, and a layout the degrees do not fill)."""
        errors = self.errors()
        num_gpus, dp_degree, model_parallel = self.num_gpus, self.dp_degree, self.model_parallel
        if num_gpus % model_parallel or (dp_degree is not None and dp_degree * model_parallel != num_gpus):
            errors.append(
                f"num_gpus={num_gpus} is not DP {dp_degree or '(derived)'} x TP {self.tp_size} x Ulysses "
                f"{self.ulysses_degree} x Ring {self.ring_degree}."
            )
        if errors:
            raise ValueError(" ".join(errors))
        num_groups = dp_degree if dp_degree is not None else (1 if self.tile_parallel else num_gpus // model_parallel)
        size = num_gpus // num_groups
        return ReplicaLayout(groups=tuple(tuple(range(g * size, (g + 1) * size)) for g in range(num_groups)))


def layout_of(config, world_size: int) -> ReplicaLayout:
    """The serving groups of a ``ServeConfig`` on ``world_size`` ranks (``tilecast serve``'s groups)."""
    return ServingShape.of(config, world_size).layout()


@dataclasses.dataclass(kw_only=True)
class Replica:
    """This rank's serving group and its process groups."""

    index: int
    """The group's number (0 holds rank 0, the scheduler)."""
    ranks: tuple[int, ...]
    """Global ranks of the group; the first is its leader (plan source, output rank)."""
    rank: int
    """This process's global rank."""
    num_groups: int
    """Serving groups in the run."""
    cpu_group: Any = None
    """gloo group over ``ranks`` (plans, cancel flags, outcome agreement); None for one rank."""
    device_group: Any = None
    """Group over ``ranks`` for device tensors (NCCL on CUDA, the gloo group on CPU); None for one rank."""

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.ranks[0]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def local_rank(self) -> int:
        return self.ranks.index(self.rank)


def build_replica(layout: ReplicaLayout, ranks, parallel_groups=None) -> Replica:
    """This rank's ``Replica`` (collective: on CUDA every rank creates every group's gloo group, in order).

    One group: the run's own world groups. Several: the mesh's ``decode`` group (all ranks of one DP
    replica) carries device tensors; on CPU it is gloo and carries the plans too, on CUDA a gloo
    group per replica is created for them.
    """
    index = layout.group_of(ranks.rank)
    members = layout.groups[index]
    if layout.num_groups == 1:
        return Replica(
            index=0,
            ranks=members,
            rank=ranks.rank,
            num_groups=1,
            cpu_group=ranks.cpu_group,
            device_group=ranks.device_group,
        )
    if len(members) == 1:
        return Replica(index=index, ranks=members, rank=ranks.rank, num_groups=layout.num_groups)
    import torch.distributed as dist

    assert parallel_groups is not None, "several ranks per replica need the mesh's groups"
    device_group = parallel_groups.decode_group
    assert dist.get_process_group_ranks(device_group) == list(members), (members, device_group)
    cpu_group = device_group
    if ranks.device.type != "cpu":
        for g, group_ranks in enumerate(layout.groups):  # every rank creates every group, same order
            created = dist.new_group(ranks=list(group_ranks), backend="gloo")
            if g == index:
                cpu_group = created
    return Replica(
        index=index,
        ranks=members,
        rank=ranks.rank,
        num_groups=layout.num_groups,
        cpu_group=cpu_group,
        device_group=device_group,
    )


def replica_context(ctx, replica: Replica):
    """``ctx`` as the pipeline of one serving group sees it: the group is its whole run."""
    if replica.num_groups == 1:
        return ctx
    return dataclasses.replace(
        ctx,
        rank=replica.local_rank,
        world_size=replica.size,
        cpu_group=replica.cpu_group,
        device_group=replica.device_group,
    )
