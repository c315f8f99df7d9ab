"""Vision data parallelism under CP: each rank encodes only its share of the images and video frames.

Without it every rank of a CP group runs the vision tower on every image of the micro-batch: P-1
redundant passes, and vision activations that do not shrink with P. Here the patched vision tower
forward, inside a CP forward, splits the work one of two ways, decided from `grid_thw` alone (every rank
decides the same without communicating):

* **by items** (`encode_items`), when they balance: whole images and videos, or the temporal patch groups
  of an item larger than one rank's fair share (the tower attends within each group, so they encode
  independently), assigned longest first to the least loaded rank. Each rank runs the stock tower
  (patch embedding, blocks, merger, deepstack mergers) on its units; one all-gather brings the merged
  features and every deepstack level back into the original order.
* **by patches** (`encode_patch_slices`), when items cannot balance (fewer images than ranks, one image
  larger than a rank's share): the patches of all items are cut into P equal contiguous slices (whole
  merged tokens each) and every vision attention exchanges sequence for heads (the Ulysses exchange of the
  decoder, non-causal, within each image's attention segments), so even a single large image scales
  with P.

Either gather's backward sums the gradient over the group and keeps this rank's block: each rank
back-propagates the complete gradient of its own outputs, and the vision parameters' gradients summed over
the group equal P=1. A rank with no unit still joins every collective: it runs the tower on a
one-merged-token placeholder (the model's dtype; gradient exactly zero) so that data-parallel wrappers
that gather or reduce the tower's weights see the same module calls on every rank.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..collectives import gather_sum_grad
from ..context import CTX_KWARG, CPContext, current_cp_forward
from ..distributed import CPGroup
from ..layout import assign_to_ranks, round_up, segments_from_lengths, split_into_units
from ..settings import SETTINGS
from ..stats import STATS
from .arguments import call_arguments

# Items balance when the busiest rank carries at most this much more than a perfect split.
BALANCED = 1.1


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

    def balanced(self) -> bool:
        loads = self.patches_per_rank()
        return max(loads) * self.size <= BALANCED * sum(loads)

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


def _joined_features(out) -> torch.Tensor:
    """The merged features and every deepstack level side by side: one tensor, one gather."""
    return torch.cat(_features(out), dim=-1)


def _with_features(out, joined: torch.Tensor):
    """`out` with its features replaced by the columns of `joined` (laid out as `_joined_features`)."""
    features = joined.split([f.shape[-1] for f in _features(out)], dim=-1)
    fields = {"pooler_output": features[0]}
    if getattr(out, "deepstack_features", None) is not None:
        fields["deepstack_features"] = list(features[1:])
    return type(out)(**fields)


def encode_items(wrapped, tower, pixels: torch.Tensor, grid: torch.Tensor, share: VisionShare, cp: CPGroup,
                 kwargs: dict):
    """The tower's output for all items, each rank encoding its share of whole items (module docstring)."""
    if share.mine(cp.rank):
        out = wrapped(pixels.index_select(0, share.local_patches(cp.rank, pixels.device)),
                      grid_thw=share.local_grid(cp.rank, grid.device), **kwargs)
        local = _joined_features(out)
    else:
        # The placeholder's rows are sliced away; the empty slice keeps its backward (and the gather's
        # all-reduce) running on this rank, with a zero gradient.
        out = wrapped(*placeholder_vision_inputs(tower.config, pixels.device, pixels.dtype), **kwargs)
        local = _joined_features(out)[:0]
    full = gather_sum_grad(local, 0, share.merged_per_rank(), cp.group, cp.rank)
    full = full.index_select(0, share.gathered_to_original(full.device))
    STATS.record_vision(share.patches_per_rank(), cp.rank)
    return _with_features(out, full)


def _patch_tables(tower, grid: torch.Tensor, padded: int) -> dict:
    """What the tower computes from `grid_thw` for every patch (position-embedding interpolation, rotary
    positions), for all patches padded to `padded` rows: the tower takes them precomputed."""
    vision_utils = sys.modules[type(tower).__module__]
    indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
        align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size,
    )
    positions = vision_utils.get_vision_position_ids(grid, tower.spatial_merge_size)
    extra = padded - indices.shape[0]
    pad = lambda t: torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t  # noqa: E731
    return {"interp_indices": pad(indices), "interp_weights": pad(weights), "position_ids": pad(positions)}


def encode_patch_slices(wrapped, tower, pixels: torch.Tensor, grid: torch.Tensor, cp: CPGroup, kwargs: dict):
    """The tower's output for all items, each rank encoding one contiguous slice of all their patches, its
    attention exchanging sequence for heads within each image's segments (module docstring)."""
    unit = tower.spatial_merge_size**2
    frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).tolist()
    merged = sum(frames) // unit
    padded = round_up(merged, cp.size) * unit  # whole merged tokens on every rank
    lengths = frames + ([padded - sum(frames)] if padded > sum(frames) else [])
    vision_ctx = CPContext(cp=cp, segments=segments_from_lengths(lengths))  # attention within each segment
    rows = vision_ctx.local_slice
    tables = {k: v[rows] for k, v in _patch_tables(tower, grid, padded).items()}
    # A copy of this rank's rows: a view would keep the whole padded pixel tensor alive until backward.
    local_pixels = torch.cat([pixels, pixels.new_zeros(padded - pixels.shape[0], pixels.shape[1])])[rows].clone()
    local_len = vision_ctx.local_len
    cu = torch.tensor([0, local_len], dtype=torch.int32, device=pixels.device)  # one local segment: the
    out = wrapped(local_pixels, grid_thw=grid, cu_seqlens=cu, max_seqlen=local_len,  # exchange restores the
                  **tables, **kwargs, **{CTX_KWARG: vision_ctx})  # global ones
    local = _joined_features(out)
    full = gather_sum_grad(local, 0, [local.shape[0]] * cp.size, cp.group, cp.rank).narrow(0, 0, merged)
    STATS.record_vision([min(local_len, max(0, sum(frames) - r * local_len)) for r in range(cp.size)], cp.rank)
    return _with_features(out, full)


def cp_vision_forward(wrapped, instance, args, kwargs):
    """The vision tower's forward: inside a CP forward with vision data parallelism on, each rank encodes its
    share (by items when they balance, else by patch slices); otherwise the stock forward."""
    ctx = current_cp_forward()
    if ctx is None or ctx.cp.size == 1 or not SETTINGS.vision_dp:
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    pixels, grid = call.pop("hidden_states"), call.pop("grid_thw")
    share = VisionShare.of(grid.tolist(), instance.spatial_merge_size, ctx.cp.size)
    if share.balanced() or instance.config.num_heads % ctx.cp.size:  # patch slices split the tower's heads
        return encode_items(wrapped, instance, pixels, grid, share, ctx.cp, call)
    return encode_patch_slices(wrapped, instance, pixels, grid, ctx.cp, call)
