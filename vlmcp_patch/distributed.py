"""CP process groups: blocks of `P` consecutive ranks, created lazily once torch.distributed is up."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .errors import UnsupportedSetupError
from .settings import SETTINGS

_GROUPS: dict[tuple[int, int], object] = {}


@dataclass(frozen=True)
class CPGroup:
    """The CP group of this rank: `size` ranks, this one at position `rank`."""

    group: object
    rank: int
    size: int


# A packed row at P=1 takes the CP path with this one-rank "group": the same boundaries, no exchanges.
SINGLE_RANK = CPGroup(group=None, rank=0, size=1)


def _check_world(size: int) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise UnsupportedSetupError(
            f"VLMCP_CP_SIZE={size} needs torch.distributed: launch with torchrun / accelerate / deepspeed "
            "(or call torch.distributed.init_process_group) before the first forward, or set VLMCP_CP_SIZE=1."
        )
    world = dist.get_world_size()
    if world % size:
        raise UnsupportedSetupError(
            f"CP size {size} does not divide the world size {world}: launch a multiple of {size} processes "
            f"or choose a CP size among the divisors of {world}."
        )
    return world


def _group_for(size: int):
    world = _check_world(size)
    key = (world, size)
    if key not in _GROUPS:
        # A group of its own even when it spans the world, so the exchanges never interleave with the
        # gradient all-reduces DDP / DeepSpeed issue on the default group. new_group is collective over
        # the whole world: every rank creates every block, in order.
        mine = None
        for start in range(0, world, size):
            group = dist.new_group(ranks=list(range(start, start + size)))
            if start <= dist.get_rank() < start + size:
                mine = group
        _GROUPS[key] = mine
    return _GROUPS[key]


def get_cp_group(size: int | None = None) -> CPGroup | None:
    """This rank's CP group for `size` (default: the configured CP size); None when CP is off."""
    size = SETTINGS.cp_size if size is None else size
    if size == 1:
        return None
    group = _group_for(size)
    return CPGroup(group=group, rank=dist.get_rank() % size, size=size)


_WORLD_GROUP: dict[int, object] = {}


def world_group():
    """A group of all ranks, separate from the default one (DeepSpeed's sequence-data-parallel group)."""
    world = dist.get_world_size()
    if world not in _WORLD_GROUP:
        _WORLD_GROUP[world] = dist.new_group(ranks=list(range(world)))
    return _WORLD_GROUP[world]


def data_parallel_world_size() -> int:
    """Number of data-parallel replicas: world size / CP size (1 without torch.distributed)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    if SETTINGS.cp_size == 1:
        return dist.get_world_size()
    return _check_world(SETTINGS.cp_size) // SETTINGS.cp_size


def data_parallel_rank() -> int:
    """Index of this rank's CP group among the data-parallel replicas (ranks of one group share it)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    if SETTINGS.cp_size > 1:
        _check_world(SETTINGS.cp_size)
    return dist.get_rank() // SETTINGS.cp_size
