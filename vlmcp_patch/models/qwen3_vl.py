"""Qwen3-VL and Qwen3-VL-MoE: only the patch declarations differ from the shared CP forward."""

from __future__ import annotations

from ..patching import Patch
from . import SUPPORTED_CLASSES
from .common import cp_text_model_forward, cp_top_level_forward

FAMILIES = {
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLTextModel"),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeTextModel"),
}

TOP_LEVEL_PARAMS = ("input_ids", "attention_mask", "position_ids", "labels", "pixel_values", "image_grid_thw")
TEXT_MODEL_PARAMS = ("inputs_embeds", "position_ids", "visual_pos_masks", "deepstack_visual_embeds")


def patches() -> list[Patch]:
    out = []
    for module, (top, text) in FAMILIES.items():
        path = f"transformers.models.{module}.modeling_{module}"
        SUPPORTED_CLASSES.append(top)
        out += [
            Patch(
                target=f"{path}.{top}.forward",
                wrapper=cp_top_level_forward,
                reason="under CP: validate, run vision/placement/mRoPE on the full sequence, then loss over the "
                "group or gathered logits",
                expects=TOP_LEVEL_PARAMS,
            ),
            Patch(
                target=f"{path}.{text}.forward",
                wrapper=cp_text_model_forward,
                reason="under CP: cut embeddings, mRoPE positions, visual mask and deepstack rows to this rank's "
                "slice before the decoder layers",
                expects=TEXT_MODEL_PARAMS,
            ),
        ]
    return out
