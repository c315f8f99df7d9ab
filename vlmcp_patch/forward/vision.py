"""Vision data parallelism under CP: each rank encodes only its share of the images and video frames.

Without it every rank of a CP group runs the vision tower on every image of the micro-batch: P-1
redundant passes, and vision activations that do not shrink with P. Here the patched vision tower
forward, inside a CP forward:

1. splits the items of `grid_thw` into units — whole images and videos, or the temporal patch groups of
   an item larger than one rank's fair share (the tower attends within each group, so they encode
   independently) — and assigns them to the ranks, longest first to the least loaded, from `grid_thw`
   alone: every rank computes the same assignment without communicating;
2. runs the stock tower (patch embedding, blocks, merger, deepstack mergers) on this rank's units only;
3. all-gathers the merged features (and every deepstack level, in the same collective) and puts them
   back into the original order. The gather's backward sums the gradient over the group and keeps this
   rank's block, so each rank back-propagates the complete gradient of its own units' outputs: the vision
   parameters' gradients summed over the group equal P=1.

A rank with no unit (fewer units than ranks) still joins every collective: it runs the tower on a
one-merged-token placeholder (the model's dtype; gradient exactly zero) so that data-parallel wrappers
that gather or reduce the tower's weights see the same module calls on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..collectives import gather_sum_grad
from ..context import current_cp_forward
from ..distributed import CPGroup
from ..layout import assign_to_ranks, split_into_units
from ..settings import SETTINGS
from ..stats import STATS
from .arguments import call_arguments


def placeholder_vision_inputs(vision_config, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Patches and grid of the smallest input a vision tower takes: one merged token of zeros."""
    merge = vision_config.spatial_merge_size
    width = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    pixels = torch.zeros(merge * merge, width, device=device, dtype=dtype)
    return pixels, torch.tensor([[1, merge, merge]], device=device)


@dataclass(frozen=True)
class VisionShare:
    """The vision units of one forward and the rank each is encoded on."""

    units: list[tuple[int, int, int, int, int]]  # (first patch, patches, frames, height, width), in order
    ranks: list[int]
    merge_unit: int  # patches per merged token
    size: int

    @classmethod
    def of(cls, grid: list[list[int]], merge: int, size: int) -> VisionShare:
        costs = [t * h * w for t, h, w in grid]
        offsets = [sum(costs[:i]) for i in range(len(costs))]
        units = []
        for item, first, frames in split_into_units(costs, [t for t, _, _ in grid], size):
            _, h, w = grid[item]
            units.append((offsets[item] + first * h * w, frames * h * w, frames, h, w))
        return cls(units, assign_to_ranks([u[1] for u in units], size), merge * merge, size)

    def mine(self, rank: int) -> list[int]:
        return [i for i, r in enumerate(self.ranks) if r == rank]

    def patches_per_rank(self) -> list[int]:
        loads = [0] * self.size
        for (_, patches, *_), rank in zip(self.units, self.ranks):
            loads[rank] += patches
        return loads

    def merged_per_rank(self) -> list[int]:
        return [n // self.merge_unit for n in self.patches_per_rank()]

    def local_patches(self, rank: int, device) -> torch.Tensor:
        spans = [torch.arange(self.units[i][0], self.units[i][0] + self.units[i][1]) for i in self.mine(rank)]
        return torch.cat(spans).to(device)

    def local_grid(self, rank: int, device) -> torch.Tensor:
        return torch.tensor([self.units[i][2:] for i in self.mine(rank)], device=device)

    def gathered_to_original(self, device) -> torch.Tensor:
        """Index into the gathered rows (blocks in rank order) of each merged token in the original order."""
        starts, position = {}, 0
        for rank in range(self.size):
            for i in self.mine(rank):
                starts[i] = position
                position += self.units[i][1] // self.merge_unit
        order = [torch.arange(starts[i], starts[i] + u[1] // self.merge_unit) for i, u in enumerate(self.units)]
        return torch.cat(order).to(device)


def _features(out) -> list[torch.Tensor]:
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


def _with_features(out, features: list[torch.Tensor]):
    fields = {"pooler_output": features[0]}
    if getattr(out, "deepstack_features", None) is not None:
        fields["deepstack_features"] = list(features[1:])
    return type(out)(**fields)


def encode_share(wrapped, tower, pixels: torch.Tensor, grid: torch.Tensor, cp: CPGroup, kwargs: dict):
    """The tower's output for all items, each rank encoding only its share (see the module docstring)."""
    share = VisionShare.of(grid.tolist(), tower.spatial_merge_size, cp.size)
    if share.mine(cp.rank):
        out = wrapped(pixels.index_select(0, share.local_patches(cp.rank, pixels.device)),
                      grid_thw=share.local_grid(cp.rank, grid.device), **kwargs)
        local = torch.cat(_features(out), dim=-1)
    else:
        # The placeholder's rows are sliced away; the empty slice keeps its backward (and the gather's
        # all-reduce) running on this rank, with a zero gradient.
        out = wrapped(*placeholder_vision_inputs(tower.config, pixels.device, pixels.dtype), **kwargs)
        local = torch.cat(_features(out), dim=-1)[:0]
    full = gather_sum_grad(local, 0, share.merged_per_rank(), cp.group, cp.rank)
    full = full.index_select(0, share.gathered_to_original(full.device))
    widths = [f.shape[-1] for f in _features(out)]
    STATS.record_vision(share.patches_per_rank(), cp.rank)
    return _with_features(out, list(full.split(widths, dim=-1)))


def cp_vision_forward(wrapped, instance, args, kwargs):
    """The vision tower's forward: inside a CP forward with vision data parallelism on, each rank encodes its
    share of the items; otherwise the stock forward."""
    ctx = current_cp_forward()
    if ctx is None or ctx.cp.size == 1 or not SETTINGS.vision_dp:
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    pixels, grid = call.pop("hidden_states"), call.pop("grid_thw")
    return encode_share(wrapped, instance, pixels, grid, ctx.cp, call)
