"""Qwen3-VL and Qwen3-VL-MoE: the shared CP forward plus deepstack rows in the text-model patch."""

from __future__ import annotations

from ..patching import Patch
from . import vision_placeholder
from .common import family_patches

FAMILIES = {
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLTextModel", "Qwen3VLModel"),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeTextModel", "Qwen3VLMoeModel"),
}
TEXT_MODEL_PARAMS = ("inputs_embeds", "position_ids", "visual_pos_masks", "deepstack_visual_embeds")


def patches() -> list[Patch]:
    out = []
    for module, (top, text, multimodal) in FAMILIES.items():
        path = f"transformers.models.{module}.modeling_{module}"
        out += family_patches(path, [top], text, TEXT_MODEL_PARAMS)
        out += vision_placeholder.patches(path, multimodal)
    return out
