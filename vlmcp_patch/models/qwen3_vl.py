"""Qwen3-VL and Qwen3-VL-MoE: the shared CP forward, plus the deepstack rows of the visual tokens.

Qwen3-VL adds vision features of several tower depths ("deepstack") to the hidden states of its visual
tokens in the first decoder layers: one row per visual token, in (batch, sequence) order. Under CP each
rank receives the merged and deepstack features of the visual tokens inside its slice only (`forward/vision.py`),
and stock's placement builds the rows of that slice.
"""

from __future__ import annotations

from ..offload import foreign_offload_problem
from ..patching import Patch
from ..supported import Family, register
from .base import ImageFeatures, MLPs, family_patches, mlp_patches, norm_patches, offload_patches

FAMILIES = register(
    Family("qwen3_vl", ("Qwen3VLForConditionalGeneration",), "Qwen3VLTextModel", "Qwen3VLModel", "Qwen3VLVisionModel",
           cp_check=foreign_offload_problem),
    Family(
        "qwen3_vl_moe", ("Qwen3VLMoeForConditionalGeneration",), "Qwen3VLMoeTextModel", "Qwen3VLMoeModel",
        "Qwen3VLMoeVisionModel", cp_check=foreign_offload_problem,
    ),
)
TEXT_MODEL_PARAMS = ("inputs_embeds", "position_ids", "visual_pos_masks", "deepstack_visual_embeds")
# Digests of the upstream Qwen3VLModel.get_image_features (the same in the MoE module) that the CP path replaces
# (`forward/vision.py`), with the releases each was checked on. Those in `deepstack_per_item` split the
# deepstack levels per image like the merged features; the older ones hand each level over whole.
IMAGE_FEATURES = ImageFeatures(
    digests={
        "a9cb67a8bec21ff6": "transformers>=5.2,<5.9",
        "905751267d7d5087": "transformers>=5.9,<5.15",
        "357792d495a52163": "transformers>=5.15,<5.18",
        "7cfd1145855212c0": "transformers>=5.18,<5.23",
        "cff98fb9fd0127c7": "transformers>=5.23,<5.26",
    },
    deepstack_per_item=frozenset({"7cfd1145855212c0", "cff98fb9fd0127c7"}),
)


# The MLPs that run in sequence tiles under CP (`tiles.py`), per family.
MLP_CLASSES = {
    "qwen3_vl": MLPs(gated=("Qwen3VLTextMLP",), vision=("Qwen3VLVisionMLP",)),
    "qwen3_vl_moe": MLPs(gated=("Qwen3VLMoeTextMLP",), vision=("Qwen3VLMoeVisionMLP",),
                         experts=("Qwen3VLMoeTextExperts",)),
}


# The decoder's RMSNorms, recomputed in backward under CP (`tiles.recomputed_norm_forward`): layers, q / k, final.
NORM_CLASSES = {"qwen3_vl": ("Qwen3VLTextRMSNorm",), "qwen3_vl_moe": ("Qwen3VLMoeTextRMSNorm",)}


# The decoder layers and vision blocks whose checkpoints VLMCP_OFFLOAD_CHECKPOINTS keeps on the host (`offload.py`).
CHECKPOINTED_LAYERS = {
    "qwen3_vl": ("Qwen3VLTextDecoderLayer", "Qwen3VLVisionBlock"),
    "qwen3_vl_moe": ("Qwen3VLMoeTextDecoderLayer", "Qwen3VLMoeVisionBlock"),
}


def patches() -> list[Patch]:
    return [
        patch for family in FAMILIES
        for patch in [*family_patches(family, TEXT_MODEL_PARAMS, IMAGE_FEATURES),
                      *mlp_patches(family, MLP_CLASSES[family.name]),
                      *norm_patches(family, NORM_CLASSES[family.name]),
                      *offload_patches(family, CHECKPOINTED_LAYERS[family.name])]
    ]
