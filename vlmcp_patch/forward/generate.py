"""`generate()` under CP: each rank decodes alone, exactly as at P=1 — or, in a split rollout of TRL's RL
trainers (`split_rollouts`), each rank decodes its share of the rows and the group gathers them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives.communication import communicate
from ..distributed import cp_requested, disabled, get_cp_group
from ..flags import GENERATING, SPLIT_ROLLOUT, scoped
from ..patching import Patch
from .arguments import call_arguments, pixels_on_device

# Inputs with one entry per row (batch dimension first) that a split rollout divides by rows.
ROW_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "position_ids")


def _items_per_row(grid: torch.Tensor, tokens_per_row: list[int], merge: int) -> list[int]:
    """How many of the grid's items (images or videos, in row order) each row holds, from its placeholder tokens."""
    per_item = (grid.prod(-1) // merge).tolist()
    counts, item = [], 0
    for tokens in tokens_per_row:
        start = item
        while tokens > 0:
            tokens -= per_item[item]
            item += 1
        counts.append(item - start)
    return counts


def _vision_rows(model, call: dict, rows: slice) -> dict:
    """The images and videos of the prompt rows `rows`: their grid entries and pixel rows."""
    out, config = {}, model.config
    merge = config.vision_config.spatial_merge_size**2
    for pixels_key, grid_key, token in (("pixel_values", "image_grid_thw", config.image_token_id),
                                        ("pixel_values_videos", "video_grid_thw", config.video_token_id)):
        grid = call.get(grid_key)
        if grid is None:
            continue
        counts = _items_per_row(grid, (call["input_ids"] == token).sum(-1).tolist(), merge)
        first, last = sum(counts[: rows.start]), sum(counts[: rows.stop])
        patches = [0, *grid.prod(-1).cumsum(0).tolist()]
        out[grid_key] = grid[first:last]
        out[pixels_key] = call[pixels_key][patches[first] : patches[last]]
    return out


def _rows_of(rank: int, size: int, batch: int) -> tuple[slice, bool]:
    """This rank's prompt rows, and whether it keeps them. A rank left without rows (fewer rows than ranks)
    decodes the last row and drops it: every rank calls generate once (its vision encoding may gather weights)."""
    share = -(-batch // size)
    rows = slice(min(rank * share, batch), min((rank + 1) * share, batch))
    return (rows, True) if rows.start < rows.stop else (slice(batch - 1, batch), False)


def _share_of_rows(model, call: dict, rows: slice) -> dict:
    mine = {k: v for k, v in call.items() if k not in ROW_INPUTS and "pixel" not in k and "grid" not in k}
    mine.update({k: call[k][rows] for k in ROW_INPUTS if torch.is_tensor(call.get(k))})
    if hasattr(model.config, "vision_config"):
        mine.update(_vision_rows(model, call, rows))
    return mine


def _gathered_rows(sequences: torch.Tensor, pad_token_id: int, group) -> torch.Tensor:
    """Every rank's generated rows, right-padded to the longest, in rank order."""
    lengths = [None] * dist.get_world_size(group)
    communicate("all-gather of the generated lengths", group, 1,
                lambda: dist.all_gather_object(lengths, sequences.shape[1], group=group))
    longest = max(lengths)
    padded = torch.nn.functional.pad(sequences, (0, longest - sequences.shape[1]), value=pad_token_id)
    parts = [None] * dist.get_world_size(group)
    communicate("all-gather of the generated rows", group, 1, lambda: dist.all_gather_object(parts, padded.cpu(), group=group))
    return torch.cat([p for p in parts if p.shape[0]]).to(sequences.device)


def split_generate(wrapped, instance, args, kwargs):
    """Each rank of the CP group generates its share of the prompt rows; every rank returns all of them."""
    cp = get_cp_group()
    call = call_arguments(wrapped, args, kwargs)
    if torch.is_tensor(call.get("inputs")) and call.get("input_ids") is None:
        call["input_ids"] = call.pop("inputs")  # the prompt given positionally
    rows, kept = _rows_of(cp.rank, cp.size, call["input_ids"].shape[0])
    mine = _share_of_rows(instance, call, rows)
    # The ranks of a group share their random state: each draws from its own stream for its rows, and the shared
    # state advances the same on every rank (one draw for the streams' seed).
    seed = int(torch.randint(0, 2**62, (1,)))
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with disabled(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + cp.rank)
        out = wrapped(**mine)
    out = out if kept else out[:0]
    config = call.get("generation_config") or instance.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    return _gathered_rows(out, int(pad if pad is not None else 0), cp.group)


def cp_bypassed_generate(wrapped, instance, args, kwargs):
    # Incremental decoding keeps a cache per rank and feeds one token at a time: nothing to split. Ranks decode
    # different numbers of steps, so nothing inside may wait for the others (matched vision passes).
    with scoped(GENERATING, True):
        if not cp_requested():
            return wrapped(*args, **kwargs)
        kwargs = pixels_on_device(kwargs, instance.device)  # decoding alone: the whole batch's pixels are needed
        if SPLIT_ROLLOUT.get():
            return split_generate(wrapped, instance, args, kwargs)
        with disabled():
            return wrapped(*args, **kwargs)


GENERATE_PATCH = Patch(
    target="transformers.generation.utils.GenerationMixin.generate",
    wrapper=cp_bypassed_generate,
    reason="under CP: generation runs with CP bypassed (each rank decodes alone, as at P=1); in a split rollout of "
    "TRL's RL trainers each rank decodes its share of the rows",
    expects=("inputs", "generation_config"),
)
