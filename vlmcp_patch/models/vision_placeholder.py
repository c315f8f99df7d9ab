"""Matched vision passes under ZeRO-3: a placeholder pass where this micro-batch has no images (or videos).

ZeRO-3 partitions every weight over the data-parallel ranks and all-gathers each module's weights
when it runs (and reduce-scatters their gradients), so all ranks must run the same modules in the same
order. A replica whose micro-batch is text-only skips the vision tower that the others run, and the
job hangs — stock transformers too. Here every forward first agrees, in one tiny all-reduce over the
group ZeRO-3 partitions the vision weights over, on which modalities any rank has; a rank missing one
runs the stock forward with a placeholder of the smallest size the tower accepts (one merged token).
Its output goes through the stock placement with no placeholder token in the sequence: the scatter
places nothing and the deepstack rows add to no position, so it joins the graph with weight zero —
the loss is unchanged, its gradients are exactly zero, and forward and backward visit the tower at the
same points as on the ranks with real images.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist

from ..patching import Patch
from ..stats import STATS
from . import batch_device, batch_reference

# Modalities ("image", "video") of the running forward that carry a placeholder, not real inputs.
_PLACEHOLDERS: contextvars.ContextVar[frozenset] = contextvars.ContextVar("vlmcp_vision_placeholders",
                                                                           default=frozenset())
_INPUTS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


def _zero3_vision_group(model):
    """The process group ZeRO-3 partitions the vision tower's weights over (None when it does not)."""
    inner = getattr(model, "model", None)
    visual = getattr(inner, "visual", None)
    if visual is None:
        return None
    param = next(visual.parameters(), None)
    return getattr(param, "ds_process_group", None) if param is not None else None


def _placeholder_inputs(model, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Patches and grid of the smallest input the vision tower takes: one merged token."""
    vision = model.config.vision_config
    merge = vision.spatial_merge_size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.zeros(merge * merge, width, device=like.device, dtype=model.model.visual.dtype)
    grid = torch.tensor([[1, merge, merge]], device=like.device)
    return pixels, grid


def missing_modalities(model, call: dict) -> frozenset:
    """Modalities this rank must run as placeholders so its vision passes match the other ranks'."""
    group = _zero3_vision_group(model)
    if group is None:
        return frozenset()
    encoded = call.get("mm_encoder_outputs") or {}
    here = [call.get(_INPUTS[m][0]) is not None or encoded.get(m) is not None for m in _INPUTS]
    anywhere = torch.tensor(here, dtype=torch.int32, device=batch_device(call))
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=group)
    return frozenset(m for m, mine, any_rank in zip(_INPUTS, here, anywhere.tolist()) if any_rank and not mine)


@contextlib.contextmanager
def placeholders_in(model, call: dict):
    """Add placeholder vision inputs to `call` where other ranks have real ones (ZeRO-3 only)."""
    missing = missing_modalities(model, call)
    if not missing:
        yield
        return
    reference = batch_reference(call)
    for modality in missing:
        pixels_key, grid_key = _INPUTS[modality]
        call[pixels_key], call[grid_key] = _placeholder_inputs(model, reference)
    STATS.vision_placeholders += len(missing)
    token = _PLACEHOLDERS.set(missing)
    try:
        yield
    finally:
        _PLACEHOLDERS.reset(token)


def placeholder_unchecked_mask(wrapped, instance, args, kwargs):
    # The placeholder's features have no tokens in the sequence: skip stock's count check for them; the
    # mask it returns (the sequence's own placeholder tokens: none) places nothing.
    for modality in _PLACEHOLDERS.get():
        kwargs.pop(f"{modality}_features", None)
    return wrapped(*args, **kwargs)


def placeholder_free_positions(wrapped, instance, args, kwargs):
    # mRoPE positions come from the sequence's own images and videos, never the placeholder's grid.
    for modality in _PLACEHOLDERS.get():
        kwargs[_INPUTS[modality][1]] = None
    return wrapped(*args, **kwargs)


def patches(module_path: str, model_class: str) -> list[Patch]:
    return [
        Patch(
            target=f"{module_path}.{model_class}.get_placeholder_mask",
            wrapper=placeholder_unchecked_mask,
            reason="ZeRO-3 vision placeholder: its features match no token of the sequence by design",
            expects=("input_ids", "inputs_embeds", "image_features", "video_features"),
        ),
        Patch(
            target=f"{module_path}.{model_class}.compute_3d_position_ids",
            wrapper=placeholder_free_positions,
            reason="ZeRO-3 vision placeholder: its grid must not enter the mRoPE positions",
            expects=("image_grid_thw", "video_grid_thw"),
        ),
    ]
