"""Qwen3-VL and Qwen3-VL-MoE: the shared CP forward plus deepstack rows in the text-model patch."""

from __future__ import annotations

from ..patching import Patch
from .common import family_patches

FAMILIES = {
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLTextModel"),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeTextModel"),
}
TEXT_MODEL_PARAMS = ("inputs_embeds", "position_ids", "visual_pos_masks", "deepstack_visual_embeds")


def patches() -> list[Patch]:
    out = []
    for module, (top, text) in FAMILIES.items():
        out += family_patches(f"transformers.models.{module}.modeling_{module}", [top], text, TEXT_MODEL_PARAMS)
    return out
