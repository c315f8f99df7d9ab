"""Qwen3-VL and Qwen3-VL-MoE: the shared CP forward, plus the deepstack rows of the visual tokens.

Qwen3-VL adds vision features of several tower depths ("deepstack") to the hidden states of its visual
tokens in the first decoder layers: one row per visual token, in (batch, sequence) order. Under CP each
rank keeps the rows of the visual tokens inside its slice.
"""

from __future__ import annotations

from ..context import CPContext
from ..patching import Patch
from ..supported import Family, register
from .base import family_patches

FAMILIES = register(
    Family("qwen3_vl", ("Qwen3VLForConditionalGeneration",), "Qwen3VLTextModel", "Qwen3VLModel", "Qwen3VLVisionModel"),
    Family(
        "qwen3_vl_moe", ("Qwen3VLMoeForConditionalGeneration",), "Qwen3VLMoeTextModel", "Qwen3VLMoeModel",
        "Qwen3VLMoeVisionModel",
    ),
)
TEXT_MODEL_PARAMS = ("inputs_embeds", "position_ids", "visual_pos_masks", "deepstack_visual_embeds")


def cut_deepstack_rows(call: dict, ctx: CPContext) -> None:
    """This rank's slice of the visual mask, and the deepstack rows of the visual tokens inside it."""
    mask = call.get("visual_pos_masks")
    if mask is None:
        return
    full = ctx.pad(mask, dim=1, value=False)
    row_of_token = (full.flatten().cumsum(0) - 1).view_as(full)  # deepstack row of each visual token
    local_mask = full[:, ctx.local_slice]
    rows = row_of_token[:, ctx.local_slice][local_mask]
    call["visual_pos_masks"] = local_mask
    embeds = call.get("deepstack_visual_embeds")
    if embeds is not None:
        call["deepstack_visual_embeds"] = [level[rows.to(level.device)] for level in embeds]


def patches() -> list[Patch]:
    return [patch for family in FAMILIES for patch in family_patches(family, TEXT_MODEL_PARAMS, cut_deepstack_rows)]
